"""The build pipeline: fetch (-> fetch_draft, with a draft model: ``draft_stage``) -> check -> gate
(reference, converting as it streams) -> shard (and the draft) -> plan -> gate (runtime) -> tune (and
the KV plan again, less the CUDA graphs' memory) -> tactics (each op's implementations timed, the
winners shipped) -> compile -> speculative (with spec.speculative on: where
drafts pay per batch bucket, the table shipped) -> kernels (CUDA: compiled, autotuned, packed) ->
package -> publish.

Every stage runs inside ``report.stage(name)`` (progress log + timing). Nothing
reaches the store until the last stage, and the store's publish is atomic, so a
build that fails or is killed at any point leaves no visible version. The
quality gate runs twice: first on the converted weights in a reference model
(cheap, fails before sharding), then on the packaged artifact loaded by the
runtime itself, so what is published is exactly what was measured. Neither gate holds
a whole full-precision model: the reference models stream one unit of weights at a
time from the checkpoint (:mod:`kiln.builder.reference`), converting as they go, so
no stage before ``shard`` loads the checkpoint whole.
"""

from __future__ import annotations

import gc
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.builder import quality
from kiln.builder.check import check_envelope, model_facts
from kiln.builder.draft_stage import check_draft, draft_kv_bytes_per_token, fetch_draft, write_draft
from kiln.builder.errors import InvalidSpec, QualityGateFailed, StorageFailure
from kiln.builder.fetch import Checkpoint, fetch_checkpoint
from kiln.builder.kernel_cache import build_kernel_cache
from kiln.builder.package import (
    copy_model_files,
    dir_bytes,
    engine_config,
    engine_document,
    write_engine_json,
)
from kiln.builder.reference import StreamedCausalLM, choose_cpu_threads
from kiln.builder.report import BuildReport, human_bytes
from kiln.builder.shard import shard_weights
from kiln.builder.tune import kv_plan_summary, plan_kv, plan_with_cuda_graphs, tune

log = logging.getLogger("kiln.build")
# Tokens of KV the build-time runtime loads need: the calibration prompts and the tuning batches.
BUILD_TIME_KV_TOKENS = 8 * 1024


@dataclass
class BuildResult:
    version: str
    artifact_uri: str
    engine_json: dict[str, Any]


def _gate(spec, metrics: dict[str, Any], report: BuildReport) -> dict[str, Any]:
    max_kl, min_agree = quality.thresholds(spec)
    verdict = quality.judge(metrics, max_kl, min_agree)
    report.record("quality", verdict)
    log.info("quality: KL %.3g (max %s), greedy agreement %.4f (min %s) -> %s", verdict["kl_divergence"], max_kl,
             verdict["token_agreement"], min_agree, "pass" if verdict["passed"] else "FAIL")
    if not verdict["passed"]:
        raise QualityGateFailed(quality.failure_message(verdict), verdict)
    return verdict


def _check_build_machine(spec) -> None:
    """The gate and the tuning run the artifact here, so this machine must be the target's arch."""
    from kiln.engine.artifact import current_arch

    here = current_arch()
    if here != spec.gpu_spec.arch:
        raise InvalidSpec(f"spec.gpu: {spec.gpu} engines ({spec.gpu_spec.arch}) must be built on a {spec.gpu} "
                          f"(the build verifies and tunes on the target), but this machine is {here}; run the "
                          f"build on a {spec.gpu} node, or set spec.gpu: cpu for a CPU engine")


def _device(spec) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and not spec.gpu_spec.is_cpu else "cpu"


