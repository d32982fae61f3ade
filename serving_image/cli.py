"""``kiln serve``: serve a model directory or an engine artifact over the OpenAI API.

Exit codes: 0 after a clean drain (SIGTERM/SIGINT), 1 when the model or
artifact could not be loaded (the message says why), 2 for usage errors.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click
from kiln.serving.config import ServeConfig


class _JSONObject(click.ParamType):
    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        import json

        try:
            parsed = json.loads(value) if isinstance(value, str) else value
        except ValueError as exc:
            self.fail(f"must be a JSON object such as '{{\"method\": \"ngram\"}}': {exc}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("must be a JSON object such as '{\"method\": \"ngram\"}'", param, ctx)
        return parsed


# Engine overrides: flag name -> (LLM() keyword, click type, help).
_ENGINE_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--dtype", "dtype", click.Choice(["float32", "bfloat16", "float16"]), "Weights/activations dtype."),
    ("--max-batch-size", "max_batch_size", click.IntRange(min=1), "Most requests in one engine step."),
    ("--max-num-tokens", "max_num_tokens", click.IntRange(min=1), "Token budget per step (chunked prefill)."),
    ("--max-seq-len", "max_seq_len", click.IntRange(min=2), "Prompt + output limit per request."),
    ("--max-input-len", "max_input_len", click.IntRange(min=1), "Prompt limit per request."),
    ("--block-size", "block_size", click.IntRange(min=1), "KV-cache block size (power of two)."),
    ("--num-kv-blocks", "num_kv_blocks", click.IntRange(min=1), "KV-cache pool size in blocks."),
    (
        "--kv-memory-fraction",
        "kv_memory_fraction",
        click.FloatRange(0, 1, min_open=True),
        "Fraction of free device memory for the KV pool.",
    ),
    (
        "--tensor-parallel-size",
        "tensor_parallel_size",
        click.Choice(["1", "2", "4", "8"]),
        "Tensor-parallel ranks.",
    ),
    (
        "--pipeline-parallel-size",
        "pipeline_parallel_size",
        click.Choice(["1", "2", "4", "8"]),
        "Pipeline stages (layers split across processes / nodes).",
    ),
    (
        "--num-micro-batches",
        "num_micro_batches",
        click.IntRange(1, 64),
        "Micro-batches in flight per step with pipeline stages (default: the stage count; 1 = off).",
    ),
    ("--device", "device", click.Choice(["cpu", "cuda"]), "Device (default: cuda when visible)."),
    ("--quantization", "quantization", click.Choice(["none", "int8", "fp8"]), "Weight-only quantization."),
    (
        "--kv-cache-dtype",
        "kv_cache_dtype",
        click.Choice(["auto", "float32", "bfloat16", "float16"]),
        "KV-cache dtype.",
    ),
    ("--seed", "seed", int, "Engine seed for requests without their own."),
    (
        "--speculative-config",
        "speculative_config",
        _JSONObject(),
        "Speculative decoding as vLLM's flag, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
        "(docs/speculative.md).",
    ),
]


def _engine_options(fn: Any) -> Any:
    for flag, dest, kind, help_ in reversed(_ENGINE_FLAGS):
        fn = click.option(flag, dest, type=kind, default=None, help=help_)(fn)
    return click.option("--enable-prefix-caching/--no-enable-prefix-caching", "enable_prefix_caching",
                        default=None, help="Reuse KV blocks of shared prompt prefixes.")(fn)


def _read_api_key(api_key_file: Path | None) -> str | None:
    if api_key_file is not None:
        key = api_key_file.read_text().strip()
        if not key:
            raise click.UsageError(f"--api-key-file {api_key_file} is empty; put the key in it")
        return key
    return os.environ.get("KILN_API_KEY", "").strip() or None


@click.command("serve")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A Hugging Face checkpoint directory to serve.")
@click.option(
    "--artifact", help="An engine artifact URI (<store>/engines/<version>) to fetch, verify and serve."
)
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), envvar="KILN_CACHE_DIR",
              help="Where artifacts are fetched to [env KILN_CACHE_DIR; default: ~/.cache/kiln/engines].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 in a pod).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--served-model-name",
    envvar="KILN_SERVED_MODEL_NAME",
    help="The name clients use as `model` [env KILN_SERVED_MODEL_NAME; default: folder or version].",
)
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="File holding the API key clients must send as a Bearer token (else $KILN_API_KEY).")
@click.option("--max-queue-len", type=click.IntRange(min=0), default=256, show_default=True,
              envvar="KILN_MAX_QUEUE_LEN",
              help="Requests admitted beyond max_batch_size before answering 429 [env KILN_MAX_QUEUE_LEN].")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              envvar="KILN_DRAIN_TIMEOUT_SECONDS",
              help="Seconds in-flight requests get to finish after SIGTERM [env KILN_DRAIN_TIMEOUT_SECONDS].")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              envvar="KILN_MAX_CONNECTIONS",
              help="Open HTTP connections at most; past it new requests get 503 [env KILN_MAX_CONNECTIONS].")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a client may take to send a request's headers before the connection is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds a client may take to send a request's body before it gets 408.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option(
    "--access-log/--no-access-log", default=False, show_default=True, help="Log every HTTP request."
)
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="This process's rank when ranks are started separately (0 = the leader, which serves HTTP).")
@click.option("--world-size", type=click.IntRange(min=1), default=None,
              help="Ranks in all: tensor_parallel_size x pipeline_parallel_size (one rank per process).")
@click.option("--leader-address", default=None,
              help="Rank 0's HOST[:PORT] where the ranks meet. Without these three flags, $LWS_LEADER_ADDRESS, "
                   "$LWS_GROUP_SIZE and $LWS_WORKER_INDEX place the process (docs/multi-node.md).")
@click.option("--leader-port", type=click.IntRange(1, 65535), default=29500, show_default=True,
              envvar="KILN_LEADER_PORT", help="Rendezvous port when the leader address has none [env KILN_LEADER_PORT].")
@click.option("--distributed-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              envvar="KILN_DISTRIBUTED_TIMEOUT_SECONDS",
              help="Most seconds any rank waits on another once running (default 120) [env KILN_DISTRIBUTED_TIMEOUT_SECONDS].")
@click.option("--join-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              envvar="KILN_JOIN_TIMEOUT_SECONDS",
              help="Most seconds ranks wait for each other at start (default 600) [env KILN_JOIN_TIMEOUT_SECONDS].")
@_engine_options
def serve(model: Path | None, artifact: str | None, cache_dir: Path | None, host: str, port: int,
          served_model_name: str | None, api_key_file: Path | None, max_queue_len: int, drain_timeout: float,
          max_connections: int, header_timeout: float, body_timeout: float, log_level: str, access_log: bool,
          rank: int | None, world_size: int | None, leader_address: str | None, leader_port: int,
          distributed_timeout: float | None, join_timeout: float | None, **engine: Any) -> None:
    """Serve a model directory or engine artifact over an OpenAI-compatible API.

    The port opens at once; /health answers 200 and /ready 503 until the engine
    is loaded and warmed up. SIGTERM drains in-flight requests, then exits 0.
    With ranks started separately (--rank/--world-size/--leader-address, or a
    LeaderWorkerSet's LWS_* environment), rank 0 serves and the others only compute.
    """
    if (model is None) == (artifact is None):
        raise click.UsageError("give exactly one of --model DIR or --artifact URI")
    engine_kwargs = {k: v for k, v in engine.items() if v is not None}
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if key in engine_kwargs:
            engine_kwargs[key] = int(engine_kwargs[key])
    if engine_kwargs.get("quantization") == "none":
        engine_kwargs["quantization"] = None
    from kiln.serving.ranks import resolve_placement

    placement = resolve_placement(rank, world_size, leader_address, leader_port, os.environ,
                                  distributed_timeout, join_timeout)
    if placement is None and (distributed_timeout is not None or join_timeout is not None):
        engine_kwargs.update({k: v for k, v in (("distributed_timeout_s", distributed_timeout),
                                                 ("join_timeout_s", join_timeout)) if v is not None})
    if placement is not None and model is not None:  # the sizes are the flags': check the placement now
        placement.engine_kwargs(engine_kwargs.get("tensor_parallel_size", 1),
                                engine_kwargs.get("pipeline_parallel_size", 1))
    config = ServeConfig(
        model=model, artifact=artifact, cache_dir=cache_dir, host=host, port=port,
        served_model_name=served_model_name, api_key=_read_api_key(api_key_file), max_queue_len=max_queue_len,
        drain_timeout=drain_timeout, engine_kwargs=engine_kwargs, log_level=log_level, access_log=access_log,
        max_connections=max_connections, header_read_timeout=header_timeout, body_read_timeout=body_timeout,
        placement=placement,
    )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kiln.serving")
    if placement is not None and not placement.is_leader:
        from kiln.serving.worker import run_worker

        log.info("kiln serve: worker, %s; no HTTP here (the leader serves)", placement.describe())
        _exit(run_worker(config))
    if placement is not None:
        log.info("kiln serve: leader, %s", placement.describe())
    log.info("serving %s as %r on %s:%d (auth %s)", artifact or model, config.model_name, host, port,
             "on" if config.api_key else "off")

    from kiln.serving.server import run_server

    _exit(run_server(config))


def _exit(code: int) -> None:
    # The drain finished and the engine is shut down; tearing down torch's modules at
    # interpreter exit only adds seconds to every pod termination. Flush and leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
