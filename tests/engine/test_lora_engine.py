"""Multi-LoRA in mixed batches: greedy output equals transformers + PEFT token for token (fp32).

Adapters are made here with PEFT (``LoraConfig(r=8, lora_alpha=16, init_lora_weights=False)``, ``lora_B``
damped by 0.3) on the toy models. Each scenario sends the base and two adapters in one ``generate`` call and
checks that one step ran rows of all three (mixed rows in one step), that every output equals PEFT's, and
that each adapter's output differs from the base's (an ignored adapter cannot pass).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams
from kiln.engine.errors import ConfigError, RequestError
from kiln.engine.lora import LoRARequest
from kiln.engine.lora.slots import SlotTable
from kiln.engine.prefix_hash import block_keys, root_key
from kiln.engine.step_inputs import decode_steps, encode_steps, pack_rows
from lora_testlib import ATTN, MLP, make_adapter, peft_greedy

LENGTHS, MAX_TOKENS = [5, 19, 34], [8, 6, 7]
TARGETS = {"attention": ATTN, "mlp": MLP, "both": ATTN + MLP}


@pytest.fixture(scope="module")
def adapters(toy_model, tmp_path_factory):
    """``adapters(targets, preset)`` -> two adapter dirs (different seeds) for that preset, made once."""
    made: dict[tuple, tuple[Path, Path]] = {}

    def get(kind: str, preset: str = "llama-tiny") -> tuple[Path, Path]:
        if (kind, preset) not in made:
            model_dir = toy_model(preset)
            root = tmp_path_factory.mktemp(f"lora-{kind}-{preset}")
            made[kind, preset] = tuple(make_adapter(model_dir, root / name, TARGETS[kind], seed)
                                       for name, seed in (("one", 1), ("two", 2)))
        return made[kind, preset]

    return get


def record_steps(llm) -> list[set[int]]:
    """The distinct adapter slots (-1: base) of every forward pass the engine runs from now on."""
    seen: list[set[int]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(inputs, intermediate=None):
        slots = inputs.token_lora_slots
        seen.append({-1} if slots is None else set(slots.tolist()))
        return execute(inputs, intermediate)

    runner.execute = spy
    return seen


def run_mixed(llm, model_dir: Path, one: Path, two: Path, check_mixed: bool = True):
    prompts = random_prompts(LENGTHS, seed=3) * 3
    loras = [None] * 3 + [LoRARequest("one", 1, str(one))] * 3 + [LoRARequest("two", 2, str(two))] * 3
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS * 3]
    seen = record_steps(llm) if check_mixed else None
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, lora, sp, out in zip(prompts, loras, params, outs, strict=True):
        adapter = None if lora is None else Path(lora.lora_path)
        assert out.token_ids == peft_greedy(model_dir, adapter, prompt, sp.max_tokens), (lora, len(prompt))
    if check_mixed:
        assert any(len(s) == 3 for s in seen), f"no step ran base and both adapters together: {seen}"
    for i in range(3):  # each adapter changes the output
        assert outs[i].token_ids != outs[3 + i].token_ids and outs[i].token_ids != outs[6 + i].token_ids
    return outs


@pytest.mark.parametrize("kind", ["attention", "mlp", "both"])
def test_mixed_batch_equals_peft(kind, toy_model, make_llm, adapters):
    model_dir = toy_model("llama-tiny")
    one, two = adapters(kind)
    llm = make_llm(model_dir, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=8,
                   enable_prefix_caching=False)
    run_mixed(llm, model_dir, one, two)


def test_qwen2_bias_and_torch_attention(toy_model, make_llm, adapters):
    """qkv bias, tied embeddings, and the torch attention path (no native kernels) with chunked prefill."""
    model_dir = toy_model("qwen2-tiny")
    one, two = adapters("both", "qwen2-tiny")
    llm = make_llm(model_dir, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=4, max_num_tokens=16, max_batch_size=9,
                   attention_backend="torch")
    run_mixed(llm, model_dir, one, two, check_mixed=False)


def test_qwen3_head_norms_under_adapters(toy_model, make_llm, adapters):
    """Qwen3's per-head q/k norms after the adapted q/k projections, and a head size apart from hidden / heads."""
    model_dir = toy_model("qwen3-tiny")
    one, two = adapters("both", "qwen3-tiny")
    llm = make_llm(model_dir, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=8,
                   enable_prefix_caching=False)
    run_mixed(llm, model_dir, one, two)


def test_prefix_cache_is_keyed_by_adapter(toy_model, make_llm, adapters):
    model_dir = toy_model("llama-tiny")
    one, two = adapters("both")
    llm = make_llm(model_dir, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=8)
    prompt = random_prompts([41], seed=5)[0]
    ra, rb = LoRARequest("one", 1, str(one)), LoRARequest("two", 2, str(two))
    params = SamplingParams(temperature=0, max_tokens=4)
    order = [None, ra, rb, None, ra, rb]
    cached = [llm.generate([prompt], params, lora_request=lr)[0] for lr in order]
    # 40 of 41 tokens = 5 full blocks of 8: a hit only under the same adapter (or the base) as before.
    assert [o.num_cached_tokens for o in cached] == [0, 0, 0, 40, 40, 40]
    for lr, out in zip(order, cached, strict=True):
        adapter = None if lr is None else Path(lr.lora_path)
        assert out.token_ids == peft_greedy(model_dir, adapter, prompt, 4)
    # The router's keys (prefix_hash.block_keys) differ per adapter from the first block on.
    assert block_keys(prompt, 8, adapter="one")[0] != block_keys(prompt, 8)[0] != block_keys(prompt, 8, adapter="two")[0]
    # Unloading drops the adapter's cached blocks: the same name loaded again starts cold.
    assert llm.remove_lora("one") and "one" not in llm.list_loras()
    assert llm.generate([prompt], params, lora_request=ra)[0].num_cached_tokens == 0


