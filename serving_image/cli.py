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
from click.core import ParameterSource
from kiln.engine.cpu_target import configure_openmp
from kiln.serving.cli_types import ChoiceOf, JSONObject, ManyValues
from kiln.serving.config import ServeConfig

from kiln.chat_options import REASONING_PARSERS
from kiln.listen import listen_problem

configure_openmp()  # before torch loads (the engine flags below import it): OpenMP threads wait passively


def _lora_modules(ctx: Any, param: Any, value: Any) -> list[dict[str, Any]]:
    from kiln.serving.lora import parse_lora_module

    try:
        return [parse_lora_module(v) for group in value or () for v in (group if isinstance(group, tuple) else (group,))]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _template_defaults(ctx: Any, param: Any, value: Any) -> dict[str, Any]:
    """The flag's variables, by the rules a manifest's defaultChatTemplateKwargs and a request's own follow."""
    from kiln.chat_options import template_kwargs_problem

    if problem := template_kwargs_problem(value or {}, "--default-chat-template-kwargs"):
        raise click.BadParameter(problem)
    return dict(value or {})


def _flag_type(setting: Any) -> Any:
    """The click type of an engine setting's flag, from its field's metadata (kiln.engine.settings.setting)."""
    meta = setting.metadata
    if meta["json"]:
        return JSONObject()
    if meta["choices"] is not None:
        return ChoiceOf(meta["choices"])
    if meta["min"] is not None:
        ranged = click.FloatRange if "float" in str(setting.type) else click.IntRange
        return ranged(meta["min"], meta["max"], min_open=meta["min_open"])
    return int if "int" in str(setting.type) else str


def engine_flags() -> list[tuple[str, str, Any]]:
    """``kiln serve``'s engine flags: (flag, LLM() keyword, the setting's field), from EngineConfig's fields,
    the one list of engine settings. Importing the engine here would pull torch into ``kiln serve --help``,
    so the fields are read lazily, once per process."""
    from kiln.engine.config import settings  # deferred: torch, only when the serve command is built

    flags = []
    for setting in settings():
        flag = setting.metadata.get("flag")
        if flag:
            flags.append((flag if isinstance(flag, str) else "--" + setting.name.replace("_", "-"),
                          setting.name, setting))
    return flags


def _engine_options(fn: Any) -> Any:
    for flag, dest, setting in reversed(engine_flags()):
        help_, envvar = setting.metadata["help"], setting.metadata["envvar"]
        if "bool" in str(setting.type):
            fn = click.option(f"{flag}/--no-{flag[2:]}", dest, default=None, help=help_)(fn)
        else:
            fn = click.option(flag, dest, type=_flag_type(setting), default=None, envvar=envvar, help=help_)(fn)
    return fn


def _read_api_key(api_key_file: Path | None) -> str | None:
    if api_key_file is not None:
        try:
            key = api_key_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.UsageError(f"--api-key-file {api_key_file}: cannot read it ({getattr(exc, 'strerror', exc)}); "
                                   "give a readable file holding the key") from None
        if not key:
            raise click.UsageError(f"--api-key-file {api_key_file} is empty; put the key in it")
        return key
    return os.environ.get("KILN_API_KEY", "").strip() or None


def _check_verify_key(verify_key: Path | None) -> None:
    """The key artifacts must be signed by, read before anything binds or loads: a missing, unreadable or malformed
    one exits 1 at once (no artifact can be loaded with it), not from a server that opened its port first."""
    if verify_key is None:
        return
    from kiln.signing import SigningError, Verifier

    try:
        Verifier.from_pem(verify_key)
    except SigningError as exc:
        raise click.ClickException(str(exc)) from None


