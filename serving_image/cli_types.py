"""The click types ``kiln serve``'s flags take beyond click's own: a JSON object (``--speculative-config``), a
choice among an engine setting's values typed as text, and vLLM's many-values option (``--lora-modules a=/p b=/q``)."""

from __future__ import annotations

import json
from typing import Any

import click


class JSONObject(click.ParamType):
    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            parsed = json.loads(value) if isinstance(value, str) else value
        except ValueError as exc:
            self.fail(f"must be a JSON object such as '{{\"method\": \"ngram\"}}': {exc}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("must be a JSON object such as '{\"method\": \"ngram\"}'", param, ctx)
        return parsed


class ChoiceOf(click.Choice):
    """A choice among a setting's values, typed on the command line as text (``2`` for the int 2). None is
    spelled ``none`` and stays that word, so an override to "none" is not lost among the unset flags; the
    engine reads it as None (``kiln.engine.config.canonical_quantization``)."""

    def __init__(self, values: tuple) -> None:
        self.values = {("none" if v is None else str(v)): ("none" if v is None else v) for v in values}
        super().__init__(list(self.values))

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return self.values[super().convert(value if isinstance(value, str) else str(value), param, ctx)]


class ManyValues(click.Option):
    """An option that takes every following word up to the next option, as vLLM's ``nargs='+'``
    (``--lora-modules a=/p b=/q``); given twice, the lists add up."""

    def add_to_parser(self, parser: Any, ctx: Any) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = parser._long_opt.get(name) or parser._short_opt.get(name)
            if option is None:
                continue
            process = option.process

            def take_all(value: Any, state: Any, process: Any = process) -> None:
                values = [value]
                while state.rargs and not state.rargs[0].startswith("-"):
                    values.append(state.rargs.pop(0))
                process(tuple(values), state)

            option.process = take_all
