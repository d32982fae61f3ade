"""When a request stops, given the token it just sampled (vLLM's rules).

Below ``min_tokens`` nothing stops a request but ``max_tokens``. From there:
an EOS id (unless ``ignore_eos``), one of ``stop_token_ids``, or a stop string
in the text ends it with "stop"; reaching ``max_tokens`` ends it with "length".
Tokens are kept when a stop string hits; only the text is cut.
"""

from __future__ import annotations

from typing import Any

from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Request


def stop_reason(req: Request, token_id: int, stop_string_hit: bool) -> str | None:
    params = req.params
    if req.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in req.eos_token_ids:
            return "stop"
        if token_id in req.stop_token_set or stop_string_hit:
            return "stop"
    if req.num_output_tokens >= req.max_tokens:
        return "length"
    return None


def make_detokenizer(tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> Any:
    from kiln.engine.detokenizer import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
