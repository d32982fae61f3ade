"""The per-request limits of an engine: one home for the prompt and max_tokens rules.

``LLMEngine.make_request`` applies them to every request; the HTTP server applies the
same functions before admitting a request, so a client gets the 400 without the request
ever taking a slot, and both say the same thing. Plain Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.engine.errors import RequestError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for these


def check_prompt(ids: Sequence[int], max_input_len: int, vocab_size: int, param: str = "prompt") -> None:
    """Refuse an empty prompt, one over ``max_input_len``, or one holding ids outside the vocabulary."""
    if not ids:
        raise RequestError(param, f"{param} is empty; send at least one token of input")
    if len(ids) > max_input_len:
        raise RequestError(param, f"{param} is {len(ids)} tokens long, over this engine's max_input_len "
                                  f"({max_input_len}); shorten it", code=CONTEXT_LENGTH_EXCEEDED)
    check_token_ids(ids, vocab_size, param)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """Refuse ids outside the vocabulary ``[0, vocab_size)``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(param, f"{param} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def resolve_max_tokens(requested: int | None, num_prompt: int, max_seq_len: int, param: str = "max_tokens",
                       default: int | None = None) -> int:
    """``requested`` (else ``default``, capped, else all the room left) checked against ``max_seq_len``."""
    room = max_seq_len - num_prompt
    if requested is None:
        return min(default, room) if default is not None else room
    if requested > room:
        raise RequestError(param, f"{param} is {requested} but the prompt uses {num_prompt} of this engine's "
                                  f"max_seq_len ({max_seq_len}) tokens, leaving {room}; lower {param} to {room} or "
                                  "less, or shorten the prompt", code=CONTEXT_LENGTH_EXCEEDED)
    return requested
