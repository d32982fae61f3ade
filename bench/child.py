"""One system run in its own process: ``python -m kiln_bench.child JOB.json OUT.json``.

Each run gets a fresh interpreter so that its peak RSS is its own (model,
KV cache, activations, runtime) and no system inherits another's warm
allocator or threads. The parent writes the job (system, model, workload
path, dtype, threads, limits) and reads back a ``RunRecord`` as JSON.
Loading and a short warm-up happen before the clock starts, for every system.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_job(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    from kiln_bench.workload import Workload

    workload = Workload.load(Path(job["workload"]))
    model_dir = Path(job["model_dir"])
    system = job["system"]
    t_load = time.perf_counter()
    if system.startswith("hf-static-b") or system == "hf-generate-batch" or system == "hf-reference":
        from kiln_bench import baselines

        model = baselines.load_hf_model(model_dir, job["dtype"], job.get("device", "cpu"))
        load_s = time.perf_counter() - t_load
        if system == "hf-generate-batch":
            run = baselines.run_hf_continuous(model, workload, job["max_num_tokens"], job["max_batch_size"])
        else:
            batch = 1 if system == "hf-reference" else int(system.removeprefix("hf-static-b"))
            _warm_static(baselines, model, workload)
            run = baselines.run_hf_static(model, workload, batch, pad_id=job["pad_id"])
            run.system = system
    elif system in ("kiln", "kiln-reference", "kiln-batch-invariant") or system.startswith("kiln-pp"):
        from kiln_bench import run_kiln

        llm = run_kiln.load(model_dir, job)
        load_s = time.perf_counter() - t_load
        run_kiln.warm(llm)
        run = run_kiln.run(llm, workload, job)
        run.system = system
        llm.shutdown()  # stops the rank processes of the pipeline systems
    else:
        raise ValueError(f"unknown system {system!r}")
    run.load_s = load_s
    run.peak_rss_bytes = _peak_rss_bytes()
    run.extra["threads"] = torch.get_num_threads()
    return run.to_json()


def _warm_static(baselines, model, workload) -> None:
    from kiln_bench.workload import Request, Workload

    warm = Workload(workload.spec, [Request(0, workload.requests[0].prompt_token_ids[:16], 4, 0.0)])
    baselines.run_hf_static(model, warm, 1, pad_id=0)


def main(argv: list[str]) -> int:
    job_path, out_path = Path(argv[0]), Path(argv[1])
    result = run_job(json.loads(job_path.read_text()))
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