def _pool_engines(ctx: Any, param: Any, value: Any) -> list[Any]:
    from kiln.engine_list import parse_engine_flag

    try:
        return [parse_engine_flag(v) for v in value or ()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _pool_settings(flags: dict[str, Any], model: Path | None, artifact: str | None, lora_modules: list[Any],
                   runtime_lora: bool, rank: int | None, world_size: int | None) -> Any:
    """The pool's settings when --engine or --engines-file is given (its flags taken out of ``flags``), else None
    (one engine, as before); a usage error for flags that do not go together."""
    engines, engines_file = flags.pop("pool_engines"), flags.pop("engines_file")
    max_loaded, budget, idle = flags.pop("max_loaded_engines"), flags.pop("memory_budget"), flags.pop("idle_unload_after")
    queue_size, load_timeout = flags.pop("pool_queue_size"), flags.pop("load_timeout")
    if not engines and engines_file is None:
        if (model is None) == (artifact is None):
            raise click.UsageError("give exactly one of --model DIR or --artifact URI (or --engine NAME=URI ... for "
                                   "a pool)")
        source = click.get_current_context().get_parameter_source  # these two have defaults: given, or not
        for flag, given in (("--max-loaded-engines", max_loaded is not None), ("--memory-budget", budget is not None),
                            ("--idle-unload-after", idle is not None),
                            ("--pool-queue-size", source("pool_queue_size") != ParameterSource.DEFAULT),
                            ("--load-timeout", source("load_timeout") != ParameterSource.DEFAULT)):
            if given:
                raise click.UsageError(f"{flag} sets a pool: give its engines with --engine NAME=URI or "
                                       "--engines-file PATH, or drop it")
        return None
    _check_pool_flags(model, artifact, lora_modules, runtime_lora, rank, world_size)
    from kiln.serving.pool.settings import PoolSettings

    from kiln.engine_list import unique
    from kiln.memory_budget import parse_quantity

    try:
        return PoolSettings(engines=unique(engines, "--engine"), engines_file=engines_file,
                            max_loaded_engines=max_loaded, idle_unload_after=idle, queue_size=queue_size,
                            memory_budget=parse_quantity(budget) if budget is not None else None,
                            load_timeout=load_timeout)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _check_pool_flags(model: Path | None, artifact: str | None, lora_modules: list[Any], runtime_lora: bool,
                      rank: int | None, world_size: int | None) -> None:
    """What a pool does not take (yet): say which flag, and what to do instead."""
    for flag, given in (("--model", model is not None), ("--artifact", artifact is not None),
                        ("--lora-modules", bool(lora_modules)), ("--allow-runtime-lora-updating", runtime_lora),
                        ("--rank/--world-size", rank is not None or world_size is not None)):
        if given:
            raise click.UsageError(f"{flag} is not taken with --engine/--engines-file (a pool): serve the engine "
                                   "as a pool member (--engine NAME=URI), its adapters through the adapter list "
                                   "(docs/pools.md), or drop the flag")

@click.command("serve")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A Hugging Face checkpoint directory to serve.")
@click.option(
    "--artifact", help="An engine artifact URI (<store>/engines/<version>) to fetch, verify and serve."
)
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), envvar="KILN_CACHE_DIR",
              help="Where artifacts are fetched to [env KILN_CACHE_DIR; default: ~/.cache/kiln/engines].")
@click.option("--verify-key", type=click.Path(dir_okay=False, path_type=Path), envvar="KILN_VERIFY_KEY",
              help="PEM public key the artifact must be signed by; checked before any file is fetched, and "
                   "only then is native code it ships loaded [env KILN_VERIFY_KEY] (docs/operator-trust.md).")
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
@click.option("--lora-modules", "lora_modules", cls=ManyValues, multiple=True, type=click.UNPROCESSED,
              callback=_lora_modules, metavar="NAME=PATH ...",
              help="LoRA adapters to serve, as vLLM: NAME=PATH [NAME=PATH ...] or JSON '{\"name\": ..., \"path\": "
                   "..., \"base_model_name\": ...}'; requests pick one with \"model\": NAME (needs --enable-lora).")
@click.option("--allow-runtime-lora-updating", is_flag=True, default=False,
              help="Offer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                   "KILN_ALLOW_RUNTIME_LORA_UPDATING=1); off, they are 404.")
@click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default=None, envvar="KILN_REASONING_PARSER",
              help="Keep a thinking model's <think>...</think> apart from its answer (vLLM's names): reasoning_content "
                   "in chat, thinking blocks in Messages, reasoning items in Responses [env KILN_REASONING_PARSER].")
@click.option("--default-chat-template-kwargs", type=JSONObject(), callback=_template_defaults,
              envvar="KILN_DEFAULT_CHAT_TEMPLATE_KWARGS", metavar="JSON",
              help="Chat template variables every chat request gets, under its own chat_template_kwargs, as vLLM's "
                   "flag: '{\"enable_thinking\": false}' [env KILN_DEFAULT_CHAT_TEMPLATE_KWARGS].")
@click.option("--responses-store-size", type=click.IntRange(min=0), default=1000, show_default=True,
              envvar="KILN_RESPONSES_STORE_SIZE",
              help="Responses kept for previous_response_id and GET /v1/responses/{id}, per process; 0 keeps none "
                   "[env KILN_RESPONSES_STORE_SIZE].")
@click.option("--responses-store-ttl", type=click.FloatRange(min=0, min_open=True), default=3600.0, show_default=True,
              envvar="KILN_RESPONSES_STORE_TTL", help="Seconds a stored response is kept [env KILN_RESPONSES_STORE_TTL].")
@click.option("--engine", "pool_engines", multiple=True, metavar="NAME=ARTIFACT_URI", callback=_pool_engines,
              help="Serve several engines from one process, each loaded on its first request (\"model\": NAME); "
                   "repeat it (docs/pools.md). Not with --model/--artifact.")
@click.option("--engines-file", type=click.Path(dir_okay=False, path_type=Path), envvar="KILN_ENGINES_FILE",
              help="A file listing the pool's engines ({\"format\": 1, \"engines\": [{\"name\", \"artifactURI\"}]}), "
                   "re-read while serving: engines join and leave without a restart [env KILN_ENGINES_FILE].")
@click.option("--max-loaded-engines", type=click.IntRange(min=1), default=None,
              help="A pool's engines loaded at once at most; the least recently used idle one makes room.")
