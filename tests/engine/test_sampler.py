"""Sampler semantics against reference implementations (transformers' logits processors)."""

from __future__ import annotations

import pytest
import torch
from kiln.engine.penalties import apply_penalties
from kiln.engine.sampler import Sampler, SamplerOutput, SamplingRow, sampling_probs
from kiln.engine.sampling_params import SamplingParams
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 1000


def make_row(params: SamplingParams, prompt=(), output=(), eos=(2,)) -> SamplingRow:
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params, list(prompt), list(output), gen, list(eos))


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution transformers would sample from, warpers in HF's order."""
    scores = logits.unsqueeze(0).clone()
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1)[0]


def test_all_greedy_is_exact_argmax():
    logits = random_logits(64)
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0)) for _ in range(64)])
    assert isinstance(out, SamplerOutput)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_greedy_rows_in_a_mixed_batch_are_exact_argmax():
    logits = random_logits(8)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.5, seed=3)] * 4
    params[2] = SamplingParams(temperature=0, logprobs=2)
    out = Sampler()(logits, [make_row(p) for p in params])
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert torch.equal(out.token_ids[greedy], logits[greedy].argmax(-1))


def test_sampler_does_not_modify_the_callers_logits():
    logits = random_logits(4)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, presence_penalty=1.0, min_tokens=3)
    Sampler()(logits, [make_row(params, prompt=[5, 6], output=[7]) for _ in range(4)])
    assert torch.equal(logits, before)


def _sequence(sampler: Sampler, logits_steps, params: SamplingParams, others: list[SamplingParams], pos: int):
    """Tokens a seeded request samples over several steps when placed at ``pos`` among ``others``."""
    row_params = others[:pos] + [params] + others[pos:]
    rows = [make_row(p) for p in row_params]
    tokens = []
    for step_logits in logits_steps:
        batch = random_logits(len(rows), seed=1000 + len(tokens))
        batch[pos] = step_logits
        tokens.append(int(sampler(batch, rows).token_ids[pos]))
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7),
    SamplingParams(temperature=1.2, min_p=0.01, seed=7, logprobs=1),
])
def test_seeded_rows_are_reproducible_whatever_the_batch(params):
    steps = [random_logits(1, seed=s, scale=1.0)[0] for s in range(20)]
    sampler = Sampler()
    alone = _sequence(sampler, steps, params, [], 0)
    others = [SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_k=500), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=1.0, repetition_penalty=1.5)]
    for pos in (0, 3, 5):
        torch.manual_seed(pos)  # the shared generator's state must not matter either
        assert _sequence(sampler, steps, params, others, pos) == alone
    other_seed = _sequence(sampler, steps, SamplingParams(**{**vars(params), "seed": 8}), [], 0)
    assert other_seed != alone


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=10),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.5, top_p=0.99),  # flat enough that the nucleus needs a full sort
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=2.0, top_k=VOCAB + 5),
])
def test_filtered_distribution_matches_transformers(params):
    logits = random_logits(6)
    rows = [make_row(params)] * 3 + [make_row(SamplingParams(temperature=1.0))] * 3  # mixed groups
    probs = sampling_probs(logits, rows)
    for i in range(3):
        ours = probs[i] / probs[i].sum()
        assert torch.allclose(ours, hf_probs(logits[i], params), atol=1e-6)
        assert torch.equal(ours > 0, hf_probs(logits[i], params) > 0)
    for i in range(3, 6):
        assert torch.allclose(probs[i], logits[i].softmax(-1), atol=1e-6)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.2),
])
def test_samples_only_ever_come_from_the_allowed_set(params):
    torch.manual_seed(0)
    logits = random_logits(1, vocab=8000, scale=2.5).expand(32, -1)
    allowed = hf_probs(logits[0], params) > 0
    assert 1 < int(allowed.sum()) < 2000  # a small part of the vocabulary: the check can fail
    sampler = Sampler()
    seen = torch.cat([sampler(logits, [make_row(params)] * 32).token_ids for _ in range(10)])
    assert bool(allowed[seen].all())
    assert len(set(seen.tolist())) > 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_follow_the_tempered_distribution(temperature):
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(1000, -1)
    params = SamplingParams(temperature=temperature)
    tokens = torch.cat([Sampler()(logits, [make_row(params)] * 1000).token_ids for _ in range(5)])
    freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
    expected = (logits[0].double() / temperature).softmax(-1)
    sigma = (expected * (1 - expected) / len(tokens)).sqrt()
    assert bool(((freq - expected).abs() <= 5 * sigma + 1e-3).all()), (freq, expected)


