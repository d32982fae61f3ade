"""A step's sampled rows with speculation: a verifying request has one logits row per position.

The runner packs a verified row like a prefill chunk (the last committed token, then its ``k``
drafts) and samples all ``k + 1`` positions; these helpers say which logits rows those are, list
the requests in that row order (a verifying request ``k + 1`` times in a row, which is how
``LLMEngine._postprocess`` finds its positions), and build one sampling row per position, each
sampled as if the drafts before it were already output (``verify.position_outputs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.engine.sampler import SamplingRow
from kiln.engine.sequence import Request
from kiln.engine.spec_decode.verify import position_outputs, save_generator


def sampled_positions(reqs: list[Request], starts: list[int], nums: list[int], cu: Sequence[int]
                      ) -> tuple[list[int], list[Request]]:
    """(logits row of each sampled position, its request) for the rows that reach their last token:
    one position for a finished prefill or a decode, ``k + 1`` for a row verifying ``k`` drafts."""
    rows: list[int] = []
    owners: list[Request] = []
    for i, r in enumerate(reqs):
        if starts[i] + nums[i] < r.num_tokens:
            continue  # a prefill chunk in the middle of the prompt: no token
        k = len(r.spec_token_ids)
        rows.extend(int(cu[i]) - 1 - k + j for j in range(k + 1))
        owners.extend([r] * (k + 1))
    return rows, owners


def sampling_rows(sampled_reqs: list[Request]) -> list[SamplingRow]:
    """One sampling row per sampled position; a seeded request's generator is saved before its drafts draw."""
    rows: list[SamplingRow] = []
    for i, r in enumerate(sampled_reqs):
        if i and sampled_reqs[i - 1] is r:
            continue  # a verified row's positions, added with its first
        save_generator(r)
        rows.extend(SamplingRow(r.params, r.prompt_token_ids, output, r.generator, r.eos_token_ids, r.grammar)
                    for output in position_outputs(r.output_token_ids, r.spec_token_ids))
    return rows
