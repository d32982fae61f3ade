"""Reasoning parsers: a thinking model's ``<think>...</think>`` kept apart from its answer.

``kiln serve --reasoning-parser NAME`` takes vLLM's names. Both parsers here read the same markers
and differ only in where an output begins:

- ``deepseek_r1``: in the thinking (DeepSeek-R1 and its distills, QwQ: the template opens
  ``<think>``, or the model writes it first, or older R1 checkpoints write neither);
- ``qwen3``: in the answer, unless the output opens ``<think>`` itself or the rendered prompt
  ends with an open ``<think>`` (Qwen3's thinking-only templates); a Qwen3 output with no
  ``<think>`` (``enable_thinking`` off) is all answer.

The thinking ends at ``</think>``; an output cut before it is all thinking. The same rule reads a
whole output (:meth:`ReasoningParser.split`) and a stream (:class:`ReasoningStream`), so a streamed
reply splits exactly as the same reply unstreamed. A request whose answer is constrained to JSON
(``json_schema``, ``json_object``, a forced tool call) starts in the answer: the grammar applies from
the first token, so the model does not think first (docs/serving.md, "Reasoning").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """One ``--reasoning-parser``: where an output begins (``thinks_first``) and its markers."""

    name: str
    thinks_first: bool  # an output with no <think> is thinking (deepseek_r1) or answer (qwen3)
    start: str = THINK_START
    end: str = THINK_END

    def for_request(self, prompt_ids: list[int], tokenizer: Any, constraint: Any = None,
                    continued: bool = False) -> Reasoning:
        """How one request's outputs split: whether its rendered prompt ends inside an open ``<think>``
        (the template opened it), whether ``constraint`` makes the answer JSON from the first token, and whether
        the output ``continued`` the final message (a prefill: it goes on with the answer, not a new turn's
        thinking, unless the prompt ends inside an open ``<think>``)."""
        tail = tokenizer.decode(prompt_ids[-8:]) if prompt_ids else ""
        opened = tail.rstrip().endswith(self.start)
        constrained = constraint is not None and getattr(constraint, "kind", None) in ("json", "json_object")
        return Reasoning(self, opened, constrained, continued)


@dataclass(frozen=True)
class Reasoning:
    """A parser as it applies to one request's outputs."""

    parser: ReasoningParser
    prompt_opened: bool = False
    constrained: bool = False
    continued: bool = False

    def stream(self) -> ReasoningStream:
        """A splitter for one output, streamed."""
        first = self.parser.thinks_first and not self.continued
        in_thinking = not self.constrained and (first or self.prompt_opened)
        return ReasoningStream(self.parser, in_thinking)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output."""
        splitter = self.stream()
        reasoning, answer = splitter.feed(text)
        more_reasoning, more_answer = splitter.finish()
        return (reasoning + more_reasoning if splitter.thought else None), answer + more_answer


# One for each name kiln.chat_options.REASONING_PARSERS gives (an LLMEngine's spec.serving.reasoningParser).
PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", thinks_first=True),
    "qwen3": ReasoningParser("qwen3", thinks_first=False),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called ``name`` (None: off); a ValueError naming the choices for an unknown one."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one kiln has; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]


class ReasoningStream:
    """Splits one output's text, delta by delta, into (reasoning, answer) pieces.

    Holds back only what may still be the start of a marker (``</thi`` so far), so the thinking
    streams as it comes; a leading ``<think>`` (after whitespace) is dropped, not shown.
    """

    def __init__(self, parser: ReasoningParser, in_thinking: bool) -> None:
        self.parser = parser
        self.in_thinking = in_thinking
        self.thought = in_thinking  # whether this output had any thinking (None vs "" for the reasoning)
        self.at_start = True  # nothing but whitespace seen yet: a <think> here opens the thinking
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, answer) that ``delta`` decides."""
        text = self.pending + delta
        self.pending = ""
        reasoning, answer = [], []
        while text:
            if self.at_start:
                text, decided = self._leading(text)
                if not decided:
                    self.pending = text
                    break
            if not self.in_thinking:
                answer.append(text)
                break
            end = text.find(self.parser.end)
            if end >= 0:
                reasoning.append(text[:end])
                text = text[end + len(self.parser.end):]
                self.in_thinking = False
                continue
            keep = _partial(text, self.parser.end)
            reasoning.append(text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(answer)

    def _leading(self, text: str) -> tuple[str, bool]:
        """Handle the output's first characters: (rest, decided). A leading ``<think>`` opens the
        thinking and is dropped; whitespace before it waits until the next character says."""
        stripped = text.lstrip()
        start = self.parser.start
        if not stripped or (len(stripped) < len(start) and start.startswith(stripped)):
            return text, False
        self.at_start = False
        if stripped.startswith(start):
            self.in_thinking = self.thought = True
            return stripped[len(start):], True
        return text, True

    def finish(self) -> tuple[str, str]:
        """(reasoning, answer) still held back when the output ends."""
        rest, self.pending = self.pending, ""
        if self.at_start and rest.strip() == "":
            return ("", rest) if not self.in_thinking else (rest, "")
        return (rest, "") if self.in_thinking else ("", rest)


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