def test_seeded_frequencies_follow_the_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    gen_params = SamplingParams(temperature=1.0, seed=11)
    row = make_row(gen_params)
    tokens = torch.tensor([int(Sampler()(logits, [row]).token_ids[0]) for _ in range(4000)])
    freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
    expected = logits[0].double().softmax(-1)
    assert bool(((freq - expected).abs() < 0.03).all()), (freq, expected)


def test_repetition_penalty_matches_transformers():
    logits = random_logits(3)
    prompt, output = [5, 6, 7, 7, 900], [10, 5, 11]
    rows = [make_row(SamplingParams(temperature=0, repetition_penalty=1.3), prompt, output),
            make_row(SamplingParams(temperature=0), prompt, output),
            make_row(SamplingParams(temperature=1.0, repetition_penalty=0.7), output, prompt)]
    ours = apply_penalties(logits, rows)
    ref0 = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[:1].clone())
    ref2 = RepetitionPenaltyLogitsProcessor(0.7)(torch.tensor([output + prompt]), logits[2:].clone())
    assert torch.allclose(ours[0], ref0[0]) and torch.allclose(ours[2], ref2[0])
    assert torch.equal(ours[1], logits[1])
    penalized = Sampler()(logits[:2], rows[:2]).token_ids
    assert int(penalized[0]) == int(ref0[0].argmax())


def test_presence_and_frequency_penalties_follow_openai():
    logits = random_logits(2)
    output = [3, 3, 3, 8, 50]
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=-1.25)
    ours = apply_penalties(logits, [make_row(params, [8, 9, 9], output), make_row(SamplingParams(), [], output)])
    expected = logits[0].clone()
    for token in set(output):  # the prompt does not count
        expected[token] -= output.count(token) * -1.25 + 0.5
    assert torch.allclose(ours[0], expected)
    assert torch.equal(ours[1], logits[1])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, 20)
    logits[:, 2] = 10.0  # eos is by far the most likely
    logits[:, 7] = 9.0  # a stop token id
    logits[:, 4] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])
    rows = [make_row(params, output=[]), make_row(params, output=[4]), make_row(params, output=[4, 4])]
    assert Sampler()(logits, rows).token_ids.tolist() == [4, 4, 2]
    ignoring = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    assert Sampler()(logits[:1], [make_row(ignoring)]).token_ids.tolist() == [2]  # EOS stops nothing here
    random_params = SamplingParams(temperature=5.0, min_tokens=1, stop_token_ids=[7])
    tokens = Sampler()(logits[:1].expand(256, -1), [make_row(random_params)] * 256).token_ids
    assert not bool(((tokens == 2) | (tokens == 7)).any())


def test_logprobs_come_from_the_raw_logits_with_sorted_alternatives():
    logits = random_logits(4)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, logprobs=0),
              SamplingParams(temperature=1.0, repetition_penalty=2.0, logprobs=5), SamplingParams(temperature=0)]
    rows = [make_row(p, prompt=[1, 2, 3]) for p in params]
    out = Sampler()(logits, rows)
    reference = logits.log_softmax(-1)
    asked = [0, 1, 2]
    expected = reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs[asked], expected[asked])
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    assert torch.equal(out.top_ids[asked], reference.topk(5).indices[asked])
    assert torch.allclose(out.top_logprobs[asked], reference[asked].gather(1, out.top_ids[asked]))
    assert bool((out.top_logprobs[asked, :-1] >= out.top_logprobs[asked, 1:]).all())
    assert bool(out.logprobs[3].isnan()) and bool((out.top_ids[3] == -1).all())  # row 3 did not ask


def test_logprobs_for_a_whole_batch():
    logits = random_logits(3)
    out = Sampler()(logits, [make_row(SamplingParams(temperature=1.0, top_k=3, logprobs=2))] * 3)
    reference = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert torch.equal(out.top_ids, reference.topk(2).indices)


