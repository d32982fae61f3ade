"""Incremental detokenization and stop strings, one instance per request.

Two things make streaming text harder than ``tokenizer.decode`` at the end:

* A token may carry only part of a UTF-8 character (byte-level BPE splits "漢" into three
  tokens). As in vLLM and HF's ``TextStreamer``, each step decodes only a small window of
  ids, from ``_prefix_offset`` (a few tokens of context, so tokenizers that decode a word's
  leading space from its neighbours do so) to the end, and subtracts the decoded context.
  While the window's text ends in U+FFFD the character may still be incomplete: nothing is
  released and the window grows until it completes (or the request finishes). Each step
  therefore costs O(window), not O(output).
* A stop string may span tokens, and text that could be the start of one must not be
  streamed before we know. Unless ``include_stop_str_in_output``, the longest suffix of
  the decoded text that is a prefix of some stop string is held back. A stop string is
  searched in the new text plus the last ``len(longest stop) - 1`` characters before it,
  so it is found even when it spans tokens, in O(new text) per step.

``.text`` is the output so far, held-back text included; only a trailing incomplete
character waits for ``finish()``. The engine must call ``finish()`` when a request ends
for any reason and stream what it returns. Then the deltas joined equal ``.text``, which
equals ``tokenizer.decode(output_ids, skip_special_tokens=...)`` cut at the stop string.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.engine.sampling_params import SamplingParams

# Prompt tokens decoded as context for the first output tokens (vLLM uses the same number).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerStep:
    text_delta: str  # new text to stream; "" while text is held back
    stop_string_hit: bool  # the output ends here: the request should stop with "stop"


def raw_decoder(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust ``tokenizers.Tokenizer.decode`` behind a fast tokenizer, when calling it directly is
    exactly ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.

    transformers' wrapper adds only argument normalization and the optional clean-up (off
    here) around that call, yet costs more than the decode itself for the few ids of a window
    (about a fifth of a batch-64 step on a tiny model). Tokenizer classes that override
    ``decode`` or ``_decode`` (slow ones, Whisper, ...) keep the wrapper.
    """
    from kiln.engine.light_tokenizer import LightTokenizer

    if isinstance(tokenizer, LightTokenizer):  # its decode is the backend's, and the clean-up is refused
        return tokenizer.backend_tokenizer.decode
    if not type(tokenizer).__module__.startswith("transformers"):
        return None  # not transformers' (a test's stand-in): its own decode
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the public API is always right
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls._decode is TokenizersBackend._decode
            and cls.decode is PreTrainedTokenizerBase.decode):
        backend = getattr(tokenizer, "_tokenizer", None)
        decode = getattr(backend, "decode", None)
        return decode if callable(decode) else None
    return None


class IncrementalDetokenizer:
    """One request's output text, fed token ids as they are sampled (see the module docstring)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._raw_decode = raw_decoder(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        # Holding back text is only needed when the stop string must not appear in the output.
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._max_hold = 0 if self._include_stop else max(self._max_stop_len - 1, 0)
        self._prefixes = StopPrefixes(self._stops) if self._max_hold else None
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: decoding it as context would merge bytes
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []
        self._pending = ""  # decoded, not yet returned: it may be the start of a stop string
        self._recent = ""  # the last characters returned, where a stop string may begin
        self._is_stopped = False
        self._is_finished = False

    @property
    def text(self) -> str:
        return "".join(self._pieces) + self._pending

    @property
    def is_stopped(self) -> bool:
        """A stop string was found; later tokens add no text."""
        return self._is_stopped

    def append(self, new_token_ids: Sequence[int]) -> DetokenizerStep:
        if self._is_finished:
            raise RuntimeError("append() after finish(): the request's text is already complete")
        if self._is_stopped or not new_token_ids:
            return DetokenizerStep("", self._is_stopped)
        self._ids.extend(new_token_ids)
        return self._release(self._decode_new(flush=False), final=False)

    def finish(self) -> str:
        """Release whatever is held back (an incomplete character, a partial stop string)."""
        if self._is_finished:
            return ""
        self._is_finished = True
        if self._is_stopped:
            return ""
        return self._release(self._decode_new(flush=True), final=True).text_delta

    def _decode(self, ids: Sequence[int]) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_new(self, flush: bool) -> str:
        """Text of the ids past ``_read_offset``, or "" while it may end mid-character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if not flush and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _release(self, new_text: str, final: bool) -> DetokenizerStep:
        window = self._pending + new_text
        cut = self._find_stop(window)
        if cut is not None:
            self._is_stopped = True
            self._pending = ""
            return self._emit(window[:cut], stop_string_hit=True)
        hold = 0 if final else self._hold_length(window, new_text)
        self._pending = window[len(window) - hold:]
        return self._emit(window[:len(window) - hold], stop_string_hit=False)

    def _emit(self, delta: str, stop_string_hit: bool) -> DetokenizerStep:
        if delta:
            self._pieces.append(delta)
            if self._max_stop_len > 1:
                self._recent = (self._recent + delta)[-(self._max_stop_len - 1):]
        return DetokenizerStep(delta, stop_string_hit)

    def _find_stop(self, window: str) -> int | None:
        """Where in ``window`` the output ends, if a stop string completes in it.

        The stop string that completes first wins (the longer one on a tie), as if text
        arrived a character at a time. The search includes the tail of the text already
        returned, where a stop string may begin when it is to be included in the output.
        """
        searched = self._recent + window
        best: tuple[int, int] | None = None  # (end, -start)
        for stop in self._stops:
            start = searched.find(stop)
            if start != -1 and (best is None or (start + len(stop), -start) < best):
                best = (start + len(stop), -start)
        if best is None:
            return None
        cut = best[0] if self._include_stop else -best[1]
        return max(cut - len(self._recent), 0)

    def _hold_length(self, window: str, new_text: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop string.

        Text that could begin a stop string is never released (that is what holding means),
        so that suffix always lies inside ``window``: the automaton, fed each new
        character once, knows it in amortized O(1) per character, whatever the number or
        length of the stop strings.
        """
        if self._prefixes is None:
            return 0
        return min(self._prefixes.feed(new_text), len(window))


class StopPrefixes:
    """Aho-Corasick automaton over the stop strings, tracking one quantity: after each
    character fed, the length of the longest suffix of all text fed that is a prefix of
    some stop string. Built once per request in O(total stop characters)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        for stop in stops:
            node = 0
            for ch in stop:
                child = self._goto[node].get(ch)
                if child is None:
                    child = len(self._goto)
                    self._goto.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[node] + 1)
                    self._goto[node][ch] = child
                node = child
        queue = deque(self._goto[0].values())  # breadth first: a node's fail link is shallower
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                self._fail[child] = self._next(self._fail[node], ch) if node else 0
                queue.append(child)
        self._state = 0

    def _next(self, state: int, ch: str) -> int:
        while state and ch not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(ch, 0)

    def feed(self, text: str) -> int:
        state = self._state
        for ch in text:
            state = self._next(state, ch)
        self._state = state
        return self._depth[state]
