"""``kiln up``: the embedded default — build a manifest into a local store if needed, then serve it.

Several manifests (``-f a.yaml -f b.yaml``), or one ``kind: LLMEnginePool`` manifest listing them (the cluster's
type, :mod:`kiln.pool_api`, with ``spec.engines``), are each built the same way and served together by one
``kiln serve --engine NAME=URI ...`` with the pool's settings as flags: an engine pool (docs/pools.md).

No Kubernetes: the same builder a build Job runs (in this process), then
``kiln serve --artifact <uri>`` as a child process in the foreground. The engine is signed and verified
as on a cluster, with a local key pair made on first use (``~/.cache/kiln/keys``, or ``$KILN_KEY_DIR``):
the build signs with its private key and the server is started with ``--verify-key``. The server
runs as a subprocess so this module (core CLI glue) never imports the serving
component; SIGINT/SIGTERM are forwarded to it so it drains and exits cleanly,
and ``kiln up`` exits with its code. Exit codes before serving are the
builder's (``kiln build --help``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kiln import adapter_list
from kiln.artifact_manifest import rm_hint
from kiln.artifacts import default_store_uri
from kiln.cache_cli import env_store
from kiln.listen import listen_problem
from kiln.pool_api import POOL_KIND, LLMEnginePool, serve_flags

EXIT_INVALID_SPEC = 2


def serve_command(artifact_uri: str, engine, host: str, port: int, verify_key: Path) -> list[str]:
    serving = engine.spec.serving
    return [
        sys.executable, "-m", "kiln", "serve", "--artifact", artifact_uri, "--host", host, "--port", str(port),
        "--served-model-name", engine.metadata.name, "--max-queue-len", str(serving.max_queue_len),
        "--drain-timeout", str(serving.drain_timeout_seconds), "--verify-key", str(verify_key), *serving.serve_flags(),
    ]


@dataclass
class PoolManifest:
    """``kind: LLMEnginePool`` for ``kiln up``: the pool (:class:`kiln.pool_api.LLMEnginePool`, the cluster's type)
    and the LLMEngine manifests its ``spec.engines`` names, as paths relative to it."""

    pool: LLMEnginePool
    engines: list[Path]

    @property
    def name(self) -> str:
        return self.pool.metadata.name

    @property
    def port(self) -> int:
        return self.pool.spec.port

    @property
    def flags(self) -> list[str]:
        """The ``kiln serve`` flags of the pool's settings (the cluster's pods get the same ones)."""
        return [*serve_flags(self.pool.spec), "--drain-timeout", str(self.pool.spec.drain_timeout_seconds)]


def read_pool(path: Path, doc: dict) -> PoolManifest:
    """A pool manifest (``doc``: its document, as read); ManifestError naming each field and its fix."""
    from kiln.manifest import ManifestError, load_pool

    pool, problems = None, []
    try:
        pool = load_pool(doc)
    except ManifestError as exc:
        problems = exc.problems
    spec = doc.get("spec")
    engines = spec.get("engines") if isinstance(spec, dict) else None
    engines = engines if isinstance(engines, list) and all(isinstance(e, str) for e in engines) else None
    if not (engines and all(engines)) and not any(line.startswith("spec.engines") for line in problems):
        problems = [*problems, "spec.engines: list the LLMEngine manifests to serve, as paths relative to this file"]
    if problems or pool is None:
        raise ManifestError(problems, f"{POOL_KIND} manifest {path}")
    return PoolManifest(pool, [path.parent / e for e in engines])


def read_manifests(paths: tuple[Path, ...]) -> tuple[list, PoolManifest | None]:
    """The LLMEngines to serve and the pool manifest among ``paths`` (at most one); ManifestError otherwise."""
    from kiln.manifest import ManifestError, load_manifest, read_documents

    engines, origins, pool = [], [], None
    for path in paths:
        try:
            docs = read_documents(path)[0]  # as kiln plan reads it: a key given twice is refused
        except ManifestError:
            docs = []  # load_manifest says what is wrong with it
        doc = docs[0] if len(docs) == 1 else None
        if isinstance(doc, dict) and doc.get("kind") == POOL_KIND:
            if pool is not None:
                raise ManifestError(f"kind: {POOL_KIND}: give one pool manifest, not two",
                                    f"{POOL_KIND} manifest {path}")
            pool = read_pool(path, doc)
            engines += [load_manifest(p) for p in pool.engines]
            origins += [str(p) for p in pool.engines]
        else:
            engines.append(load_manifest(path))
            origins.append(str(path))
    seen: set[str] = set()
    for engine in engines:
        if engine.metadata.name in seen:
            raise ManifestError(f"metadata.name: {engine.metadata.name!r} is served twice; clients pick an engine "
                                "by this name, so give each its own", engine.metadata.name)
        seen.add(engine.metadata.name)
    check_adapter_names(engines, origins)
    check_one_process(engines, pool, origins)
    return engines, pool


def check_adapter_names(engines: list, origins: list[str]) -> None:
    """One server answers every engine's and adapter's name (``model``): an adapter named as an engine, or one
    name on two engines for two adapters, would be unreachable or ambiguous. The rule is the operator's
    (:func:`kiln.pool_api.adapter_name_clashes`, which leaves such a pool member's adapter out); here it is refused."""
    from kiln.envelope import adapter_version, engine_version
    from kiln.manifest import ManifestError
    from kiln.pool_api import adapter_name_clashes

    where, rows = {}, []
    for engine, origin in zip(engines, origins, strict=True):
        base = engine_version(engine.spec)
        for i, adapter in enumerate(engine.spec.lora.adapters if engine.spec.lora is not None else ()):
            where[(engine.metadata.name, adapter.name)] = (i, origin)
            rows.append((engine.metadata.name, adapter.name, adapter_version(base, adapter)))
    for (engine, name), (kind, other) in adapter_name_clashes((e.metadata.name for e in engines), rows).items():
        i, origin = where[(engine, name)]
        what = "an engine" if kind == "engine" else f"an adapter of engine {other!r}"
        raise ManifestError(f"spec.lora.adapters[{i}].name: {name!r} is also {what} served here, and a request "
                            "names either by it; rename one of them", origin)


def check_one_process(engines: list, pool: PoolManifest | None, origins: list[str]) -> None:
    """Several engines are served by one ``kiln serve``, which runs them all with one ``--batch-invariant`` and one
    set of chat settings (``ServingOptions.process_wide``): the pool manifest's, else the engines' when they agree.
    A pool manifest's member is refused what the operator refuses a pool's member
    (:func:`kiln.pool_api.member_problem`: its own key, batchInvariant, chat settings, autoscaling...)."""
    from kiln.manifest import ManifestError
    from kiln.pool_api import member_problem

    if pool is not None:
        by = f"the pool manifest {pool.name!r} (in a cluster, that LLMEnginePool)"
        for engine, origin in zip(engines, origins, strict=True):  # every engine: one process serves them all
            if problem := member_problem(engine.spec, by, "serve it outside the pool (`kiln up -f` its manifest)"):
                raise ManifestError(problem, origin)
    if pool is None:
        settings = {e.metadata.name: dict(e.spec.serving.process_wide()) for e in engines}
        for field in settings[engines[0].metadata.name]:
            if problem := _disagreement(field, {name: asked[field] for name, asked in settings.items()}):
                raise ManifestError(problem, ", ".join(origins))


def _disagreement(field: str, asked: dict[str, Any]) -> str | None:
    """``spec.serving.<field>: what + fix`` where engines served by one process ask for different values of a
    setting that process takes for all of them (``ServingOptions.process_wide``), else None."""
    if len({json.dumps(v, sort_keys=True) for v in asked.values()}) < 2:
        return None
    if all(isinstance(v, bool) for v in asked.values()):
        names = [repr(n) for n, v in asked.items() if v]
        said = f"{', '.join(names)} {'asks' if len(names) == 1 else 'ask'} for it and the other engines do not"
    else:
        said = "the engines ask for different values (" + ", ".join(
            f"{n!r}: {'unset' if v is None else json.dumps(v, sort_keys=True)}" for n, v in asked.items()) + ")"
    return (f"spec.serving.{field}: {said}, but one process serves them all with one setting; make them agree, or "
            f"serve them from a pool manifest with spec.{field}")


def pool_serve_command(built: list, pool: PoolManifest | None, host: str, port: int, verify_key: Path) -> list[str]:
    """``kiln serve`` for several engines (``built``: (LLMEngine, artifact URI) pairs) as one pool: the pool
    manifest's settings, else the first engine's queue and drain settings."""
    serving = built[0][0].spec.serving
    cmd = [sys.executable, "-m", "kiln", "serve", "--host", host, "--port", str(port), "--served-model-name",
           pool.name if pool is not None else "kiln-up-pool", "--verify-key", str(verify_key)]
    for engine, uri in built:
        cmd += ["--engine", f"{engine.metadata.name}={uri}"]
    return cmd + (pool.flags if pool is not None else ["--max-queue-len", str(serving.max_queue_len),
                                                       "--drain-timeout", str(serving.drain_timeout_seconds),
                                                       *serving.serve_flags()])


def default_key_dir() -> Path:
    """Where ``kiln up`` keeps its local signing pair: ``$KILN_KEY_DIR``, else ``~/.cache/kiln/keys``."""
    if path := os.environ.get("KILN_KEY_DIR", "").strip():
        return Path(path)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln" / "keys"


def signature_problem(store_uri: str, version: str, verify_key: Path) -> str | None:
    """Why the stored ``version`` would be refused by a server verifying with ``verify_key`` (None: it won't)."""
    from kiln.artifacts import ArtifactStore
    from kiln.signing import Verifier

    _, document = ArtifactStore.from_uri(store_uri).read_signed_manifest(version)
    return Verifier.from_pem(verify_key).problem(document or {})


def read_engine_json(store_uri: str, version: str) -> dict:
    """The published artifact's ``engine.json`` ({} when it cannot be read; the server will say why)."""
    from kiln.artifact_manifest import StoreError
    from kiln.artifacts import ArtifactStore

    try:
        data = ArtifactStore.from_uri(store_uri).backend.read(f"engines/{version}/engine.json")
        return json.loads(data) if data else {}
    except (StoreError, ValueError):
        return {}


def build_adapters(engine, store_uri: str, work_dir: str | None, signing_key: Path, base_version: str
                   ) -> list[dict[str, str]] | None:
    """Each adapter of ``spec.lora`` built into the store as its own artifact (``kiln build-adapter``): the
    adapter list's entries for them (None: the spec has none). An adapter whose build fails is reported and left
    out; the base engine serves all the same, as on a cluster."""
    lora = engine.spec.lora
    if lora is None or not lora.adapters:
        return None
    from kiln.builder.adapter.command import build_adapter

    entries = []
    for adapter in lora.adapters:
        outcome = build_adapter(engine, adapter.name, store_uri, work_dir, signing_key=signing_key)
        if outcome.exit_code:
            click.echo(f"error: adapter {adapter.name!r} is not served: {outcome.message}", err=True)
            continue
        click.echo(f"adapter {adapter.name}: {outcome.message}")
        entries.append(adapter_list.entry(adapter.name, outcome.artifact_uri, outcome.version, base_version))
    return entries


def write_adapter_list(entries: list[dict[str, str]] | None, work_dir: str | None) -> dict[str, str] | None:
    """The server's environment naming the adapter list it follows as a pod follows its ConfigMap (docs/lora.md);
    one list for every engine served (each entry names its base engine's version). None: no adapters."""
    if entries is None:
        return None
    path = adapter_list.write(Path(work_dir or tempfile.mkdtemp(prefix="kiln-up-")) / "adapters.json", entries)
    return {**os.environ, adapter_list.ADAPTERS_FILE_ENV: str(path)}


def run_foreground(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``cmd``, forwarding SIGINT/SIGTERM to it, and return its exit code."""
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # SIGINT arrived before our handler took over; keep waiting
                forward(signal.SIGINT, None)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@click.command("up")
@click.option("-f", "--file", "manifests", required=True, multiple=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="LLMEngine manifest (YAML or JSON); repeat it, or give an LLMEnginePool manifest, to serve several "
                   "engines from one process (docs/pools.md).")
@click.option("--store", "store_uri", default=env_store(default_store_uri), metavar="URI",
              help="Artifact store (default: $KILN_STORE_URI or $KILN_STORE, else file://~/.cache/kiln/store).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the server binds.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Port (default: spec.serving.port).")
@click.option("--work-dir", default=None, type=click.Path(file_okay=False), help="Build scratch directory.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging for the build.")
def up(manifests: tuple[Path, ...], store_uri: str | None, host: str, port: int | None, work_dir: str | None,
       verbose: bool) -> None:
    """Build the manifests' engines into a local store if missing, then serve them on this machine."""
    from kiln.builder.report import setup_logging
    from kiln.manifest import ManifestError
    from kiln.signing import generate_key_pair

    try:
        engines, pool = read_manifests(manifests)
    except ManifestError as exc:
        what = exc.origin if exc.origin.startswith(POOL_KIND) else f"LLMEngine manifest {exc.origin}"
        click.echo(f"error: invalid {what}:", err=True)
        for line in exc.problems:
            click.echo(f"  {line}", err=True)
        sys.exit(EXIT_INVALID_SPEC)
    port = port if port is not None else pool.port if pool is not None else engines[0].spec.serving.port
    if problem := listen_problem(host, port):  # before a build of minutes, not after it
        click.echo(f"error: {problem}", err=True)
        sys.exit(EXIT_INVALID_SPEC)
    setup_logging(verbose)
    signing_key, verify_key = generate_key_pair(default_key_dir())
    built, adapters = [], None
    for engine in engines:
        outcome, entries = build_one(engine, store_uri, work_dir, signing_key, verify_key)
        built.append((engine, outcome.artifact_uri))
        if entries is not None:
            adapters = (adapters or []) + entries
    env = write_adapter_list(adapters, work_dir)
    if pool is None and len(built) == 1:
        click.echo(f"serving {built[0][1]} on http://{host}:{port}/v1 (Ctrl-C to stop)")
        sys.exit(run_foreground(serve_command(built[0][1], built[0][0], host, port, verify_key), env))
    click.echo(f"serving {len(built)} engines ({', '.join(e.metadata.name for e, _ in built)}) as one pool on "
               f"http://{host}:{port}/v1 (Ctrl-C to stop)")
    sys.exit(run_foreground(pool_serve_command(built, pool, host, port, verify_key), env))


def build_one(engine, store_uri: str, work_dir: str | None, signing_key: Path, verify_key: Path):
    """Build (or find) one engine and its adapters; exits with the builder's code when it cannot be served."""
    from kiln.builder.cli import build_engine
    from kiln.builder.report import summary_lines

    try:
        outcome = build_engine(engine, store_uri, work_dir, signing_key=signing_key)
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was published", err=True)
        sys.exit(130)
    if outcome.exit_code:
        click.echo(f"error: {engine.metadata.name}: {outcome.message}", err=True)
        sys.exit(outcome.exit_code)
    click.echo(outcome.message)
    if outcome.cache_hit and (problem := signature_problem(store_uri, outcome.version, verify_key)):
        click.echo(f"error: {outcome.artifact_uri}: {problem}; kiln up serves only engines signed by its local key "
                   f"({verify_key}): remove it with {rm_hint(store_uri, outcome.version)} and run "
                   "kiln up again to rebuild it signed", err=True)
        sys.exit(EXIT_INVALID_SPEC)
    report = outcome.build_report or read_engine_json(store_uri, outcome.version).get("build_report")
    for line in summary_lines(report) if report else []:
        click.echo(line)
    return outcome, build_adapters(engine, store_uri, work_dir, signing_key, outcome.version)