def test_logprobs_zero_gives_no_alternatives():
    out = Sampler()(random_logits(2), [make_row(SamplingParams(temperature=0, logprobs=0))] * 2)
    assert out.logprobs is not None and out.top_ids.shape == (2, 0)


def test_mismatched_rows_are_rejected_clearly():
    with pytest.raises(ValueError, match="sampling rows"):
        Sampler()(random_logits(3), [make_row(SamplingParams())] * 2)


def reference_top_p_support(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's rule (sort ascending, drop while the cumulative mass is <= 1 - top_p), in float64."""
    sorted_probs, order = probs.double().sort()
    drop = sorted_probs.cumsum(-1) <= 1 - top_p
    drop[-1] = False
    return ~drop.scatter(0, order, drop)


# Nucleus sizes: all in the first candidate tier (32), some in the second (128), in the third (1024),
# past every tier (a full sort).
@pytest.mark.parametrize("scale", [8.0, 5.0, 3.0, 0.3])
def test_top_p_is_exact_whichever_candidate_tier_finds_it(scale):
    logits = random_logits(4, vocab=8000, seed=5, scale=scale)
    probs = sampling_probs(logits, [make_row(SamplingParams(top_p=0.9))] * 4)
    for i in range(4):
        expected = reference_top_p_support(logits[i].softmax(-1), 0.9)
        assert torch.equal(probs[i] > 0, expected)
    sizes = [int((probs[i] > 0).sum()) for i in range(4)]
    assert {8.0: max(sizes) < 32, 5.0: 32 < max(sizes) < 128, 3.0: 128 < min(sizes) and max(sizes) < 1024,
            0.3: min(sizes) > 1024}[scale], sizes


def test_tied_logits_sample_the_same_whatever_the_batch():
    # bf16 logits have many exact ties; tie order must not leak batch composition into seeded rows.
    logits = (random_logits(1, vocab=4000, seed=9) * 4).round() / 4
    params = SamplingParams(temperature=1.0, top_p=0.8, top_k=300, seed=3)
    alone, crowded = Sampler(), Sampler()
    rows_alone = [make_row(params)]
    rows_crowded = [make_row(SamplingParams(temperature=1.0, top_k=2000)), make_row(params),
                    make_row(SamplingParams(temperature=0.5, top_p=0.99))]
    batch = torch.cat([random_logits(1, 4000, seed=1), logits, random_logits(1, 4000, seed=2)])
    for _ in range(30):
        assert int(alone(logits, rows_alone).token_ids[0]) == int(crowded(batch, rows_crowded).token_ids[1])


def test_rows_without_finite_logits_still_get_a_valid_token_id():
    logits = random_logits(3, vocab=50)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    out = Sampler()(logits, [make_row(SamplingParams(temperature=1.0, top_p=0.5))] * 3)
    assert bool(((out.token_ids >= 0) & (out.token_ids < 50)).all())


def test_tiny_temperatures_are_greedy():
    logits = random_logits(16)
    out = Sampler()(logits, [make_row(SamplingParams(temperature=1e-7, top_p=0.5))] * 16)
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("vocab", [512, 700])  # a whole number of draw blocks, and not
def test_draws_reach_every_block_in_proportion(vocab):
    torch.manual_seed(2)
    logits = torch.full((1, vocab), float("-inf"))
    chosen = torch.tensor([0, 255, 256, 300, vocab - 1])
    logits[0, chosen] = torch.tensor([0.0, 1.0, 0.5, -0.5, 0.2])
    tokens = torch.cat([Sampler()(logits.expand(400, -1), [make_row(SamplingParams())] * 400).token_ids
                        for _ in range(10)])
    freq = torch.bincount(tokens, minlength=vocab).double() / len(tokens)
    expected = logits[0].double().softmax(-1)
    assert bool((freq[expected == 0] == 0).all())
    assert bool(((freq - expected).abs() < 0.03).all())


def test_block_argmax_is_exactly_argmax_with_ties():
    logits = (random_logits(64, vocab=32000, seed=4) * 2).round()  # many tied maxima
    logits[3, 31999] = 100.0
    logits[5, :] = 1.0
    rows = [make_row(SamplingParams(temperature=0))] * 64
    assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(-1))


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.zeros(1, 300)
    logits[:, :5] = 3.0
    logits[:, 5:150] = 2.0  # 145 tokens tied at the 6th place: past the first candidate tier
    params = [SamplingParams(top_k=6), SamplingParams(top_k=6, top_p=0.5), SamplingParams(top_k=6, top_p=0.05),
              SamplingParams(top_k=6, top_p=0.09)]
    probs = sampling_probs(logits.expand(4, -1), [make_row(p) for p in params])
    # Nuclei of 0.5 and 0.09 of the top-k mass end inside the tied group (0.09 only when all of the
    # tied tokens count towards that mass), 0.05 inside the top 5: ties stay together.
    assert [int((row > 0).sum()) for row in probs] == [150, 150, 5, 150]