def test_one_slot_serves_two_adapters_in_turn(toy_model, make_llm, adapters):
    """max_loras=1: requests of the second adapter wait for the slot (never taken from a running one)."""
    model_dir = toy_model("llama-tiny")
    one, two = adapters("attention")
    llm = make_llm(model_dir, enable_lora=True, max_loras=1, num_kv_blocks=64, block_size=8)
    seen = record_steps(llm)
    prompts = random_prompts([6, 9, 12, 7], seed=9)
    loras = [LoRARequest("one", 1, str(one)), LoRARequest("two", 2, str(two)), None, LoRARequest("one", 1, str(one))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        assert out.token_ids == peft_greedy(model_dir, None if lora is None else Path(lora.lora_path), prompt, 5)
    assert all(len(s - {-1}) <= 1 for s in seen)


def test_ngram_speculation_with_adapters(toy_model, make_llm, adapters):
    model_dir = toy_model("llama-tiny")
    one, two = adapters("both")
    llm = make_llm(model_dir, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=8,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    run_mixed(llm, model_dir, one, two, check_mixed=False)


def test_bad_adapters_are_refused_naming_the_field(toy_model, make_llm, adapters, tmp_path):
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, enable_lora=True, max_lora_rank=8, num_kv_blocks=16)
    cases = {
        "r = 16 is over --max-lora-rank 8": make_adapter(model_dir, tmp_path / "r16", ATTN, 1, r=16),
        "modules_to_save": make_adapter(model_dir, tmp_path / "mts", ATTN, 1, modules_to_save=["lm_head"]),
        "use_dora": make_adapter(model_dir, tmp_path / "dora", ["q_proj"], 1, use_dora=True),
        "target module 'lm_head'": make_adapter(model_dir, tmp_path / "head", ["q_proj", "lm_head"], 1),
        "for another base": make_adapter(toy_model("llama-tiny", hidden_size=32, intermediate_size=80),
                                         tmp_path / "other", ATTN, 1),
        "no adapter_config.json": tmp_path,
    }
    for why, path in cases.items():
        with pytest.raises(RequestError, match=why) as info:
            llm.add_lora(LoRARequest(path.name, 1, str(path)))
        assert info.value.param == "lora_path"
    no_lora = make_llm(model_dir, num_kv_blocks=16)
    with pytest.raises(RequestError, match="enable_lora"):
        no_lora.generate([[1, 5, 6]], lora_request=LoRARequest("x", 1, str(tmp_path)))
    with pytest.raises(ConfigError, match="max_cpu_loras must be >= max_loras"):
        make_llm(model_dir, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="max_lora_rank must be one of"):
        make_llm(model_dir, enable_lora=True, max_lora_rank=12)


def test_host_cache_refuses_rather_than_grows(toy_model, make_llm, adapters):
    """max_cpu_loras=1 with its adapter held by a waiting request: a second adapter is refused (429's code)."""
    model_dir = toy_model("llama-tiny")
    one, two = adapters("attention")
    llm = make_llm(model_dir, enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=16)
    engine = llm.engine
    held = engine.make_request([1, 7, 8], SamplingParams(max_tokens=2), lora_request=LoRARequest("one", 1, str(one)))
    engine.add(held)
    with pytest.raises(RequestError, match="max-cpu-loras") as info:
        llm.add_lora(LoRARequest("two", 2, str(two)))
    assert info.value.code == "lora_capacity"
    while engine.has_unfinished():
        engine.step()
    assert llm.add_lora(LoRARequest("two", 2, str(two))) and llm.list_loras() == ["two"]  # "one" was evicted


def test_step_message_carries_slots():
    rows = [([5], 3, [0]), ([6, 7, 8], 0, [1])]
    batch = pack_rows(rows, 4, [0, 3], row_lora_slots=[-1, 1])
    assert batch.token_lora_slots.tolist() == [-1, 1, 1, 1]
    (back,) = decode_steps(encode_steps([batch]))
    assert back.token_lora_slots.tolist() == [-1, 1, 1, 1]
    plain = pack_rows(rows, 4, [0, 3], row_lora_slots=[-1, -1])
    assert plain.token_lora_slots is None and decode_steps(encode_steps([plain]))[0].token_lora_slots is None
    words = encode_steps([batch])
    with pytest.raises(ValueError, match="malformed"):
        decode_steps(torch.cat([words, torch.tensor([300, -1, 5])]))


def test_slot_table_never_takes_a_slot_in_use():
    class A:
        def __init__(self, i):
            self.int_id = i

    t = SlotTable(2)
    a, b, c = A(1), A(2), A(3)
    sa, sb = t.acquire(a), t.acquire(b)
    assert {sa, sb} == {0, 1} and not t.can_acquire(c)
    t.release(sa)
    assert t.can_acquire(c) and t.acquire(c) == sa  # the free slot (a's), not b's
    assert sorted(s for s, _ in t.take_loads()) == [0, 1]  # a's pending load was replaced by c's
    assert t.acquire(b) == sb and t.take_loads() == []  # already there: no load
    assert root_key("one") != root_key(None)


@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_parallel_mixed_batch_equals_peft(sizes, toy_model, make_llm, adapters):
    """TP=2 (B sharded by output, A by input, one all-reduce) and PP=2 (each stage its layers' adapters), gloo."""
    model_dir = toy_model("llama-tiny")
    one, two = adapters("both")
    llm = make_llm(model_dir, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=8, **sizes)
    run_mixed(llm, model_dir, one, two, check_mixed=False)
