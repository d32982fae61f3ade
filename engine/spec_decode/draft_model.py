"""Draft-model speculation: a smaller model of the same tokenizer proposes its greedy continuation.

The draft runs on rank 0 only and unsharded (as a world of one, whatever the target's tensor and
pipeline parallelism: ``parallel.shard_context``), through kiln's own ``ModelRunner``. Its KV pool
has as many blocks as the target's and is addressed by the *target's* block tables: block ``b`` of
the draft pool holds the draft's K/V of the tokens whose target K/V is in block ``b``. So the
block manager's accounting covers both models, and trimming a rejected draft's blocks frees both.

Per request the draft keeps ``draft_computed``, the leading tokens whose draft K/V is written. To
propose ``k`` tokens for a request of ``n`` committed tokens it runs one pass over the tokens it
has not seen (``[draft_computed, n)``, a chunk like a prefill: the whole prompt the first time,
the tokens committed since then afterwards), whose last logits give draft 1, then ``k - 1``
single-token passes, each feeding the previous draft (positions ``n .. n + k - 2``; the scheduler
allocated blocks through ``n + k - 1`` for the verified row). All speculating requests share each
pass. After verification accepts ``a`` drafts, the draft's K/V is valid through ``n + min(a, k - 1)``.

Greedy drafts are point masses, for which the verifier's accept-or-resample rule is exact rejection
sampling (``verify.py``): committed tokens follow the target distribution whatever the draft says.
A draft's K/V is a function of the tokens alone, so rewriting a block another request shares
(a prefix-cache hit) writes the same values; a request starts at ``draft_computed = 0`` and a
preempted one starts over, so a block is never read before this request's draft wrote it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from kiln.engine import parallel
from kiln.engine.artifact import weights_file_name
from kiln.engine.config import EngineConfig, read_hf_config
from kiln.engine.errors import ConfigError
from kiln.engine.kv_cache import bytes_per_block
from kiln.engine.model_runner import ModelRunner
from kiln.engine.models.llama import head_dim_of, kv_heads_of
from kiln.engine.sequence import Request
from kiln.engine.spec_decode.config import SpeculativeConfig
from kiln.engine.spec_decode.proposer import Proposer
from kiln.engine.step_inputs import pack_rows

DRAFT_PENDING = -1  # a slot the scheduler reserved for a draft token the draft model fills this step
ARTIFACT_DRAFT_DIR = "draft"  # an artifact's draft model: config.json, tokenizer files, weights/rank-0-of-1


def draft_block_bytes(target: EngineConfig, draft_dir: str) -> int:
    """Bytes of the draft's K/V per block of ``target.block_size`` tokens (in the target's KV dtype)."""
    cfg = read_hf_config(Path(draft_dir))
    return bytes_per_block(target, int(cfg["num_hidden_layers"]), int(kv_heads_of(cfg)), head_dim_of(cfg))


def draft_engine_config(target: EngineConfig, draft_dir: str, num_blocks: int) -> EngineConfig:
    """The draft's EngineConfig: the target's dtypes, device, block size, limits and attention backend,
    a pool of ``num_blocks`` blocks, eager; ConfigError naming ``speculative_config.model``."""
    root = Path(draft_dir)
    weights = root / "weights" / weights_file_name(0, 1)  # an artifact's draft: engine weights, one rank
    try:
        return EngineConfig(
            model=str(root), weights_dir=str(weights.parent) if weights.is_file() else None, dtype=target.dtype,
            kv_cache_dtype=target.kv_cache_dtype, quantization=target.quantization, device=target.device,
            block_size=target.block_size, num_kv_blocks=num_blocks, max_batch_size=target.max_batch_size,
            max_num_tokens=target.max_num_tokens, max_seq_len=target.max_seq_len, enforce_eager=True,
            attention_backend=target.attention_backend, compile="off", seed=target.seed)
    except ConfigError as exc:
        raise ConfigError(f"speculative_config.model {draft_dir}: the draft model cannot run beside the target: "
                          f"{exc}") from None


def tokenizer_mismatch(target_tokenizer, draft_dir: str) -> str | None:
    """Why the draft's tokenizer is not the target's (the first token whose id differs), or None when the
    two map every token to the same id, or when the draft directory has no tokenizer to compare."""
    root = Path(draft_dir)
    if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from kiln.engine.tokenizer import load_tokenizer

    theirs, ours = load_tokenizer(draft_dir).get_vocab(), target_tokenizer.get_vocab()
    for token, i in sorted(ours.items(), key=lambda kv: kv[1]):
        if i < len(theirs) and theirs.get(token) != i:
            return (f"token {token!r} is id {i} for the target and {theirs.get(token)} for the draft; a draft model "
                    f"must share the target's tokenizer (pick one of the same family)")
    return None


class DraftModel:
    """The draft model's weights and KV pool on rank 0, and its proposals."""

    def __init__(self, target: EngineConfig, draft_dir: str, num_blocks: int, target_vocab: int) -> None:
        self.model_dir = draft_dir
        self.config = draft_engine_config(target, draft_dir, num_blocks)
        # Embedding tables are padded differently within a family (151936 vs 152064): the shared ids count.
        self.vocab = min(int(self.config.hf_config["vocab_size"]), target_vocab)
        self.max_num_tokens = target.max_num_tokens
        with parallel.shard_context(0, 1, 1):
            self.runner = ModelRunner(self.config)

    @torch.inference_mode()
    def run(self, rows: list[tuple[list[int], int, list[int]]], logits: bool) -> list[int]:
        """One pass over ``rows`` (single-token rows first); the greedy token after each row's last if asked."""
        ends = list(itertools.accumulate(len(ids) for ids, _, _ in rows))
        inputs = pack_rows(rows, self.config.block_size, [e - 1 for e in ends] if logits else [])
        with parallel.shard_context(0, 1, 1):
            out = self.runner.execute(inputs)
        return out[:, :self.vocab].argmax(-1).tolist() if logits else []

    def catch_up(self, reqs: list[Request], states: list) -> None:
        """Write the draft's K/V of every token but each request's last, in passes of at most
        ``max_num_tokens`` tokens, until the last pass (every request's unseen tokens) fits one."""
        while True:
            unseen = [r.num_tokens - s.draft_computed for r, s in zip(reqs, states, strict=True)]
            if sum(unseen) <= self.max_num_tokens:
                return
            rows, budget = [], self.max_num_tokens
            for r, s, n in zip(reqs, states, unseen, strict=True):
                take = min(n - 1, budget)
                if take > 0:
                    rows.append((r.token_ids[s.draft_computed:s.draft_computed + take], s.draft_computed, r.block_table))
                    s.draft_computed += take
                    budget -= take
            rows.sort(key=lambda row: len(row[0]) > 1)
            self.run(rows, logits=False)

    def propose(self, reqs: list[Request], states: list) -> None:
        """Fill each request's ``spec_token_ids`` (as many placeholders as it holds) with greedy drafts."""
        self.catch_up(reqs, states)
        want = {id(r): len(r.spec_token_ids) for r in reqs}
        order = sorted(zip(reqs, states, strict=True), key=lambda rs: rs[0].num_tokens - rs[1].draft_computed > 1)
        rows = [(r.token_ids[s.draft_computed:], s.draft_computed, r.block_table) for r, s in order]
        for (r, s), tok in zip(order, self.run(rows, logits=True), strict=True):
            r.spec_token_ids = [tok]
            s.draft_computed = s.draft_start = r.num_tokens
        for j in range(1, max(want.values())):
            active = [r for r, _ in order if want[id(r)] > j]
            rows = [([r.spec_token_ids[-1]], r.num_tokens + j - 1, r.block_table) for r in active]
            for r, tok in zip(active, self.run(rows, logits=True), strict=True):
                r.spec_token_ids.append(tok)


class DraftModelProposer(Proposer):
    """Drafts from a draft model: reserved by the scheduler (placeholders), filled once blocks are allocated."""

    deferred = True

    def __init__(self, config: SpeculativeConfig, draft: DraftModel) -> None:
        super().__init__(config)
        self.draft = draft

    def propose(self, req, max_drafts: int, k: int | None = None) -> list[int]:
        return [DRAFT_PENDING] * max(0, min(self.num_drafts(req, k), max_drafts))

    def fill(self, reqs: list) -> None:
        if reqs:
            self.draft.propose(reqs, [self._state(r) for r in reqs])

    def record(self, req, num_proposed: int, num_accepted: int) -> None:
        super().record(req, num_proposed, num_accepted)
        if num_proposed:  # drafts 1..k-1 were fed at n..n+k-2; the accepted ones among them stay valid
            state = self._state(req)
            state.draft_computed = state.draft_start + min(num_accepted, num_proposed - 1)
