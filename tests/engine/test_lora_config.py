"""LoRA's settings as one typed view built from EngineConfig (its defaults resolved there, once), and the
runner's half of LoRA in one place: the store, the slots and the linears take the view, and each linear
makes its own slots."""

from __future__ import annotations

import torch
from kiln.engine.config import EngineConfig
from kiln.engine.layers.linear import LinearBase
from kiln.engine.lora.config import LoRAConfig
from kiln.engine.lora.manager import LoRAManager
from kiln.engine.lora.runner import LoRARunner


def test_the_view_resolves_max_cpu_loras_once(toy_model):
    model = str(toy_model("llama-tiny"))
    assert EngineConfig(model=model, device="cpu").lora_config is None
    view = EngineConfig(model=model, device="cpu", enable_lora=True, max_loras=3, max_lora_rank=8).lora_config
    assert view == LoRAConfig(max_loras=3, max_rank=8, max_cpu_loras=3, dtype=torch.float32)
    cfg = EngineConfig(model=model, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=5)
    manager = LoRAManager(cfg.lora_config, cfg.hf_config, set)
    assert manager.store.capacity == 5 and len(manager.slots.holder) == 2 and manager.config.max_cpu_loras == 5


def test_the_runner_half_gives_each_linear_its_own_slots(toy_model, make_llm):
    llm = make_llm(toy_model("llama-tiny"), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
                   num_kv_blocks=32, tactics="aten")
    lora = llm.engine.runner.lora
    assert isinstance(lora, LoRARunner) and lora.config == llm.engine.config.lora_config
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase) and m.lora is not None]
    assert linears and {id(m.lora) for m in linears} == {id(s) for s in lora.slots.values()}
    assert all(s.A.shape[0] == 2 for s in lora.slots.values())


def test_slots_come_before_the_kv_pool_and_the_build_plans_the_same_term(toy_model, make_llm, monkeypatch):
    """kiln/lora_options.py promises that the runtime sizes its KV pool after the slots: the runner makes them
    first (so the pool is planned from the memory they leave), their bytes are ``LoRAConfig.slot_bytes``, and
    the builder's KV plan takes that same term out of its budget, so pool + slots fit what the plan names."""
    from kiln.builder.kv_plan import plan_kv
    from kiln.builder.model_facts import model_facts
    from kiln.builder.sizing import weight_bytes_per_rank

    from kiln.api import LLMEngineSpec

    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16, tactics="aten")
    runner, cfg = llm.engine.runner, llm.engine.config.hf_config
    slots = runner.lora.config.slot_bytes("cpu", cfg["hidden_size"], cfg["intermediate_size"],
                                          cfg["num_attention_heads"], cfg.get("num_key_value_heads"),
                                          cfg["hidden_size"] // cfg["num_attention_heads"], cfg["num_hidden_layers"])
    assert runner.lora.nbytes == slots
    assert list(vars(runner)).index("lora") < list(vars(runner)).index("kv_cache")  # made before the pool

    facts = model_facts(model_dir)
    monkeypatch.setenv("KILN_CPU_MEMORY_GIB", "0.005")  # a budget the pool fills (not capped at maxBatchSize)
    base = {"model": {"source": "hf://org/model"}, "gpu": "cpu", "maxBatchSize": 256, "maxInputLen": 64,
            "maxSeqLen": 128, "maxNumTokens": 256}
    with_lora = LLMEngineSpec.model_validate({**base, "lora": {"maxLoras": 4, "maxLoraRank": 16}})
    weights = weight_bytes_per_rank(facts, with_lora)
    plan = plan_kv(with_lora, facts, weights)
    fixed = weights + plan["activation_reserve_bytes"] + plan["cuda_graph_reserve_bytes"]
    assert plan["lora_slot_bytes"] == slots  # float32 slots on CPU, every layer on one rank
    assert not plan["capped_at_max_batch"] and plan["budget_bytes"] - fixed - plan["kv_pool_bytes"] < 2 * slots
    assert fixed + plan["lora_slot_bytes"] + plan["kv_pool_bytes"] <= plan["budget_bytes"]
    without = plan_kv(LLMEngineSpec.model_validate(base), facts, weights)
    assert without["lora_slot_bytes"] == 0
