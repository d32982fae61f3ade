"""The pieces of speculative decoding alone: n-gram lookup, draft-length adaptation, the config's
errors, and, statistically, that verification commits tokens from the target distribution."""

from __future__ import annotations

import re

import pytest
import torch
from kiln.engine.errors import ConfigError
from kiln.engine.sampler import Sampler, SamplingRow
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.spec_decode.config import SpeculativeConfig
from kiln.engine.spec_decode.proposer import NgramIndex, NgramProposer
from kiln.engine.spec_decode.verify import num_accepted, position_outputs


def test_lookup_takes_the_longest_suffix_and_its_latest_earlier_occurrence():
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 7, 8, 9, 4, 8, 9, 5, 6, 7, 8]
    # suffix "7 8" (n=2) occurred at 1..2, followed by 9 4 8; "8" alone last occurred at 5 (then 9 5 6).
    assert index.propose(tokens, 3) == [9, 4, 8]
    tokens += [9]  # suffix "7 8 9" (n=3) now: occurred at 1..3
    assert index.propose(tokens, 5) == [4, 8, 9, 5, 6]
    tokens += [42]  # never seen: nothing to propose
    assert index.propose(tokens, 3) == []
    assert index.propose([5], 3) == []


def test_lookup_never_matches_the_suffix_itself_and_may_run_into_it():
    index = NgramIndex(1, 3)
    assert index.propose([3, 3, 3], 4) == [3]  # "3 3" at 0..1 is followed by the suffix's last token only
    assert index.propose([1, 2, 1, 2, 1, 2], 4) == [1, 2]


class _Req:
    def __init__(self, tokens):
        self.token_ids = tokens
        self.spec_state = None


def test_draft_length_shrinks_with_low_acceptance_and_recovers():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.5))
    req = _Req([1, 2, 3, 1, 2, 3, 1, 2])
    assert proposer.num_drafts(req) == 4 and proposer.propose(req, 10) == [3, 1, 2]
    assert proposer.propose(req, 1) == [3]
    for _ in range(3):
        proposer.record(req, 4, 0)
    assert proposer.num_drafts(req) == 1
    for _ in range(4):
        proposer.record(req, 1, 1)
    assert proposer.num_drafts(req) == 4
    stats = proposer.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (7, 16, 4)
    assert stats.accepted_per_position == [4, 0, 0, 0] and stats.acceptance_rate == 0.25


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
    ({"disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
    ({"min_acceptance_rate": 1.5}, "speculative_config.min_acceptance_rate"),
    ({"k": 4}, "speculative_config.k"),
    ({"by_batch": {}}, "speculative_config.by_batch"),
    ({"by_batch": {"0": 4}}, r"speculative_config.by_batch['0']"),
    ({"by_batch": {"one": 4}}, r"speculative_config.by_batch['one']"),
    ({"by_batch": {"8": 5}}, r"speculative_config.by_batch['8']"),
    ({"by_batch": {"8": -1}}, r"speculative_config.by_batch['8']"),
    ("ngram", "speculative_config must be a dict"),
])
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        SpeculativeConfig.parse(value)


def test_by_batch_table_picks_the_bucket_at_or_above_the_running_batch():
    cfg = SpeculativeConfig.parse({"num_speculative_tokens": 4, "by_batch": {"1": 4, "2": 4, "4": 2, "8": 0}})
    assert cfg.by_batch == {1: 4, 2: 4, 4: 2, 8: 0}  # JSON's string keys become batch sizes
    assert [cfg.k_for_batch(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [4, 4, 2, 2, 0, 0, 0, 0]
    # Above every bucket: the largest one's; disable_by_batch_size still caps it.
    assert SpeculativeConfig(by_batch={1: 0, 4: 3}).k_for_batch(100) == 3
    assert SpeculativeConfig(by_batch={1: 0, 4: 3}).k_for_batch(1) == 0
    assert SpeculativeConfig(by_batch={4: 3}, disable_by_batch_size=2).k_for_batch(3) == 0
    assert SpeculativeConfig(num_speculative_tokens=5).k_for_batch(1000) == 5


def test_the_bucket_k_is_what_shrinks_with_low_acceptance():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.5))
    req = _Req([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1])
    assert proposer.propose(req, 10, k=2) == [2, 3] and proposer.num_drafts(req, 0) == 0
    proposer.record(req, 4, 1)  # acceptance 1.0 -> 0.625
    proposer.record(req, 4, 0)  # -> 0.3125: below the floor, k scales by 0.625
    assert proposer.num_drafts(req, 4) == 2 and proposer.num_drafts(req, 2) == 1


