"""A reply that continues a prefill under a constraint: the grammar starts past the prefill's token ids, found
also for a tokenizer that starts every text with a space (SentencePiece's '▁', as Llama 2's and Mistral v0's do),
where the prefill encoded alone would be ' {' and no JSON grammar would take it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kiln.serving.constraints import ContinuedConstraint, _continue_from_prefix, _ContinuingGrammar
from kiln.serving.errors import APIError

SPACE = 1  # '▁' alone


class LeadingSpaceTokenizer:
    """Each character its own id; a text starts with the '▁' token, as SentencePiece's legacy prepend does."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [SPACE] + [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(" " if i == SPACE else chr(i) for i in ids)


class JSONStart:
    """A grammar of outputs starting with '{': a state takes ids whose text begins so."""

    def __init__(self, tokenizer: LeadingSpaceTokenizer) -> None:
        self.tokenizer = tokenizer

    def new_state(self) -> SimpleNamespace:
        state = SimpleNamespace(num_accepted=0, taken=[])

        def accept(ids: list[int]) -> bool:
            state.taken += ids
            return self.tokenizer.decode(state.taken).startswith("{")
        state.accept = accept
        return state


def _spec(prefix: str) -> tuple[ContinuedConstraint, SimpleNamespace]:
    tokenizer = LeadingSpaceTokenizer()
    return ContinuedConstraint(json_object=True, param="output_config.format", prefix=prefix,
                               compiled=JSONStart(tokenizer)), SimpleNamespace(tokenizer=tokenizer)


def test_a_prefill_continues_on_a_tokenizer_that_prepends_a_space():
    spec, engine = _spec('{"a": ')
    _continue_from_prefix(engine, spec)
    assert isinstance(spec.compiled, _ContinuingGrammar)
    assert spec.compiled.prefix_ids == [ord(c) for c in '{"a": ']  # not the leading-space ids
    assert spec.compiled.new_state().num_accepted == 0


def test_a_prefill_no_output_begins_with_is_a_400_naming_the_constraint():
    spec, engine = _spec("Sure")
    with pytest.raises(APIError) as err:
        _continue_from_prefix(engine, spec)
    assert err.value.status == 400 and err.value.param == "output_config.format"
