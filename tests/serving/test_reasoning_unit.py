"""Reasoning parsers (kiln.serving.reasoning): whole outputs split as vLLM's parsers split them, and a
stream, cut anywhere, splits exactly as the whole output does."""

from __future__ import annotations

import random

import pytest
from kiln.serving.reasoning import PARSERS, Reasoning, reasoning_parser

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]

CASES = [
    # (parser, prompt opened <think>, constrained, output, (reasoning, answer))
    (R1, False, False, "<think>plan it</think>The answer.", ("plan it", "The answer.")),
    (R1, False, False, "plan it</think>The answer.", ("plan it", "The answer.")),
    (R1, False, False, "still thinking when cut", ("still thinking when cut", "")),
    (R1, True, False, "\nplan</think>\n\nok", ("\nplan", "\n\nok")),
    (R1, False, True, '{"a": 1}', (None, '{"a": 1}')),
    (QWEN3, False, False, "<think>\nplan\n</think>\n\nok", ("\nplan\n", "\n\nok")),
    (QWEN3, False, False, "  <think>plan</think>ok", ("plan", "ok")),
    (QWEN3, False, False, "no thinking at all", (None, "no thinking at all")),
    (QWEN3, False, False, "a </think> in the answer", (None, "a </think> in the answer")),
    (QWEN3, True, False, "plan</think>ok", ("plan", "ok")),
    (QWEN3, True, False, "cut while thinking", ("cut while thinking", "")),
    (QWEN3, False, False, "", (None, "")),
    (R1, False, False, "", ("", "")),
    (QWEN3, False, False, "<thi", (None, "<thi")),
    (R1, False, False, "x</thi", ("x</thi", "")),
]


@pytest.mark.parametrize(("parser", "opened", "constrained", "text", "want"), CASES)
def test_whole_output_splits(parser, opened, constrained, text, want):
    assert Reasoning(parser, opened, constrained).split(text) == want


def _streamed(reasoning: Reasoning, text: str, cuts: list[int]) -> tuple[str | None, str]:
    splitter = reasoning.stream()
    thought, answer = "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = splitter.feed(text[a:b])
        thought, answer = thought + r, answer + c
    r, c = splitter.finish()
    thought, answer = thought + r, answer + c
    return (thought if splitter.thought else None), answer


@pytest.mark.parametrize(("parser", "opened", "constrained", "text", "want"), CASES)
def test_a_stream_cut_anywhere_splits_as_the_whole(parser, opened, constrained, text, want):
    rng = random.Random(len(text))
    reasoning = Reasoning(parser, opened, constrained)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(0, 6))))
        assert _streamed(reasoning, text, cuts) == want
    assert _streamed(reasoning, text, list(range(1, len(text)))) == want  # one character at a time


def test_thinking_streams_as_it_comes_holding_back_only_a_marker_start():
    splitter = Reasoning(R1).stream()
    assert splitter.feed("first thoughts </th") == ("first thoughts ", "")
    assert splitter.feed("ink>answer") == ("", "answer")
    assert splitter.feed(" more") == ("", " more")


def test_the_prompt_decides_whether_the_template_opened_the_thinking():
    class Tok:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    ids = [ord(c) for c in "<|im_start|>assistant\n<think>\n"]
    assert QWEN3.for_request(ids, Tok()).prompt_opened
    assert not QWEN3.for_request(ids[:-9], Tok()).prompt_opened


def test_a_continued_final_message_is_answer_unless_the_prompt_opened_thinking():
    """A prefill (Messages' final assistant turn, chat's continue_final_message) goes on with the answer: deepseek_r1
    would otherwise read the whole continuation as thinking, waiting for a </think> that never comes."""
    class Tok:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    prefill = [ord(c) for c in "<|im_start|>assistant\nOnce upon a time"]
    assert R1.for_request(prefill, Tok(), continued=True).split(", a fox.") == (None, ", a fox.")
    assert R1.for_request(prefill, Tok()).split(", a fox.") == (", a fox.", "")  # a new turn: thinks first
    opened = [ord(c) for c in "<|im_start|>assistant\n<think>\n"]
    assert R1.for_request(opened, Tok(), continued=True).split("plan</think>ok") == ("plan", "ok")


def test_unknown_parser_names_the_choices():
    from kiln.chat_options import REASONING_PARSERS

    assert tuple(PARSERS) == REASONING_PARSERS  # what a manifest's spec.serving.reasoningParser may name
    assert reasoning_parser(None) is None
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("granite")


def test_serve_takes_the_parser_and_store_flags(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from kiln.serving import cli

    result = CliRunner().invoke(cli.serve, ["--model", str(tmp_path), "--reasoning-parser", "granite"])
    assert result.exit_code == 2 and "deepseek_r1" in result.output and "qwen3" in result.output
    seen = {}
    monkeypatch.setattr("kiln.serving.server.run_server", lambda config: seen.update(vars(config)) or 0)
    monkeypatch.setattr(cli, "_exit", lambda code: None)
    result = CliRunner().invoke(cli.serve, ["--model", str(tmp_path), "--port", "0", "--reasoning-parser", "qwen3",
                                            "--responses-store-size", "7", "--responses-store-ttl", "60"])
    assert result.exit_code == 0, result.output
    assert (seen["reasoning_parser"], seen["responses_store_size"], seen["responses_store_ttl"]) == ("qwen3", 7, 60)


def test_serve_takes_the_chat_flags_a_manifest_renders(monkeypatch, tmp_path):
    """spec.serving's chat settings, as the operator and kiln up render them, are flags kiln serve takes."""
    from click.testing import CliRunner
    from kiln.serving import cli

    from kiln.serving_options import ServingOptions

    flags = ServingOptions(reasoningParser="qwen3", defaultChatTemplateKwargs={"enable_thinking": False}).serve_flags()
    seen = {}
    monkeypatch.setattr("kiln.serving.server.run_server", lambda config: seen.update(vars(config)) or 0)
    monkeypatch.setattr(cli, "_exit", lambda code: None)
    result = CliRunner().invoke(cli.serve, ["--model", str(tmp_path), "--port", "0", *flags])
    assert result.exit_code == 0, result.output
    assert seen["reasoning_parser"] == "qwen3" and seen["default_chat_template_kwargs"] == {"enable_thinking": False}