@click.option("--memory-budget", default=None, metavar="QUANTITY",
              help="Memory a pool's loaded engines may count, as Kubernetes writes it (6Gi) [default: the cgroup "
                   "memory limit, else the host's memory, less a margin].")
@click.option("--idle-unload-after", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Unload a pool's engine after this many seconds without a request [default: never].")
@click.option("--pool-queue-size", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a pool's engine to be placed; past it they get 503 with Retry-After.")
@click.option("--load-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds a request waits for its pool engine to be placed and loaded before a 503.")
@_engine_options
def serve(model: Path | None, artifact: str | None, cache_dir: Path | None, verify_key: Path | None, host: str,
          port: int,
          served_model_name: str | None, api_key_file: Path | None, max_queue_len: int, drain_timeout: float,
          max_connections: int, header_timeout: float, body_timeout: float, log_level: str, access_log: bool,
          rank: int | None, world_size: int | None, leader_address: str | None, leader_port: int,
          lora_modules: list[dict[str, Any]], allow_runtime_lora_updating: bool, reasoning_parser: str | None,
          default_chat_template_kwargs: dict[str, Any], responses_store_size: int, responses_store_ttl: float,
          **engine: Any) -> None:
    """Serve a model directory or engine artifact over an OpenAI-compatible API.

    The port opens at once; /health answers 200 and /ready 503 until the engine
    is loaded and warmed up. SIGTERM drains in-flight requests, then exits 0.
    With ranks started separately (--rank/--world-size/--leader-address, or a
    LeaderWorkerSet's LWS_* environment), rank 0 serves and the others only compute.
    """
    pool = _pool_settings(engine, model, artifact, lora_modules, allow_runtime_lora_updating, rank, world_size)
    served_model_name = served_model_name or ("kiln-pool" if pool is not None else None)
    if verify_key is not None and model is not None:
        raise click.UsageError("--verify-key checks a signed engine artifact; --model DIR is served as it is: "
                               "serve an --artifact URI, or drop --verify-key")
    _check_verify_key(verify_key)
    engine_kwargs = {k: v for k, v in engine.items() if v is not None}
    if lora_modules and not engine_kwargs.get("enable_lora"):
        raise click.UsageError("--lora-modules serves LoRA adapters: add --enable-lora")
    # The rank timeouts reach a separately started rank through its placement, else the engine directly.
    distributed_timeout, join_timeout = engine.get("distributed_timeout_s"), engine.get("join_timeout_s")
    from kiln.serving.ranks import resolve_placement

    placement = None if pool is not None else resolve_placement(
        rank, world_size, leader_address, leader_port, os.environ, distributed_timeout, join_timeout)
    if placement is not None:
        engine_kwargs.pop("distributed_timeout_s", None)
        engine_kwargs.pop("join_timeout_s", None)
    if placement is not None and model is not None:  # the sizes are the flags': check the placement now
        placement.engine_kwargs(engine_kwargs.get("tensor_parallel_size", 1),
                                engine_kwargs.get("pipeline_parallel_size", 1))
    config = ServeConfig(
        model=model, artifact=artifact, cache_dir=cache_dir, verify_key=verify_key, host=host, port=port,
        served_model_name=served_model_name, api_key=_read_api_key(api_key_file), max_queue_len=max_queue_len,
        drain_timeout=drain_timeout, engine_kwargs=engine_kwargs, log_level=log_level, access_log=access_log,
        max_connections=max_connections, header_read_timeout=header_timeout, body_read_timeout=body_timeout,
        placement=placement, lora_modules=lora_modules, allow_runtime_lora_updating=allow_runtime_lora_updating,
        reasoning_parser=reasoning_parser, responses_store_size=responses_store_size,
        responses_store_ttl=responses_store_ttl, default_chat_template_kwargs=default_chat_template_kwargs,
    )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _run(config, pool)


def _run(config: ServeConfig, pool: Any) -> None:
    """Serve ``config``: rank 0 (or a lone server) over HTTP, another rank computing only; exits with its code."""
    log, placement = logging.getLogger("kiln.serving"), config.placement
    if (placement is None or placement.is_leader) and (problem := listen_problem(config.host, config.port)):
        raise click.UsageError(problem)  # before the model loads: a busy port costs a second, not the load
    if placement is not None and not placement.is_leader:
        from kiln.serving.worker import run_worker

        log.info("kiln serve: worker, %s; no HTTP here (the leader serves)", placement.describe())
        _exit(run_worker(config))
    if placement is not None:
        log.info("kiln serve: leader, %s", placement.describe())
    log.info("serving %s as %r on %s:%d (auth %s)", config.artifact or config.model or "a pool", config.model_name,
             config.host, config.port, "on" if config.api_key else "off")

    from kiln.serving.server import run_server

    _exit(run_server(config) if pool is None else run_server(config, pool))


def _exit(code: int) -> None:
    # The drain finished and the engine is shut down; tearing down torch's modules at
    # interpreter exit only adds seconds to every pod termination. Flush and leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
