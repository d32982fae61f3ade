"""``kiln up``: the embedded default — build a manifest into a local store if needed, then serve it.

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
from pathlib import Path

import click

from kiln import adapter_list

EXIT_INVALID_SPEC = 2


def serve_command(artifact_uri: str, engine, host: str, port: int, verify_key: Path) -> list[str]:
    serving = engine.spec.serving
    return [
        sys.executable, "-m", "kiln", "serve", "--artifact", artifact_uri, "--host", host, "--port", str(port),
        "--served-model-name", engine.metadata.name, "--max-queue-len", str(serving.max_queue_len),
        "--drain-timeout", str(serving.drain_timeout_seconds), "--verify-key", str(verify_key),
    ]


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
                   ) -> Path | None:
    """Each adapter of ``spec.lora`` built into the store as its own artifact (``kiln build-adapter``), listed
    in a file the server follows as a pod follows its ConfigMap (docs/lora.md). An adapter whose build fails
    is reported and left out; the base engine serves all the same, as on a cluster."""
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
    return adapter_list.write(Path(work_dir or tempfile.mkdtemp(prefix="kiln-up-")) / "adapters.json", entries)


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
@click.option("-f", "--file", "manifest", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="LLMEngine manifest (YAML or JSON).")
@click.option("--store", "store_uri", default=None, metavar="URI",
              help="Artifact store (default: $KILN_STORE or file://~/.cache/kiln/store).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the server binds.")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Port (default: spec.serving.port).")
@click.option("--work-dir", default=None, type=click.Path(file_okay=False), help="Build scratch directory.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging for the build.")
def up(manifest: Path, store_uri: str | None, host: str, port: int | None, work_dir: str | None,
       verbose: bool) -> None:
    """Build the manifest's engine into a local store if missing, then serve it on this machine."""
    from kiln.artifacts import default_store_uri
    from kiln.builder.cli import build_engine
    from kiln.builder.report import setup_logging, summary_lines
    from kiln.manifest import ManifestError, load_manifest
    from kiln.signing import generate_key_pair

    try:
        engine = load_manifest(manifest)
    except ManifestError as exc:
        click.echo(f"error: invalid LLMEngine manifest {manifest}:", err=True)
        for line in exc.problems:
            click.echo(f"  {line}", err=True)
        sys.exit(EXIT_INVALID_SPEC)
    setup_logging(verbose)
    store_uri = store_uri or default_store_uri()
    signing_key, verify_key = generate_key_pair(default_key_dir())
    try:
        outcome = build_engine(engine, store_uri, work_dir, signing_key=signing_key)
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was published", err=True)
        sys.exit(130)
    if outcome.exit_code:
        click.echo(f"error: {outcome.message}", err=True)
        sys.exit(outcome.exit_code)
    click.echo(outcome.message)
    if outcome.cache_hit and (problem := signature_problem(store_uri, outcome.version, verify_key)):
        click.echo(f"error: {outcome.artifact_uri}: {problem}; kiln up serves only engines signed by its local key "
                   f"({verify_key}): remove it with `kiln cache rm {outcome.version} --store {store_uri}` and run "
                   "kiln up again to rebuild it signed", err=True)
        sys.exit(EXIT_INVALID_SPEC)
    report = outcome.build_report or read_engine_json(store_uri, outcome.version).get("build_report")
    for line in summary_lines(report) if report else []:
        click.echo(line)
    adapters = build_adapters(engine, store_uri, work_dir, signing_key, outcome.version)
    port = engine.spec.serving.port if port is None else port
    click.echo(f"serving {outcome.artifact_uri} on http://{host}:{port}/v1 (Ctrl-C to stop)")
    env = {**os.environ, adapter_list.ADAPTERS_FILE_ENV: str(adapters)} if adapters is not None else None
    sys.exit(run_foreground(serve_command(outcome.artifact_uri, engine, host, port, verify_key), env))
