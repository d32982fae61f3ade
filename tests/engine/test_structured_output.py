"""Constrained decoding in the engine: a random-weight model must still produce output its
grammar accepts, in batches that mix constrained and free requests, under n > 1 and seeds,
stop strings, logprobs, prefix caching, preemption and max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from kiln.engine import SamplingParams
from kiln.engine.errors import RequestError
from kiln.engine.structured.params import MAX_GRAMMAR_BYTES, MAX_SCHEMA_DEPTH
from kiln.engine.structured.params import StructuredOutputsParams as Constraint

# Every string and number bounded: even a random model's output ends within a few dozen tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = [[1, 17, 300, 42, 9], [1, 88, 12, 5], [1, 400, 401, 402, 403, 404]]


@pytest.fixture(scope="module")
def model_dir(toy_model):
    return toy_model("llama-tiny")


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 120),
                          structured_outputs=Constraint(json=SCHEMA, strict=True), **kwargs)


def valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_a_batch_mixes_constrained_and_free_requests(make_llm, model_dir):
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    free = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12)]
    alone = llm.generate(PROMPTS[:2], free)
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2], PROMPTS[2]],
                         [free[0], constrained(temperature=0), free[1], constrained(temperature=1.0, seed=3),
                          constrained(temperature=0.8, top_p=0.9, seed=4)])
    # Free rows are untouched by their neighbours' masks: the same tokens as alone.
    assert [mixed[0].token_ids, mixed[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    for out in (mixed[1], mixed[3], mixed[4]):
        assert out.finish_reason == "stop"  # the grammar completed: no EOS needed
        valid(out.text)


def test_seeded_choices_are_reproducible_and_differ(make_llm, model_dir):
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    params = [constrained(temperature=1.0, seed=s) for s in (0, 1, 2, 3)]
    first = llm.generate([PROMPTS[0]] * 4, params)
    # Same seeds, other company in the batch, other order: same outputs.
    again = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[0]],
                         [SamplingParams(max_tokens=30), params[2], params[0]])
    assert [again[1].text, again[2].text] == [first[2].text, first[0].text]
    assert len({o.text for o in first}) > 1
    for out in first:
        valid(out.text)


def test_max_tokens_stop_strings_and_logprobs(make_llm, model_dir):
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    unbounded = Constraint(json={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    cut, stopped, with_lp = llm.generate([PROMPTS[0]] * 3, [
        SamplingParams(max_tokens=4, temperature=0, structured_outputs=unbounded),
        constrained(temperature=0, stop=['"age"']),
        constrained(temperature=1.0, seed=7, logprobs=3)])
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4 and cut.text.startswith('{"s')
    assert stopped.finish_reason == "stop" and stopped.text.startswith('{"name"') and '"age"' not in stopped.text
    valid(with_lp.text)
    for token, entry in zip(with_lp.token_ids, with_lp.logprobs, strict=True):
        assert float("-inf") < entry[token] <= 0  # sampled tokens are allowed ones
    # Logprobs are the constrained distribution's: where fewer than 3 tokens are allowed (after '{' only
    # '"' is), the other alternatives are refused, at -inf.
    assert entry_refused(with_lp.logprobs[1])


def entry_refused(entry: dict[int, float]) -> bool:
    return any(v == float("-inf") for v in entry.values())


def test_preemption_and_prefix_hits_keep_every_grammar_consistent(make_llm, model_dir):
    # Twelve constrained requests that share a prefix, in a pool too small for all of them.
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=40, block_size=4, max_batch_size=12)
    prompt = [1, *range(100, 114)]
    outs = llm.generate([prompt] * 12, [constrained(temperature=1.0, seed=i) for i in range(12)])
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for out in outs:
        assert out.finish_reason == "stop"
        valid(out.text)


def test_regex_choice_and_grammar_constraints(make_llm, model_dir):
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    kinds = [Constraint(regex=r"[0-9]{3}-[a-z]{2}"), Constraint(choice=["yes", "no", 'say "maybe"']),
             Constraint(grammar='start: "SELECT " col " FROM t"\ncol: "a" | "b"'),
             Constraint(json_object=True)]
    outs = llm.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=1.0, seed=5, max_tokens=200,
                                                          structured_outputs=k) for k in kinds])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text)
    assert outs[1].text in ("yes", "no", 'say "maybe"')
    assert outs[2].text in ("SELECT a FROM t", "SELECT b FROM t")
    # Any object: a random model may not close it within max_tokens, but what it wrote is an object's start.
    assert outs[3].text.startswith("{")
    if outs[3].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].text), dict)


def test_bad_constraints_are_refused_naming_the_field(make_llm, model_dir):
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    deep: dict = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    cases = [
        (lambda: Constraint(json={"type": "wat"}, param="response_format.json_schema"), "response_format.json_schema"),
        (lambda: Constraint(json={"type": "string", "not": {"const": "a"}}, strict=True), "structured_outputs"),
        (lambda: Constraint(json=deep), "structured_outputs"),
        (lambda: Constraint(regex="a" * (MAX_GRAMMAR_BYTES + 1)), "structured_outputs"),
        (lambda: Constraint(regex="a", choice=["a"]), "structured_outputs"),
        (lambda: Constraint(regex="(unclosed"), "structured_outputs"),
        (lambda: Constraint(grammar="start: nothing_defined"), "structured_outputs"),
    ]
    for make, param in cases:
        with pytest.raises(RequestError) as info:
            llm.generate([PROMPTS[0]], SamplingParams(structured_outputs=make()))
        assert info.value.param == param
    # Not strict: a keyword the grammar engine cannot enforce is ignored, the rest still is.
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, structured_outputs=Constraint(
        json={"type": "object", "properties": {"a": {"type": "boolean", "not": {"const": True}}},
              "required": ["a"], "additionalProperties": False})))[0]
    assert isinstance(json.loads(out.text)["a"], bool)
    assert llm.stats().num_running == 0


def test_grammar_state_accept_validate_rollback(make_llm, model_dir):
    """The matcher API speculative decoding drives: validate drafts, accept, roll back."""
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    engine = llm.engine
    state = engine.grammar_compiler.compile(Constraint(json=SCHEMA)).new_state()
    text = '{"name":"ab","age":7,"color":"red","tags":[true]}'
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert state.validate(ids) == len(ids)
    assert state.validate(engine.tokenizer.encode('{"nope"', add_special_tokens=False)) < 3
    assert state.accept(ids[:5]) and state.num_accepted == 5
    state.rollback(3)
    assert state.num_accepted == 2 and state.validate(ids[2:]) == len(ids) - 2
    with pytest.raises(ValueError):
        state.rollback(3)
    assert state.accept(ids[2:]) and state.is_terminated and state.error is None


def test_objects_are_closed_unless_the_schema_opens_them(make_llm, model_dir):
    """As vLLM's default backend reads a schema: declared properties and no others, unless it says so."""
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    engine = llm.engine
    extra = engine.tokenizer.encode('{"a":true,"zz":1}', add_special_tokens=False)
    declared = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    for schema, accepts_extra in [(declared, False), ({**declared, "additionalProperties": True}, True),
                                  ({"type": "object"}, True)]:
        state = engine.grammar_compiler.compile(Constraint(json=schema)).new_state()
        assert (state.validate(extra) == len(extra)) is accepts_extra, schema
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=0, max_tokens=40,
                                                    structured_outputs=Constraint(json=declared)))[0]
    assert list(json.loads(out.text)) == ["a"]


