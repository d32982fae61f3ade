"""Incremental detokenization: streamed text equals a final decode, stop strings, hold-back."""

from __future__ import annotations

import random

import pytest
from kiln.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer, raw_decoder
from kiln.engine.random_checkpoint import make_tokenizer
from kiln.engine.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
TEXT = "héllo wörld, 漢字 and 😀 again: the end. éé 漢漢漢 😀😀 done"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(1024)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def expected_text(tok, ids, params: SamplingParams) -> str:
    """decode(ids) cut at the stop string that completes first (the longer one on a tie)."""
    text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    found = [(t.find(s) + len(s), -t.find(s)) for s in params.stop for t in [text] if s in text]
    if not found:
        return text
    end, neg_start = min(found)
    return text[:end] if params.include_stop_str_in_output else text[:-neg_start]


def stream(tok, prompt, ids, params, chunk_sizes=None) -> tuple[IncrementalDetokenizer, list[DetokenizerStep], str]:
    detok = IncrementalDetokenizer(tok, prompt, params)
    steps, pos, sizes = [], 0, iter(chunk_sizes or [])
    while pos < len(ids) and not detok.is_stopped:
        size = next(sizes, 1)
        steps.append(detok.append(ids[pos:pos + size]))
        pos += size
    return detok, steps, detok.finish()


def test_streamed_text_equals_decode_for_random_token_ids(tok):
    rng = random.Random(0)
    prompt = encode(tok, "Question: say something")
    num_hits = num_split_chars = 0
    for trial in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 40))]
        full = tok.decode(ids, skip_special_tokens=True)
        stops = []
        if full and trial % 2:
            for _ in range(rng.randrange(1, 3)):  # substrings of the output, so they do hit
                start = rng.randrange(len(full))
                stops.append(full[start:start + rng.randrange(1, 6)])
        elif trial % 4 == 0:
            stops = ["zzzq", "漢字"]
        params = SamplingParams(stop=stops, include_stop_str_in_output=rng.random() < 0.5,
                                skip_special_tokens=rng.random() < 0.7)
        detok, steps, last = stream(tok, prompt, ids, params, [rng.randrange(1, 4) for _ in ids])
        streamed = "".join(s.text_delta for s in steps) + last
        assert streamed == detok.text == expected_text(tok, ids, params), (ids, params.stop)
        is_hit = any(s.stop_string_hit for s in steps)
        assert not is_hit or any(stop in tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
                                 for stop in stops)
        num_hits += is_hit
        num_split_chars += REPLACEMENT in full
    assert num_hits > 50 and num_split_chars > 50  # the property was exercised where it matters


def test_multibyte_characters_are_never_split(tok):
    ids = encode(tok, TEXT)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)  # the tokenizer really splits characters
    detok, steps, last = stream(tok, [], ids, SamplingParams())
    assert all(REPLACEMENT not in s.text_delta for s in steps)
    assert "".join(s.text_delta for s in steps) + last == detok.text == TEXT
    assert last == ""


def test_incomplete_character_is_held_then_flushed_at_finish(tok):
    han = encode(tok, "漢")
    partial = [i for i in range(len(tok)) if tok.decode([i]) == REPLACEMENT][:1]
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.append(encode(tok, "ab")).text_delta == "ab"
    assert detok.append(partial).text_delta == ""  # could be the start of a character
    assert detok.finish() == tok.decode(encode(tok, "ab") + partial)[2:]
    assert detok.text == tok.decode(encode(tok, "ab") + partial)
    if len(han) > 1:
        detok = IncrementalDetokenizer(tok, [], SamplingParams())
        assert [detok.append([i]).text_delta for i in han] == [""] * (len(han) - 1) + ["漢"]


def test_stop_string_spanning_tokens_is_held_back_then_cut(tok):
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(tok, [], params)
    assert detok.append(encode(tok, "hello S")) == DetokenizerStep("hello ", False)
    assert detok.append(encode(tok, "T")) == DetokenizerStep("", False)  # "ST" may start "STOP"
    assert detok.append(encode(tok, "A")) == DetokenizerStep("STA", False)  # it cannot any more
    assert detok.append(encode(tok, " ST")) == DetokenizerStep(" ", False)
    step = detok.append(encode(tok, "OP and more"))
    assert step == DetokenizerStep("", True)
    assert detok.append(encode(tok, "ignored")) == DetokenizerStep("", True)
    assert detok.finish() == ""
    assert detok.text == "hello STA "


def test_include_stop_str_in_output_streams_without_holding_back(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    assert detok.append(encode(tok, "hello ST")).text_delta == "hello ST"
    step = detok.append(encode(tok, "OP and more"))
    assert step == DetokenizerStep("OP", True)
    assert detok.text == "hello STOP"


def test_partial_stop_string_at_the_end_is_released_by_finish(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["</answer>"]))
    assert detok.append(encode(tok, "42 </ans")).text_delta == "42 "
    assert detok.text == "42 </ans"  # held back from the stream, not from the text
    assert detok.finish() == "</ans"
    assert detok.text == "42 </ans"


def test_first_completed_stop_string_wins(tok):
    ids = encode(tok, "one two three")
    params = SamplingParams(stop=["three", "wo t", "one two three four"])
    detok, steps, last = stream(tok, [], ids, params)
    assert detok.text == "one t" and last == ""


def test_special_tokens_follow_skip_special_tokens(tok):
    ids = encode(tok, "hi") + [tok.eos_token_id] + encode(tok, "there")
    assert stream(tok, [], ids, SamplingParams())[0].text == "hithere"
    assert stream(tok, [], ids, SamplingParams(skip_special_tokens=False))[0].text == "hi</s>there"


def test_prompt_ending_mid_character_does_not_leak_into_the_output(tok):
    han = encode(tok, "漢")
    prompt = encode(tok, "say ") + han[:-1]
    detok, steps, last = stream(tok, prompt, han[-1:] + encode(tok, "x"), SamplingParams())
    assert detok.text == tok.decode(han[-1:] + encode(tok, "x"))


class CountingTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_each_step_decodes_a_bounded_window(tok):
    ids = encode(tok, TEXT * 20)
    counting = CountingTokenizer(tok)
    detok, _, _ = stream(counting, encode(tok, TEXT), ids, SamplingParams(stop=["never appears"]))
    assert detok.text == TEXT * 20
    assert max(counting.sizes) <= 12
    assert len(counting.sizes) <= 2 * len(ids) + 3


def test_append_after_finish_is_an_error(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.finish()
    with pytest.raises(RuntimeError, match="finish"):
        detok.append([5])


def test_raw_decoder_is_the_wrapper_without_its_overhead(tok):
    raw = raw_decoder(tok)
    assert raw is not None  # the toy tokenizer is a fast one: the engine takes the direct path
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))]
        for skip in (True, False):
            assert raw(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_tokenizers_that_override_decoding_keep_the_wrapper(tok):
    assert raw_decoder(CountingTokenizer(tok)) is None

    class Shouting(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token)
    assert raw_decoder(shouting) is None
    ids = encode(tok, "hello there")
    assert stream(shouting, [], ids, SamplingParams())[0].text == "HELLO THERE"
