"""When a request stops, given the token it just sampled (vLLM's rules).

Below ``min_tokens`` nothing stops a request but ``max_tokens``. From there:
an EOS id (unless ``ignore_eos``), one of ``stop_token_ids``, or a stop string
in the text ends it with "stop"; reaching ``max_tokens`` ends it with "length".
Tokens are kept when a stop string hits; only the text is cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Request


def stop_reason(req: Request, token_id: int, stop_string_hit: bool) -> str | None:
    params = req.params
    if req.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in req.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids or stop_string_hit:
            return "stop"
    if req.num_output_tokens >= req.max_tokens:
        return "length"
    return None


def make_detokenizer(tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> Any:
    try:
        from kiln.engine.detokenizer import IncrementalDetokenizer
    except ImportError:  # until the sampling helper's detokenizer lands
        return _FullDecode(tokenizer, params)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)


@dataclass
class _Step:
    text_delta: str
    stop_string_hit: bool


class _FullDecode:
    """Decodes the whole output each step; holds back a trailing partial character."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer, self.params, self.ids, self.text = tokenizer, params, [], ""

    def append(self, new_ids: list[int]) -> _Step:
        self.ids.extend(new_ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.params.skip_special_tokens)
        if full.endswith("\ufffd"):
            return _Step("", False)
        for s in self.params.stop:
            at = full.find(s)
            if at >= 0:
                end = at + len(s) if self.params.include_stop_str_in_output else at
                delta, self.text = full[len(self.text):end], full[:end]
                return _Step(delta, True)
        delta, self.text = full[len(self.text):], full
        return _Step(delta, False)