def test_engine_config_rejects_a_bad_speculative_config(toy_model):
    from kiln.engine.config import EngineConfig

    model_dir = toy_model("llama-tiny")
    with pytest.raises(ConfigError, match=r"speculative_config\.num_speculative_tokens must be"):
        EngineConfig(model=str(model_dir), speculative_config={"num_speculative_tokens": 99})
    assert EngineConfig(model=str(model_dir)).speculative_config is None


def test_position_outputs_and_acceptance():
    assert position_outputs([5], [7, 8]) == [[5], [5, 7], [5, 7, 8]]
    assert num_accepted([7, 8, 9], [7, 8, 1, 4]) == 2
    assert num_accepted([7, 8], [7, 8, 3]) == 2
    assert num_accepted([7], [2, 3]) == 0


# -- the committed tokens' distribution ---------------------------------------------------------

VOCAB = 5
PARAMS = SamplingParams(temperature=0.8, top_k=4, max_tokens=2)


def _logits(context: list[int]) -> torch.Tensor:
    """A fixed toy "model" over 5 tokens whose next-token logits depend on the last token."""
    table = torch.tensor([[1.0, 0.2, -0.5, 0.9, 0.0], [0.3, 1.1, 0.4, -1.0, 0.8], [0.0, 0.5, 1.2, 0.1, -0.3],
                          [0.7, -0.2, 0.6, 0.9, 0.2], [0.1, 0.9, 0.0, 0.5, 1.0]])
    return table[context[-1]].clone()


def _target_probs(context: list[int]) -> torch.Tensor:
    """The sampler's distribution after temperature and top-k, normalized."""
    logits = _logits(context) / PARAMS.temperature
    keep = logits >= logits.topk(PARAMS.top_k).values[-1]
    return torch.where(keep, logits, torch.tensor(float("-inf"))).softmax(-1)


def _first_two(n: int, drafts: list[int], correct: bool) -> torch.Tensor:
    """The first two committed tokens of ``n`` requests with context [0] and these drafts: sampled per
    position and verified (``correct``), or with a broken rule that redraws a rejected position from
    the whole distribution (the draft included) instead of the residual."""
    sampler, context = Sampler(), [0]
    outputs = position_outputs([], drafts)
    rows = [SamplingRow(PARAMS, context, out) for _ in range(n) for out in outputs]
    logits = torch.stack([_logits(context + out) for _ in range(n) for out in outputs])
    targets = sampler(logits, rows).token_ids.view(n, len(outputs)).tolist()
    firsts = []
    for t in targets:
        a = num_accepted(drafts, t)
        committed = drafts[:a] + [t[a]]
        if not correct and a == 0:
            probs = _target_probs(context)
            keep_draft = torch.rand(()) < probs[drafts[0]]
            committed = [drafts[0]] if keep_draft else [int(torch.multinomial(probs, 1))]
        firsts.append(committed)
    # Requests that committed one token sample the second without drafts (the next step).
    short = [i for i, c in enumerate(firsts) if len(c) == 1]
    if short:
        rows = [SamplingRow(PARAMS, context, firsts[i]) for i in short]
        logits = torch.stack([_logits(context + firsts[i]) for i in short])
        for i, tok in zip(short, sampler(logits, rows).token_ids.tolist(), strict=True):
            firsts[i].append(tok)
    pairs = torch.tensor([c[:2] for c in firsts])
    return torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).double()


def _chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was committed"
    expected = expected_probs[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))


def test_verified_tokens_follow_the_target_distribution():
    torch.manual_seed(1234)
    p0 = _target_probs([0])
    joint = torch.stack([p0[a] * _target_probs([0, a]) for a in range(VOCAB)]).flatten().double()
    drafts = [3, 3]  # p0(3) ~ 0.3 and p(3 | 3) ~ 0.3: both accepts and residual draws happen often
    assert 0.2 < float(p0[3]) < 0.5
    counts = _first_two(20_000, drafts, correct=True)
    assert _chi_square_p(counts, joint) > 1e-3
    # The test has the power to see a verifier that gets the residual wrong.
    assert _chi_square_p(_first_two(20_000, drafts, correct=False), joint) < 1e-6
