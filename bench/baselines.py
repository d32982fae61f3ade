"""The transformers baselines: static batching with ``model.generate`` and continuous batching.

Both decode greedily with EOS disabled, so every request produces exactly its
workload ``output_len`` tokens, like kiln with ``ignore_eos``:

- static batching: requests in arrival order, in batches of ``batch_size``,
  left-padded; each batch decodes ``max(output_len)`` of its members (a request
  cannot leave its batch early), and a request's output is its own first
  ``output_len`` tokens. Its results reach the caller when ``generate`` returns.
  (EOS is disabled rather than ``min_new_tokens`` set: that would mask the EOS
  logit and change greedy outputs.)
- continuous batching: transformers' own manager (what ``generate_batch``
  runs), driven request by request because ``generate_batch`` takes a single
  ``max_new_tokens`` for all prompts while ``add_request`` takes one per request.
"""

from __future__ import annotations

import inspect
import time
from math import ceil
from pathlib import Path

import torch
from kiln_bench.records import RequestRecord, RunRecord
from kiln_bench.workload import Workload


def load_hf_model(model_dir: Path, dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    # generate() merges model.generation_config into any config it is given, so
    # EOS must be cleared at the source too, or a sampled EOS ends a request early.
    model.generation_config.eos_token_id = None
    return model


class _StepClock:
    """A StoppingCriteria that never stops: it timestamps every decoding step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf_static(model, workload: Workload, batch_size: int, pad_id: int) -> RunRecord:
    from transformers import GenerationConfig, StoppingCriteriaList

    requests = workload.requests
    records: list[RequestRecord] = []
    num_steps = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        ready_at = t0 + max(r.arrival_time for r in batch)  # a static batch waits for its last member
        if (wait := ready_at - time.perf_counter()) > 0:
            time.sleep(wait)
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n:] = 1
        max_new = max(r.output_len for r in batch)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=pad_id)
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        out = out.cpu()
        done = time.perf_counter()
        if out.shape[1] - width != max_new:
            raise RuntimeError(f"static batch produced {out.shape[1] - width} tokens, expected {max_new}")
        # One forward pass per generated position: the prefill (first token) + max_new - 1 decodes.
        num_steps += max_new
        for row, r in enumerate(batch):
            records.append(RequestRecord(
                index=r.index, arrival=r.arrival_time, first_token=clock.times[0] - t0, finished=done - t0,
                output_token_ids=out[row, width:width + r.output_len].tolist(),
            ))
    duration = max(r.finished for r in records)
    return RunRecord(system=f"hf-static-b{batch_size}", duration_s=duration, num_steps=num_steps, requests=records)


def run_hf_continuous(model, workload: Workload, max_num_tokens: int, max_batch_size: int) -> RunRecord:
    """transformers' continuous batching, sized like kiln: same token budget per step, same
    request cap, and a KV cache (page size 256) that holds every request at once."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    num_blocks = sum(ceil((len(r.prompt_token_ids) + r.output_len) / page) for r in workload.requests) + 2
    # transformers 5.24 calls the page `page_size`; 5.17 (the GPU machines' image) called it `block_size`
    named = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{named: page}, num_blocks=num_blocks, max_batch_tokens=max_num_tokens,
        max_requests_per_batch=max_batch_size,
    )
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=workload.requests[0].output_len)
    steps = {"n": 0}

    def count_step(module, args, kwargs, output):
        steps["n"] += 1

    records: list[RequestRecord] = []
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30,
    ) as manager:
        _warm_continuous(manager)
        hook = model.register_forward_hook(count_step, with_kwargs=True)
        try:
            records = _drive_continuous(manager, workload)
        finally:
            hook.remove()
    duration = max(r.finished for r in records)
    notes = ["generate_batch has one max_new_tokens for all prompts: driven via add_request per request"]
    return RunRecord(system="hf-generate-batch", duration_s=duration, num_steps=steps["n"], requests=records,
                     notes=notes)


def _warm_continuous(manager) -> None:
    rid = manager.add_request([5, 6, 7, 8], max_new_tokens=4, eos_token_id=-1, request_id="warmup")
    while (res := manager.get_result(timeout=30)) is not None:
        if res.request_id == rid and res.is_finished():
            return
    raise RuntimeError("transformers continuous batching did not finish its warmup request")


def _drive_continuous(manager, workload: Workload) -> list[RequestRecord]:
    t0 = time.perf_counter()
    pending = sorted(workload.requests, key=lambda r: r.arrival_time)
    by_id = {}
    results = {}
    while pending or len(results) < len(workload.requests):
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_time <= now:
            r = pending.pop(0)
            rid = manager.add_request(r.prompt_token_ids, request_id=f"bench-{r.index}", max_new_tokens=r.output_len,
                                      record_timestamps=True, eos_token_id=-1)
            by_id[rid] = r
        timeout = max(0.001, pending[0].arrival_time - now) if pending else 60
        res = manager.get_result(timeout=timeout)
        if res is None:
            if not pending and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped before finishing the workload")
            continue
        if res.is_finished():
            if res.error is not None:
                raise RuntimeError(f"transformers continuous batching failed request {res.request_id}: {res.error}")
            results[res.request_id] = (res, time.perf_counter() - t0)
    records = []
    for rid, (res, finished) in results.items():
        r = by_id[rid]
        first = res.timestamps[0] - t0 if res.timestamps else finished
        records.append(RequestRecord(index=r.index, arrival=r.arrival_time, first_token=first, finished=finished,
                                     output_token_ids=list(res.generated_tokens)))
    return sorted(records, key=lambda rec: rec.index)