def test_top_k_keeps_tokens_too_unlikely_to_move_the_cumulative_mass():
    logits = torch.tensor([[0.0, 0.0, -30.0, -40.0, -50.0]])
    params = SamplingParams(top_k=3)
    assert torch.equal(sampling_probs(logits, [make_row(params)])[0] > 0, hf_probs(logits[0], params) > 0)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_logprob_alternatives_in_a_large_vocabulary_with_ties(k):
    logits = (random_logits(8, vocab=32000, seed=6) * 4).round() / 4  # tied values, as bf16 logits have
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0, logprobs=k))] * 8)
    reference = logits.log_softmax(-1)
    assert torch.equal(out.top_logprobs, reference.topk(k).values)
    assert torch.equal(reference.gather(1, out.top_ids), out.top_logprobs)
    assert all(len(set(row)) == k for row in out.top_ids.tolist())


@pytest.mark.parametrize("params", [SamplingParams(top_k=7), SamplingParams(top_k=60, top_p=0.7)])
def test_top_k_in_a_large_vocabulary_matches_transformers(params):
    logits = random_logits(4, vocab=32000, seed=8)
    probs = sampling_probs(logits, [make_row(params)] * 4)
    for i in range(4):
        assert torch.equal(probs[i] > 0, hf_probs(logits[i], params) > 0)
        assert torch.allclose(probs[i] / probs[i].sum(), hf_probs(logits[i], params), atol=1e-6)


def test_grammar_masks_only_constrained_rows_and_comes_first(toy_model):
    """A regex grammar allows a few ids; its rows pick among them (greedy: the best of them, sampled:
    only them, logprobs: the others -inf) while the free row in the same batch is untouched."""
    from kiln.engine.structured.compiler import GrammarCompiler
    from kiln.engine.structured.params import StructuredOutputsParams
    from kiln.engine.tokenizer import load_tokenizer

    model_dir = toy_model("llama-tiny")
    tokenizer = load_tokenizer(str(model_dir))
    vocab = 1024
    compiled = GrammarCompiler(tokenizer, vocab, [2]).compile(StructuredOutputsParams(regex="[0-9]+"))
    allowed = torch.zeros(vocab, dtype=torch.bool)
    for token in range(vocab):
        allowed[token] = compiled.new_state().validate([token]) == 1
    assert 1 < int(allowed.sum()) < vocab
    logits = random_logits(3, vocab, seed=11)
    logits[:, ~allowed] += 50.0  # the global argmax is a refused token in every row
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=3)]
    rows = [make_row(p) for p in params]
    rows[0].grammar, rows[2].grammar = compiled.new_state(), compiled.new_state()
    expected_free = int(logits[1].argmax())
    best_allowed = int(torch.where(allowed, logits[0], float("-inf")).argmax())
    out = Sampler()(logits.clone(), rows)
    assert out.token_ids.tolist()[:2] == [best_allowed, expected_free]
    assert bool(allowed[out.token_ids[2]])
    # Logprobs are the constrained distribution's: the refused tokens, 50 logits higher, are not in the top 5.
    assert bool(allowed[out.top_ids[0]].all())
    masked = torch.where(allowed, logits[0], float("-inf")).log_softmax(-1)
    assert torch.allclose(out.top_logprobs[0], masked.topk(5).values)
    # Even +100 of logit_bias on a refused token cannot bring it back: the mask comes first.
    biased = make_row(SamplingParams(temperature=0, logit_bias={int((~allowed).nonzero()[0]): 100.0}))
    biased.grammar = compiled.new_state()
    assert bool(allowed[Sampler()(logits[:1].clone(), [biased]).token_ids[0]])