def run_build(engine, store, version: str, envelope: dict, work_dir: Path, report: BuildReport,
              checkpoint: Checkpoint | None = None, built_by=None, draft_checkpoint: Checkpoint | None = None
              ) -> BuildResult:
    """Build ``engine`` (an ``LLMEngine``) as ``version`` and publish it to ``store``.

    ``checkpoint`` / ``draft_checkpoint``: already fetched (``--prefetched``); otherwise this fetches them. ``built_by``
    (:class:`kiln.artifacts.BuiltBy`) is recorded in the published manifest.
    """
    from transformers import AutoTokenizer

    spec = engine.spec
    out = work_dir / f"engine-{version}"
    if out.exists():
        shutil.rmtree(out)  # a retried Job starts the package from scratch

    _check_build_machine(spec)  # before a download that could take an hour
    with report.stage("fetch"):
        ckpt = checkpoint or fetch_checkpoint(spec.model.source, spec.model.revision, work_dir, file=spec.model.file)
        report.record("source", ckpt.provenance())
        if ckpt.resolved_revision and ckpt.resolved_revision != spec.model.revision:
            log.warning("spec.model.revision %s can move; this build used commit %s (recorded in engine.json); "
                        "pin that sha so the version names one set of weights", spec.model.revision or "main",
                        ckpt.resolved_revision)

    drafted = spec.speculative is not None and spec.speculative.draft_model is not None
    if drafted:
        with report.stage("fetch_draft"):
            draft_ckpt = draft_checkpoint or fetch_draft(spec, work_dir)
            report.record("draft_source", draft_ckpt.provenance())

    with report.stage("check"):
        facts = model_facts(ckpt.path)
        report.record("model", facts.to_dict())
        report.record("memory_estimate", check_envelope(spec, facts))

    device = _device(spec)
    with report.stage("quality_reference"):
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt.path), trust_remote_code=False)
        draft_kv = 0  # the draft's K/V per token, planned into the pool beside the target's
        if drafted:
            draft_facts = check_draft(spec, draft_ckpt, tokenizer)
            report.record("draft_model", draft_facts.to_dict())
            draft_kv = draft_kv_bytes_per_token(draft_facts, spec)
        prompts = spec.build.calibration_prompts or quality.CALIBRATION_PROMPTS
        token_lists = quality.tokenize_prompts(tokenizer, prompts, spec)
        if device == "cpu":
            choose_cpu_threads()
        source = StreamedCausalLM(ckpt.path, device)
        converted = StreamedCausalLM(ckpt.path, device, spec.dtype, spec.quantization)
        metrics = quality.teacher_forced_metrics(source, converted, token_lists, facts.vocab_size)
        metrics["num_prompts"] = len(token_lists)
        metrics["calibration_prompts"] = "spec" if spec.build.calibration_prompts else "builtin"
        summary = converted.convert_summary
        report.record("convert", summary)
        log.info("converted %d tensors to %s (%d quantized, %s) as the gate streamed them", summary["num_tensors"],
                 spec.dtype, summary["num_quantized_tensors"], spec.quantization)
        del converted
        _gate(spec, metrics, report)

    with report.stage("shard"):
        copy_model_files(ckpt.path, out)
        rank_files = shard_weights(ckpt.path, out / "weights", spec)
        weights_per_rank = max(p.stat().st_size for p in rank_files)
        report.record("sizes", {"source_weight_bytes": sum(s for n, s in ckpt.files.items()
                                                           if n.endswith(".safetensors")),
                                "artifact_weight_bytes": dir_bytes(out / "weights"),
                                "weight_bytes_per_rank": weights_per_rank,
                                "rank_files": [p.name for p in rank_files]})
        log.info("weights: %s per rank, %d rank file(s)", human_bytes(weights_per_rank), len(rank_files))
        if drafted:  # on rank 0, beside its shard; counted on every rank (rank 0 sets the pool for all)
            weights_per_rank += write_draft(draft_ckpt, out, spec).stat().st_size

    with report.stage("plan"):
        kv_plan = plan_kv(spec, facts, weights_per_rank, extra_kv_bytes_per_token=draft_kv)
        report.record("kv_plan_summary", kv_plan_summary(kv_plan))
        log.info("kv pool: %s", kv_plan_summary(kv_plan))
        config = engine_config(spec, kv_plan["num_kv_blocks"])

    def write(tuning: dict, cfg: dict, kernels: dict | None = None) -> dict:
        doc = engine_document(spec=spec, envelope=envelope, version=version, config=cfg, kv_plan=kv_plan,
                              tuning=tuning, build_report=report.to_dict(), kernels=kernels)
        write_engine_json(out, doc)
        return doc

    write({}, config)

    # Build-time loads (gate, tuning) share the device with the fp32 source model, so they get a small
    # KV pool: enough for their own requests. engine.json keeps the planned pool for serving.
    build_pool = min(kv_plan["num_kv_blocks"], BUILD_TIME_KV_TOKENS // spec.kv.block_size
                     + math.ceil(spec.max_seq_len / spec.kv.block_size))

    def load_llm(**overrides):
        from kiln.engine import LLM
        from kiln.engine.errors import ConfigError

        try:
            return LLM.from_artifact(str(out), device=device, **{"num_kv_blocks": build_pool, **overrides})
        except ConfigError as exc:  # a limit the runtime enforces beyond the checks above
            raise InvalidSpec(f"the kiln runtime cannot run this envelope: {exc}") from None

    with report.stage("quality_runtime"):
        llm = load_llm()
        try:
            continuations = quality.runtime_continuations(llm, token_lists)
        finally:
            llm.shutdown()  # frees the KV pool and, with TP, the worker ranks and process group
        del llm
        gc.collect()
        metrics.update(quality.runtime_agreement(source, token_lists, continuations))
        del source
        _gate(spec, metrics, report)

    with report.stage("tune"):
        tuning, overrides = tune(load_llm, spec, facts.vocab_size)
        # The pool of serving is what is left after the CUDA graphs measured here (plan_with_cuda_graphs).
        kv_plan, overrides = plan_with_cuda_graphs(spec, facts, weights_per_rank, tuning, overrides, draft_kv)
        report.record("kv_plan_summary", kv_plan_summary(kv_plan))
        config = {**config, **overrides, "num_kv_blocks": kv_plan["num_kv_blocks"]}

    with report.stage("tactics"):  # each op's implementations timed here, the winners shipped (tactics_stage)
        from kiln.builder.tactics_stage import tune_tactics

        write(tuning, config)  # its loads must see the tuned threads, as a serving pod will
        tactics, tactic_overrides = tune_tactics(load_llm, spec, facts.vocab_size, out, tuning)
        report.record("tactics", tactics)
        config = {**config, **tactic_overrides}

    with report.stage("compile"):  # CPU: Inductor for this host's ISA, shipped when it measures faster
        from kiln.builder.compile_stage import compile_for_target

        write(tuning, config)  # its loads must see the tuned threads, as a serving pod will (not re-measure)
        config = {**config, **compile_for_target(load_llm, spec, facts.vocab_size, out, tuning, config)}

    if spec.speculative is not None and spec.speculative.is_on:
        with report.stage("speculative"):  # where drafts pay, per batch bucket, on the engine as built
            from kiln.builder.speculative_stage import rewrite_workload, tune_speculation
            from kiln.engine.spec_decode.draft_model import ARTIFACT_DRAFT_DIR

            write(tuning, config)
            draft_dir = str(out / ARTIFACT_DRAFT_DIR) if drafted else None
            record, spec_overrides = tune_speculation(load_llm, spec, rewrite_workload(tokenizer, prompts, spec),
                                                      draft_dir)
            tuning["speculative"] = record
            report.record("speculative", record)
            config = {**config, **spec_overrides}

    with report.stage("kernels"):  # compiled and autotuned on this GPU, shipped (kiln.builder.kernel_cache)
        write(tuning, config)  # the warm-up loads the artifact as a serving pod will
        kernels = build_kernel_cache(out, device, work_dir, {"num_kv_blocks": build_pool})

    with report.stage("package"):
        report.record("sizes", {**report.findings["sizes"], "artifact_bytes": dir_bytes(out)})
        doc = write(tuning, config, kernels)

    with report.stage("publish"):
        from kiln.artifact_manifest import ArtifactConflict, StoreError

        try:
            store.publish(version, out, envelope, progress=_publish_progress(), built_by=built_by)
        except ArtifactConflict:
            # Another builder of the same version won the race; its artifact differs from ours only in
            # what was measured (timings), and a version is immutable once published: use theirs.
            log.warning("%s was published concurrently by another build; keeping that one", version)
        except StoreError as exc:
            raise StorageFailure(str(exc)) from None
    return BuildResult(version=version, artifact_uri=store.artifact_uri(version), engine_json=doc)


def _publish_progress():
    import time

    last = {"t": 0.0}

    def progress(path: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last["t"] > 5:
            last["t"] = now
            log.info("publish %s: %s/%s", path, human_bytes(done), human_bytes(total))

    return progress
