"""LoRA under a hostile or changing adapter set (issue 38): prefix blocks keyed by an adapter's content, not its
name; unloads that forget every version's blocks and empty its device slots; weights refused when they could
reach other rows; loads bounded before they read."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import AsyncLLM, SamplingParams
from kiln.engine.errors import RequestError
from kiln.engine.forward_context import set_forward_context
from kiln.engine.layers.attention import AttentionMetadata
from kiln.engine.lora import LoRARequest
from kiln.engine.lora import store as lora_store
from kiln.engine.lora.layers import LoRASlots, make_lora_step
from lora_testlib import ATTN, make_adapter, peft_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=4)
ENGINE = dict(enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=64, block_size=8)


@pytest.fixture(scope="module")
def versions(toy_model, tmp_path_factory):
    """Two versions of one adapter (different weights) and a second adapter."""
    model_dir = toy_model("llama-tiny")
    root = tmp_path_factory.mktemp("lora-trust")
    return model_dir, *(make_adapter(model_dir, root / name, ATTN, seed) for name, seed in
                        (("v1", 1), ("v2", 2), ("other", 3)))


def test_an_evicted_adapter_unloaded_and_replaced_never_answers_from_its_old_kv(versions, make_llm):
    """The operator's sync: unload "one", load "one" from a new source. The old version was LRU-evicted from host
    memory, so today's remove_lora found nothing to forget, and the new version hit the old one's blocks."""
    model_dir, v1, v2, other = versions
    llm = make_llm(model_dir, **ENGINE)
    prompt = random_prompts([41], seed=5)[0]
    assert llm.generate([prompt], GREEDY, lora_request=LoRARequest("one", 1, str(v1)))[0].num_cached_tokens == 0
    llm.add_lora(LoRARequest("other", 2, str(other)))  # max_cpu_loras=1: "one" leaves host memory
    assert llm.list_loras() == ["other"]
    assert llm.remove_lora("one")  # not resident, still forgotten
    out = llm.generate([prompt], GREEDY, lora_request=LoRARequest("one", 3, str(v2)))[0]
    assert out.num_cached_tokens == 0 and out.token_ids == peft_greedy(model_dir, v2, prompt, 4)
    # Keyed by content: the same weights under another name share blocks; another version never does.
    copy = Path(shutil.copytree(v2, v2.parent / "v2-copy"))
    llm.remove_lora("other")
    assert llm.generate([prompt], GREEDY, lora_request=LoRARequest("one-copy", 4, str(copy)))[0].num_cached_tokens


def test_a_request_under_a_removed_adapter_finishes_without_publishing_blocks(versions, make_llm):
    model_dir, v1, _, _ = versions
    llm = make_llm(model_dir, **ENGINE)
    engine = llm.engine
    prompt = random_prompts([41], seed=6)[0]
    req = engine.make_request(prompt, GREEDY, lora_request=LoRARequest("one", 1, str(v1)))
    engine.add(req)
    assert llm.remove_lora("one")  # before its first step: nothing of it is cached yet
    while engine.has_unfinished():
        engine.step()
    assert req.token_ids[len(prompt):] == peft_greedy(model_dir, v1, prompt, 4)  # it finished with its adapter
    again = llm.generate([prompt], GREEDY, lora_request=LoRARequest("one", 2, str(v1)))[0]
    assert again.num_cached_tokens == 0  # nothing was published under the removed version


def test_unload_empties_the_adapters_device_slot(versions, make_llm):
    model_dir, v1, _, _ = versions
    llm = make_llm(model_dir, **ENGINE)
    llm.generate([[1, 5, 6, 7]], GREEDY, lora_request=LoRARequest("one", 1, str(v1)))
    slots = llm.engine.runner.lora
    assert slots.loaded[0] is not None and any(s.A[0].abs().sum() > 0 for s in slots.slots.values())
    llm.remove_lora("one")
    llm.generate([[1, 5, 6, 7]], GREEDY)  # the next step applies the pending unload
    assert slots.loaded == [None] and all(s.A[0].abs().sum() == 0 and s.Bt[0].abs().sum() == 0
                                          for s in slots.slots.values())


def test_async_remove_lora_is_done_when_awaited(versions):
    model_dir, v1, _, other = versions

    async def main() -> None:
        async with AsyncLLM(model_dir, **ENGINE) as llm:
            prompt = random_prompts([41], seed=7)[0]
            async for _ in llm.generate(prompt, GREEDY, lora_request=LoRARequest("one", 1, str(v1))):
                pass
            digest = llm.lora_digest("one")
            assert any(b.adapter == digest for b in llm.engine.block_manager.blocks)
            await llm.add_lora(LoRARequest("other", 2, str(other)))  # evicts "one" from host memory
            assert await llm.remove_lora("one") is True  # returns once its blocks are gone
            assert not any(b.adapter == digest for b in llm.engine.block_manager.blocks)
            assert await llm.remove_lora("never-loaded") is False
    asyncio.run(main())


def _rewrite(src: Path, dst: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    cfg = json.loads((dst / "adapter_config.json").read_text())
    change(tensors, cfg)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_non_finite_weights_and_absurd_alpha_are_refused_naming_the_adapter(versions, make_llm, tmp_path):
    model_dir, v1, _, _ = versions
    llm = make_llm(model_dir, **ENGINE)

    def nan_b(t, cfg):
        key = next(k for k in t if "lora_B" in k)
        t[key][0, 0] = float("nan")

    cases = {
        "holds inf or NaN.*retrain or re-export": _rewrite(v1, tmp_path / "nan", nan_b),
        "lora_alpha 1000000.0 gives a scaling of 125000.*fix lora_alpha": _rewrite(
            v1, tmp_path / "alpha", lambda t, cfg: cfg.update(lora_alpha=1e6)),
        "lora_alpha must be a positive number": _rewrite(v1, tmp_path / "neg", lambda t, cfg: cfg.update(lora_alpha=-4)),
    }
    for why, path in cases.items():
        with pytest.raises(RequestError, match=why) as info:
            llm.add_lora(LoRARequest(f"bad-{path.name}", 1, str(path)))
        assert info.value.param == "lora_path" and str(path) in str(info.value)
    assert llm.list_loras() == []


def test_an_overflowing_adapter_never_reaches_a_base_row_of_a_dense_step():
    """The slot-dense path once multiplied by a 0/1 mask: inf * 0 = NaN in every other row, base rows included."""
    linear = type("Linear", (), {"input_size": 4, "output_size": 3})()
    slots = LoRASlots(linear, [(None, 0, 3)], False, max_loras=2, max_rank=2, dtype=torch.float32,
                      device=torch.device("cpu"))
    slots.set_slot(0, {None: (torch.ones(2, 4), torch.ones(3, 2))})
    slots.set_slot(1, {None: (torch.full((2, 4), 3e38), torch.ones(3, 2))})  # finite, overflows in the shrink
    step = make_lora_step(torch.tensor([-1, 0, 1]), torch.device("cpu"), 2)
    assert step.mask is not None  # the dense path
    with set_forward_context(AttentionMetadata(slot_mapping=torch.zeros(3)), step):
        y = slots.add_to(torch.zeros(3, 3), torch.ones(3, 4))
    assert y[0].tolist() == [0.0, 0.0, 0.0] and y[1].tolist() == [8.0, 8.0, 8.0]


def test_concurrent_loads_reserve_room_before_they_read(versions, monkeypatch):
    """max_cpu_loras=1 and three loads at once: one reads, the others are refused before reading (today all
    three read, then the cache evicts); two loads of one name read it once."""
    model_dir, v1, v2, other = versions
    from kiln.engine.config import EngineConfig

    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=8, device="cpu")
    store = lora_store.AdapterStore(cfg.hf_config, 8, 1, torch.float32)
    gate, reading, peak = threading.Event(), [0], [0]
    real = lora_store.load_adapter

    def slow(*args, **kwargs):
        reading[0] += 1
        peak[0] = max(peak[0], reading[0])
        gate.wait(10)
        try:
            return real(*args, **kwargs)
        finally:
            reading[0] -= 1

    monkeypatch.setattr(lora_store, "load_adapter", slow)
    results: dict[str, object] = {}

    def load(key: str, name: str, path: Path) -> None:
        try:
            results[key] = store.load(LoRARequest(name, 1, str(path)))
        except RequestError as exc:
            results[key] = exc

    threads = [threading.Thread(target=load, args=a) for a in
               (("a", "one", v1), ("a2", "one", v1), ("b", "two", v2), ("c", "three", other))]
    threads[0].start()
    for _ in range(200):  # "a" holds the one place and is reading
        if reading[0]:
            break
        threading.Event().wait(0.01)
    for t in threads[1:]:
        t.start()
    for t in threads[2:]:
        t.join(10)  # refused at once, while "a" still reads
    gate.set()
    for t in threads[:2]:
        t.join(10)
    assert peak[0] == 1
    assert results["a"] is results["a2"]
    assert [results[k].code for k in ("b", "c")] == ["lora_capacity", "lora_capacity"]