def test_a_compile_over_the_time_limit_is_refused(make_llm, model_dir, monkeypatch):
    llm = make_llm(model_dir, max_seq_len=256, num_kv_blocks=256)
    monkeypatch.setenv("KILN_GRAMMAR_COMPILE_TIMEOUT_S", "0.2")
    # allOf over anyOf multiplies out: 8**5 branches take seconds to lower, the checker is stopped at 0.2 s.
    slow = {"allOf": [{"anyOf": [{"type": "string", "pattern": f"^[a-z]*{c}[a-z]*$", "maxLength": 50 + j}
                                 for c in "abcdefgh"]} for j in range(5)]}
    with pytest.raises(RequestError, match=r"did not compile within 0\.2s") as info:
        llm.engine.grammar_compiler.compile(Constraint(json=slow, param="tools"))
    assert info.value.param == "tools"
    out = llm.generate([PROMPTS[0]], constrained(temperature=0))[0]  # the compiler goes on
    valid(out.text)


def test_bitmask_rows_alone_and_all_at_once_agree():
    """The CPU path (row by row, in place) and the accelerator path (one op over the rows) set the same
    logits to -inf; bits past the vocabulary (its last word) are ignored."""
    import torch
    from kiln.engine.structured.state import apply_bitmask

    vocab = 70  # not a multiple of 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(4, vocab)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, [3, 1], bitmask, per_row=True)
    apply_bitmask(b, [3, 1], bitmask, per_row=False)
    assert torch.equal(a, b) and torch.equal(a[[0, 2]], logits[[0, 2]])
    for i, row in enumerate([3, 1]):
        for t in range(vocab):
            allowed = (int(bitmask[i, t // 32]) >> (t % 32)) & 1
            assert (a[row, t] == float("-inf")) != bool(allowed)


def test_text_of_a_non_special_added_token_is_text_to_the_grammar():
    """Qwen3's <think> and <tool_call> are added tokens that are not special: a constraint whose text holds one
    must accept that token, as the tokenizer makes it (llguidance alone took it for a special token, forced it,
    then refused it: a 500 for a regex holding `<think>`)."""
    from kiln.engine.random_checkpoint import make_tokenizer
    from kiln.engine.structured.compiler import GrammarCompiler, plain_added_tokens

    tokenizer = make_tokenizer(1024)
    tokenizer.add_tokens(["<think>", "</think>", " spaced één"])  # special=False, as in Qwen3's tokenizer.json
    think = tokenizer.convert_tokens_to_ids("<think>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [2])
    try:
        for pattern, text in (("<think>x</think>", "<think>x</think>"), ("a spaced één", "a spaced één")):
            state = compiler.compile(Constraint(regex=pattern)).new_state()
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert len(ids) < len(text) and state.accept(ids), (text, ids, state.error)
            assert state.is_terminated
    finally:
        compiler.close()
    data = plain_added_tokens(json.loads(tokenizer.backend_tokenizer.to_str()))
    assert data["model"]["vocab"]["<think>"] == think  # text like any token's; the special ones stay added
    assert {t["content"] for t in data["added_tokens"]} >= {"<s>", "</s>", "<|im_start|>", "<|im_end|>"}
    assert "<think>" not in {t["content"] for t in data["added_tokens"]}
