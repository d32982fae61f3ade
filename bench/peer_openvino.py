"""OpenVINO GenAI's ContinuousBatchingPipeline on the bench workload, as a peer baseline.

Runs in its own virtual environment (``.kiln-work/baselines/openvino``, see
``peers.py``): ``python peer_openvino.py JOB.json OUT.json``. It imports nothing
of kiln (the peer's pins clash with kiln's), reads the workload as plain JSON and
writes a ``RunRecord``-shaped JSON: per request arrival, first token, finish and
the output token ids, plus the steps run. Every request is greedy, EOS ignored,
``max_new_tokens`` its own ``output_len``, the same scheduler budgets as kiln
(``max_num_batched_tokens``, ``max_num_seqs``), float32 inference and KV cache,
one stream, ``INFERENCE_NUM_THREADS`` = the bench's thread count.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def run(job: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    workload = json.loads(open(job["workload"]).read())
    requests = workload["requests"]
    started = time.perf_counter()
    pipe, precision = _pipeline(job, genai)

    def prompt(token_ids: list[int]):
        return ov.Tensor(np.array([token_ids], dtype=np.int64))

    def config(max_new_tokens: int):
        return _greedy(genai, max_new_tokens)

    warm = pipe.add_request(10**9, prompt(requests[0]["prompt_token_ids"][:16]), config(4))
    while pipe.has_non_finished_requests():
        pipe.step()
    del warm
    load_s = time.perf_counter() - started
    records, steps = _replay(pipe, genai, requests, prompt, config)
    duration = max(r["finished"] for r in records.values())
    return {"system": "openvino", "duration_s": duration, "num_steps": steps,
            "requests": [records[i] for i in sorted(records)],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "load_s": load_s,
            "notes": [f"openvino-genai {genai.__version__} ContinuousBatchingPipeline, {precision}"],
            "extra": {"threads": job["threads"]}}


def _pipeline(job: dict, genai):
    """(the pipeline, its precision name): kiln's scheduler budgets, one stream, the bench's threads."""
    scheduler = genai.SchedulerConfig()
    scheduler.max_num_batched_tokens = job["max_num_tokens"]
    scheduler.max_num_seqs = job["max_batch_size"]
    scheduler.enable_prefix_caching = job.get("enable_prefix_caching", True)
    scheduler.dynamic_split_fuse = True  # chunked prefill mixed with decodes, as kiln does
    scheduler.cache_size = job.get("kv_cache_gib", 2)  # GiB; grown on demand up to this
    precision = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[job["dtype"]]
    properties = {"INFERENCE_NUM_THREADS": job["threads"], "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": precision,
                  "KV_CACHE_PRECISION": precision}
    return genai.ContinuousBatchingPipeline(job["peer_model_dir"], scheduler, "CPU", properties), precision


def _greedy(genai, max_new_tokens: int):
    cfg = genai.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.min_new_tokens = max_new_tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    return cfg


def _replay(pipe, genai, requests: list[dict], prompt, config) -> tuple[dict[int, dict], int]:
    """Each request added at its arrival time, steps run until all finish: (records by index, steps run)."""
    t0 = time.perf_counter()
    pending = sorted(requests, key=lambda r: r["arrival_time"])
    handles: dict[int, object] = {}
    records: dict[int, dict] = {}
    steps = 0
    while pending or pipe.has_non_finished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0]["arrival_time"] <= now:
            r = pending.pop(0)
            handles[r["index"]] = pipe.add_request(r["index"], prompt(r["prompt_token_ids"]), config(r["output_len"]))
            records[r["index"]] = {"index": r["index"], "arrival": r["arrival_time"], "first_token": None,
                                   "finished": None, "output_token_ids": []}
        if not pipe.has_non_finished_requests():
            time.sleep(max(0.0, pending[0]["arrival_time"] - now) if pending else 0)
            continue
        pipe.step()
        steps += 1
        now = time.perf_counter() - t0
        for index, handle in list(handles.items()):
            record = records[index]
            if handle.can_read():
                for output in handle.read().values():
                    if output.generated_ids and record["first_token"] is None:
                        record["first_token"] = now
                    record["output_token_ids"].extend(output.generated_ids)
            if handle.get_status() != genai.GenerationStatus.RUNNING and not handle.can_read():
                record["finished"] = now
                del handles[index]
    return records, steps


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[0]).read())
    with open(argv[1], "w") as out:
        json.dump(run(job), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
