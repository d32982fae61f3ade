"""LoRA on ranks started separately (pods): worker ranks get an adapter's weights from rank 0, never its files.

Issue 38, High 2: rank 0 once sent the other ranks its own local path of an adapter and they read it from
disk; a worker pod has no such file, so it exited 1 on the first adapter request and the group restarted.
Here the worker rank is a process started on its own that fails if it reads any adapter file. TP=2 and PP=2
groups load adapters at run time, take turns in one device slot, unload one and load a new version under the
same name, and every output equals transformers + PEFT's for the version it ran under.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import LLM, SamplingParams, parallel, workers
from kiln.engine.lora import LoRARequest
from lora_testlib import ATTN, MLP, make_adapter, peft_greedy
from netutil import free_port

TOKEN = "lora-ranks-group-token-0123456789"
KWARGS = dict(num_kv_blocks=64, block_size=8, max_num_tokens=32, max_batch_size=6, tactics="aten",
              enable_lora=True, max_loras=1, max_cpu_loras=2, distributed_timeout_s=60, join_timeout_s=120)


def _worker_that_reads_no_adapter(kwargs: dict) -> None:
    """A rank started on its own with no copy of any adapter: reading one is an error."""
    from kiln.engine.config import EngineConfig
    from kiln.engine.lora import adapter

    def refuse(*args, **kwargs):
        raise AssertionError("a worker rank read an adapter's files")
    adapter.read_adapter_files = adapter.load_adapter = refuse
    os.environ["KILN_GROUP_TOKEN"] = TOKEN
    sys.exit(workers.run_worker_node(EngineConfig(**kwargs)))


@pytest.fixture(scope="module")
def versions(toy_model, tmp_path_factory):
    model_dir = toy_model("llama-tiny")
    root = tmp_path_factory.mktemp("lora-ranks")
    return model_dir, {name: make_adapter(model_dir, root / name, targets, seed)
                       for name, targets, seed in (("one", ATTN + MLP, 1), ("two", ATTN, 2), ("one-v2", MLP, 3))}


def check(llm, model_dir: Path, loras: list[tuple[str, Path] | None]) -> None:
    prompts = random_prompts([6, 21, 13][:len(loras)], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6)
    reqs = [None if lora is None else LoRARequest(lora[0], 1 + ["one", "two"].index(lora[0]), str(lora[1]))
            for lora in loras]
    outs = llm.generate(prompts, [params] * len(prompts), lora_request=reqs)
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        assert out.token_ids == peft_greedy(model_dir, None if lora is None else lora[1], prompt, 6), lora


@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_worker_ranks_serve_adapters_loaded_and_replaced_at_run_time(sizes, versions, monkeypatch):
    model_dir, dirs = versions
    group = dict(model=str(model_dir), distributed_address=f"127.0.0.1:{free_port()}", **sizes, **KWARGS)
    worker = mp.get_context("spawn").Process(target=_worker_that_reads_no_adapter,
                                             args=({**group, "rank_offset": 1},), daemon=True)
    worker.start()
    llm = None
    try:
        monkeypatch.setenv("KILN_GROUP_TOKEN", TOKEN)
        llm = LLM(**group)
        llm.add_lora(LoRARequest("one", 1, str(dirs["one"])))
        check(llm, model_dir, [None, ("one", dirs["one"]), ("two", dirs["two"])])  # one slot: they take turns
        assert llm.remove_lora("one")
        llm.add_lora(LoRARequest("one", 1, str(dirs["one-v2"])))  # a new version under the same name
        check(llm, model_dir, [("one", dirs["one-v2"]), None])
        assert llm.remove_lora("two") and llm.remove_lora("one")
        check(llm, model_dir, [None])  # the emptied slot: base output on every rank
        llm.shutdown()
        worker.join(60)
        assert worker.exitcode == 0
    finally:
        if llm is not None:
            llm.shutdown()
        if worker.is_alive():
            worker.kill()


def test_a_malformed_slot_message_is_refused():
    from kiln.engine.lora.wire import recv_slot_weights, slot_header

    weights = {(0, "qkv_proj"): {"q": (torch.ones(2, 4), torch.ones(4, 2))}, (1, "down_proj"): {None: (
        torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.bfloat16))}}
    header, payload = slot_header(1, 7, weights)
    assert header["tensors"][0][:4] == [0, "qkv_proj", "q", "A"]
    back = recv_slot_weights(header, payload)
    for key, parts in weights.items():
        for part, (a, b) in parts.items():
            assert torch.equal(back[key][part][0], a) and torch.equal(back[key][part][1], b)
            assert back[key][part][1].dtype == b.dtype
    for bad in ({**header, "tensors": [[0, "qkv_proj", "q", "A", [2, 4], "int64"]]},
                {**header, "tensors": header["tensors"][:1]},
                {**header, "tensors": [[0, "qkv_proj", "q", "A", [-2, 4], "float32"]]}):
        with pytest.raises(RuntimeError, match="malformed LoRA slot message"):
            recv_slot_weights(bad, payload)
    assert parallel.BYTES not in (parallel.JSON, parallel.STEPS)
