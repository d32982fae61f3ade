"""Mechanism: turn the scheduler's decision into packed tensors, run the model, sample.

One forward pass computes every scheduled token of every request, unpadded:
single-token rows (decodes) first, then prefill chunks (see
``layers/attention.py``). Logits are computed only for rows whose last
scheduled token is their last token (a finished prefill or a decode); a
chunk in the middle of a prompt produces no token. A decode with speculative
drafts is a multi-token row like a prefill chunk, with logits at every
position (``spec_decode``).

With tensor/pipeline parallelism, rank 0 prepares the step's inputs once (one
``StepInputs`` per micro-batch), broadcasts them, and every rank runs its stage
(``run_stage``): activations go stage to stage point to point, the last stage
sends the logits to rank 0, and only rank 0 samples.
"""

from __future__ import annotations

import datetime
import itertools
import logging
from pathlib import Path
from typing import Any

import torch
from kiln.engine import parallel
from kiln.engine.config import EngineConfig
from kiln.engine.forward_context import set_forward_context
from kiln.engine.kv_cache import allocate_kv_cache, bytes_per_block, plan_num_blocks
from kiln.engine.layers.attention import AttentionMetadata, PrefillChunk
from kiln.engine.layers.linear import LinearBase
from kiln.engine.layers.paged_metadata import build_paged_metadata, token_rows
from kiln.engine.lora.runner import LoRARunner
from kiln.engine.models.llama import Intermediate, head_dim_of, kv_heads_of
from kiln.engine.models.registry import create_model
from kiln.engine.prompt_logprobs import PromptSpan, fill, prompt_rows
from kiln.engine.sampler import Sampler, SamplerOutput, SamplingRow, merge_rows
from kiln.engine.sequence import Request
from kiln.engine.spec_decode.verify_rows import sampled_positions, sampling_rows
from kiln.engine.step_inputs import StepInputs, encode_steps, pack_rows, split_batch
from kiln.engine.weights import load_checkpoint, load_engine_state

log = logging.getLogger("kiln.engine")


_LOGITS_TAG = 1 << 20  # point-to-point tags: micro-batch i's activations use i, its logits this + i


def build_model(config: EngineConfig) -> torch.nn.Module:
    """This rank's shard of the model, with weights loaded (and quantized if asked)."""
    artifact_quant = config.quantization if config.weights_dir is not None else None
    model = create_model(config.hf_config, config.max_seq_len, config.torch_dtype, config.device, artifact_quant)
    if config.weights_dir is not None:
        name = f"rank-{parallel.rank()}-of-{parallel.world_size()}.safetensors"
        load_engine_state(model, Path(config.weights_dir) / name)
    else:
        load_checkpoint(model, config.model)
        if config.quantization:
            for m in model.modules():
                if isinstance(m, LinearBase):
                    m.quantize_(config.quantization)
    return model.eval()


class ModelRunner:
    def __init__(self, config: EngineConfig, extra_block_bytes: int = 0) -> None:
        """``extra_block_bytes``: memory per KV block beyond this model's own (a draft model's pool, which
        has as many blocks), so the pool is planned for both."""
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.model = build_model(config)
        self._bind_kernels(config)
        # LoRA's runner half (lora/runner.py): this rank's adapter slots, made before the KV pool is planned so
        # that the pool is sized after them (what the build's KV plan takes out of the budget, kv_plan.py)
        self.lora = LoRARunner(self.model, config.lora_config, self.device, self.native) if config.enable_lora else None
        self._allocate_kv_pool(config, extra_block_bytes)
        if self.native is not None and config.compile == "off":  # the layers in one C call per step
            stack = (self.tactics.model.get("decoder_stack") or {}).get("winner") if self.tactics else None
            why = "the tactic table timed the modules faster" if stack == "modules" else \
                self.model.bind_native_stack(self.native)
            if why:
                log.info("kiln CPU kernels: decoder layers run module by module (%s)", why)
        self.sampler = Sampler()
        self.step_timer = None  # step_timer.StepTimer while kiln bench --profile times the steps' phases
        self.workspace: dict[str, torch.Tensor] = {}  # attention's gather buffers, reused every step
        self._compile(config)

    def _bind_kernels(self, config: EngineConfig) -> None:
        """The kernels the model runs: the build's autotuned GPU configs, kiln's native CPU kernels, and the
        tactic table that picks each linear's implementation (CPU, eager)."""
        if config.device == "cuda":  # the build's autotuned configs (kernels/cache.py), before graphs run kernels
            from kiln.engine.kernels.cache import seed_from_environment

            seed_from_environment()
        self.native = None  # kernels.native.Kernels when the attention backend is "native"
        if config.attention_backend == "native":
            from kiln.engine.kernels.native import kernels

            self.native = kernels()
            if config.compile == "off":  # the fused pointwise kernels too (Inductor fuses its own)
                for m in self.model.modules():
                    if hasattr(m, "native_ops"):
                        m.native_ops = self.native
        self.tactics = None  # kiln.engine.tactics.TacticTable: which implementation runs each linear (CPU)
        self.tactics_job = None  # tactics.deferred.Deferred: this host's table, timed after /ready, swapped in later
        self.tactic_sites: list = []  # the linear shapes it covers (tactics.timing.LinearSite), for a build to time
        if config.device == "cpu" and config.compile == "off":  # with Inductor, freezing packs the weights
            from kiln.engine.kernels.native import kernels
            from kiln.engine.tactics.bind import apply
            from kiln.engine.tactics.swap import prepare_deferred

            gemm = self.native or kernels()  # kiln's GEMMs are candidates whatever runs attention
            self.tactics, config.tactics_info, self.tactic_sites = apply(self.model, config, gemm,
                                                                         stack=self.native is not None)
            self.tactics_job = prepare_deferred(self.tactics, self.model, config, gemm)

    def _allocate_kv_pool(self, config: EngineConfig, extra_block_bytes: int) -> None:
        """This rank's KV pool: planned from the memory left after the load, the same size on every rank."""
        cfg = config.hf_config
        kv_heads = kv_heads_of(cfg) // parallel.tp_size()
        self.num_kv_heads = kv_heads  # this rank's
        self.attention_backend = config.attention_backend  # resolved: "torch", "native" or "triton"
        # This stage's layers only: each stage's pool holds its own layers' K/V for every block.
        start, end = parallel.stage_layers(cfg["num_hidden_layers"], parallel.pp_rank(), parallel.pp_size())
        block_bytes = bytes_per_block(config, end - start, kv_heads, head_dim_of(cfg)) + extra_block_bytes
        # The first collective after the load (and the tactics' timing): under the join timeout, not the step's.
        parallel.wait_for_ranks(config.join_timeout_s, "loading its weights")
        self.num_blocks = parallel.min_over_ranks(plan_num_blocks(config, block_bytes))
        # One block more than the block manager hands out: CUDA-graph padding rows write there.
        self.kv_cache = allocate_kv_cache(self.model, config, self.num_blocks + 1)

    def _compile(self, config: EngineConfig) -> None:
        """Inductor (``compile``) and CUDA graphs (``enforce_eager`` off), once the pool exists."""
        self.graphs = self.compiled = None
        if config.compile != "off":
            from kiln.engine.compile import CompiledModel, use_shipped_cache, warm_up

            if config.compile_cache:
                use_shipped_cache(config.compile_cache)
            self.compiled = CompiledModel(self.model)
            log.info("compiled the model (%s) in %.1fs", config.compile, warm_up(self))
        if config.device == "cuda" and not config.enforce_eager:
            from kiln.engine.cuda_graphs import CUDAGraphRunner, default_batch_sizes

            sizes = config.cuda_graph_batch_sizes or default_batch_sizes(config.max_batch_size)
            paged = self.num_kv_heads if self.attention_backend == "triton" else None
            self.graphs = CUDAGraphRunner(self.model, self.block_size, -(-config.max_seq_len // self.block_size),
                                          self.num_blocks, sizes, self.device, paged_kv_heads=paged)

    def swap_pending_tactics(self) -> None:
        """On the engine thread, between steps: start timing this host's table in the background (the first
        call), and once it is timed pack the model by it (``tactics.deferred``)."""
        if self.tactics_job is not None:
            from kiln.engine.tactics.swap import tick

            self.tactics, self.config.tactics_info, self.tactics_job = tick(
                self.tactics_job, self.tactics, self.config, self.model, self.native is not None)

    def let_go(self) -> None:
        """The engine shut down: a table still timed in the background lets go of the model (``Deferred.let_go``;
        a pool's unload counts on the weights going)."""
        if self.tactics_job is not None:
            self.tactics_job.let_go()

    # -- rank 0 ---------------------------------------------------------------------------
    def prepare(self, scheduled: list[tuple[Request, int]]) -> tuple[StepInputs, list[Request], list[PromptSpan]]:
        """Pack the step; returns the inputs, in row order the requests that get a token (a request verifying
        ``k`` drafts once per position: ``k + 1`` times in a row), and the prompt-logprob rows after them."""
        # single-token rows first; then by adapter slot, so each adapter's tokens are one run (lora/layers.py)
        order = sorted(scheduled, key=lambda rn: (rn[1] > 1, -1 if rn[0].lora_slot is None else rn[0].lora_slot))
        reqs = [r for r, _ in order]
        nums = [n for _, n in order]
        starts = [r.num_computed_tokens for r in reqs]
        # A verified row: the last committed token, then its drafts.
        rows = [(r.token_ids[s:s + n] + r.spec_token_ids, s, r.block_table)
                for r, s, n in zip(reqs, starts, nums, strict=True)]
        cu = list(itertools.accumulate(nums))
        logits_rows, sampled = sampled_positions(reqs, starts, nums, cu)
        prompt_positions, spans = prompt_rows(reqs, starts, nums, cu)
        slots = self.lora.token_slots(reqs) if self.lora is not None else None
        return pack_rows(rows, self.block_size, logits_rows + prompt_positions, slots), sampled, spans

    def run(self, scheduled: list[tuple[Request, int]],
            lora_loads: list[tuple[int, Any]] = ()) -> tuple[list[Request], SamplerOutput | None]:
        """``lora_loads``: (slot, adapter) the scheduler assigned this step, put on the device (every rank's)
        before the step runs."""
        batches = [self.prepare(part) for part in split_batch(scheduled, self.config.num_micro_batches,
                                                                self.config.micro_batch_min_tokens)]
        inputs = [b for b, _, _ in batches]
        if self.lora is not None:
            self.lora.load_step(lora_loads)
        if parallel.world_size() > 1:
            parallel.send_message(parallel.STEPS, encode_steps(inputs))
        timer = self.step_timer
        if timer is not None:
            timer.lap("prepare")
        parts = self.run_stage(inputs)
        if timer is not None:
            timer.lap("forward")
        # Each micro-batch's logits: its sampled rows, then its prompt-logprob rows (none sent for one without rows).
        with_rows = [(reqs, spans, part) for (b, reqs, spans), part in zip(
            [b for b in batches if b[0].logits_indices.shape[0]], [p for p in parts if p.shape[0]], strict=True)]
        for reqs, spans, part in with_rows:
            fill(part[len(reqs):], spans)
        sampled_reqs = [r for _, reqs, _ in batches for r in reqs]
        if not sampled_reqs:
            return [], None
        parts = [part[:len(reqs)] for reqs, _, part in with_rows if reqs]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = self.sample(logits.float(), sampling_rows(sampled_reqs))
        if timer is not None:
            timer.lap("sample")
        return sampled_reqs, out

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The batch's tokens; if sampling the batch fails, each row is sampled alone so that
        only the rows that fail by themselves are lost (``errors``, token id -1)."""
        try:
            return self.sampler(logits, rows)
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling each row alone", len(rows))
        outs: dict[int, SamplerOutput] = {}
        errors: dict[int, str] = {}
        for i, row in enumerate(rows):
            try:
                outs[i] = self.sampler(logits[i:i + 1], [row])
            except Exception as exc:
                log.exception("sampling failed for row %d", i)
                errors[i] = f"sampling failed for this request ({type(exc).__name__})"
        return merge_rows(outs, errors, len(rows), logits.device)

    # -- every rank -----------------------------------------------------------------------
    @torch.inference_mode()
    def run_stage(self, batches: list[StepInputs]) -> list[torch.Tensor]:
        """This rank's stage over each micro-batch, in order; on rank 0, the logits of every
        micro-batch that samples (``[rows, vocab]``), in order.

        Stage ``s`` receives micro-batch ``i``'s activations from stage ``s - 1`` while it
        works on ``i - 1``: with ``m`` micro-batches in flight the stages overlap. The
        activation receives are posted up front, rank 0's receives of the logits only after
        its last activation send: NCCL runs a pair's point-to-point ops in the order each rank
        posts them, so a receive from the last stage posted before the send it waits on would
        deadlock PP=2 (gloo matches by tag and did not mind). Every wait is bounded by
        ``distributed_timeout_s``.
        """
        if parallel.pp_size() == 1:
            return [self.execute(b) for b in batches]
        dev, dtype = self.device, self.config.torch_dtype
        hidden_size, vocab = self.config.hf_config["hidden_size"], self.config.hf_config["vocab_size"]
        timeout = datetime.timedelta(seconds=self.config.distributed_timeout_s)
        first, last = parallel.is_first_stage(), parallel.is_last_stage()
        recvs: list[tuple[torch.Tensor, Any]] = []
        if not first:
            for i, b in enumerate(batches):
                buf = torch.empty(2, b.input_ids.shape[0], hidden_size, dtype=dtype, device=dev)
                recvs.append((buf, parallel.irecv(buf, parallel.prev_stage_peer(), tag=i)))
        logit_recvs: list[tuple[torch.Tensor, Any]] = []
        sends: list[tuple[torch.Tensor, Any]] = []
        try:
            for i, b in enumerate(batches):
                intermediate = None
                if not first:
                    buf, work = recvs[i]
                    work.wait(timeout)
                    intermediate = (buf[0], buf[1])
                out = self.execute(b, intermediate)
                if not last:
                    payload = torch.stack(out)
                    sends.append((payload, parallel.isend(payload, parallel.next_stage_peer(), tag=i)))
                elif parallel.tp_rank() == 0 and out.shape[0]:
                    out = out.to(dtype).contiguous()
                    sends.append((out, parallel.isend(out, 0, tag=_LOGITS_TAG + i)))
            if parallel.rank() == 0:  # after every activation send (see above)
                for i, b in enumerate(batches):
                    if b.logits_indices.shape[0]:
                        buf = torch.empty(b.logits_indices.shape[0], vocab, dtype=dtype, device=dev)
                        logit_recvs.append((buf, parallel.irecv(buf, parallel.last_stage_driver(),
                                                                tag=_LOGITS_TAG + i)))
            for _, work in logit_recvs:
                work.wait(timeout)
            for _, work in sends:
                work.wait(timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"pipeline stage {parallel.pp_rank()} (rank {parallel.rank()}) lost a peer "
                               f"or timed out after {self.config.distributed_timeout_s:.0f}s: {exc}") from exc
        return [buf for buf, _ in logit_recvs]

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, intermediate: Intermediate | None = None):
        """One forward pass of this rank's stage: logits on the last stage, else (hidden, residual)."""
        n = inputs.input_ids.shape[0]
        lora_step = self.lora.step(inputs) if self.lora is not None else None
        if (self.graphs is not None and inputs.num_decodes == n and inputs.logits_indices.shape[0] == n
                and self.graphs.can_run(n) and lora_step is None):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                   inputs.decode_block_tables, inputs.decode_ctx_lens)
        dev = self.device
        metadata = self.attention_metadata(inputs)
        if self.step_timer is not None:
            self.step_timer.lap("prepare")
        with set_forward_context(metadata, lora_step):
            if self.compiled is not None:
                return self.compiled(inputs.input_ids, inputs.positions, inputs.logits_indices)
            out = self.model(inputs.input_ids.to(dev), inputs.positions.to(dev), intermediate)
            if not parallel.is_last_stage():
                return out
            return self.model.compute_logits(out[inputs.logits_indices.to(dev)])

    def attention_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """The step's attention metadata on this rank's device, built once for every layer."""
        dev = self.device
        slot_mapping = inputs.slot_mapping.to(dev)
        if self.attention_backend == "triton":
            paged = build_paged_metadata(inputs.decode_block_tables, inputs.decode_ctx_lens, inputs.prefills,
                                         self.num_kv_heads, dev)
            return AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=inputs.num_decodes, paged=paged)
        if self.native is not None:  # kernels/cpu_kernels.c: every token one row, read from the blocks
            tables, lens, groups = token_rows(inputs.decode_block_tables, inputs.decode_ctx_lens, inputs.prefills)
            return AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=lens.shape[0], native=self.native,
                                     decode_block_tables=tables, decode_ctx_lens=lens, native_row_starts=groups)
        ctx = inputs.decode_ctx_lens.to(dev)
        tables = inputs.decode_block_tables.to(dev).contiguous()
        decode_mask = decode_pad_mask = None
        if inputs.num_decodes:
            width = inputs.decode_block_tables.shape[1] * self.block_size
            decode_mask = (torch.arange(width, device=dev)[None, :] < ctx[:, None])[:, None, None, :]
            decode_pad_mask = ~decode_mask.view(1, inputs.num_decodes, 1, width)
        prefills = []
        for q_start, q_len, ctx_len, block_ids in inputs.prefills:
            mask = None
            if q_len != ctx_len:
                offset = ctx_len - q_len
                mask = (torch.arange(ctx_len, device=dev)[None, :]
                        <= torch.arange(q_len, device=dev)[:, None] + offset)
            prefills.append(PrefillChunk(q_start, q_len, ctx_len, block_ids.to(dev), mask))
        return AttentionMetadata(
            slot_mapping=slot_mapping, num_decode_tokens=inputs.num_decodes,
            decode_block_tables=tables, decode_mask=decode_mask, prefills=prefills, decode_pad_mask=decode_pad_mask,
            workspace=self.workspace,
        )
