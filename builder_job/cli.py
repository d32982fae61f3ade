"""``kiln build``: compile an LLMEngine manifest into a published engine artifact.

\b
Exit codes:
  0  built and published, or already in the store ("cache hit: <version>")
  1  unexpected error (a bug; the traceback is in the log)
  2  invalid spec or envelope (bad manifest; the spec cannot work for this model/GPU)
  3  storage error (store unreachable, no credentials, conflicting publish; as `kiln cache`)
  4  quality gate failed (converted model too far from the source; nothing published)
  5  fetch error (source missing/unreachable, no safetensors weights)

On failure the one-line reason also goes to the termination message file
($KILN_TERMINATION_LOG, default /dev/termination-log) for the operator.
The cache-hit path imports neither torch nor transformers, so it answers in seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import click
from kiln.builder.errors import EXIT_OK, EXIT_UNEXPECTED, BuildError, InvalidSpec, StorageFailure
from kiln.builder.report import BuildReport, setup_logging, write_termination_message
from kiln.builder.spec import check_expected_version, resolve_manifest

log = logging.getLogger("kiln.build")
WORK_DIR_ENV = "KILN_WORK_DIR"
STORE_ENV = "KILN_STORE_URI"


@dataclass
class BuildOutcome:
    exit_code: int
    version: str | None = None
    artifact_uri: str | None = None
    cache_hit: bool = False
    message: str = ""
    build_report: dict = field(default_factory=dict)


def build_engine(engine, store_uri: str, work_dir: str | Path | None = None, keep_work_dir: bool = False
                 ) -> BuildOutcome:
    """Build ``engine`` (an ``LLMEngine``) into ``store_uri`` unless it is there; never raises for user errors."""
    from kiln.artifacts import ArtifactStore, StoreError
    from kiln.envelope import build_envelope, engine_version

    version = None
    try:
        version = engine_version(engine.spec)
        check_expected_version(version)
        try:
            store = ArtifactStore.from_uri(store_uri)
            hit = store.exists(version)
        except StoreError as exc:
            raise StorageFailure(str(exc)) from None
        if hit:
            uri = store.artifact_uri(version)
            return BuildOutcome(EXIT_OK, version, uri, cache_hit=True, message=f"cache hit: {version}")
        made_tmp = work_dir is None
        work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="kiln-build-"))
        work.mkdir(parents=True, exist_ok=True)
        report = BuildReport(version)
        log.info("building %s (%s -> %s)", version, engine.spec.model.source, store.uri)
        try:
            from kiln.builder.pipeline import run_build

            result = run_build(engine, store, version, build_envelope(engine.spec), work, report)
        finally:
            if made_tmp and not keep_work_dir:
                shutil.rmtree(work, ignore_errors=True)
            elif not keep_work_dir:
                shutil.rmtree(work / f"engine-{version}", ignore_errors=True)
        return BuildOutcome(EXIT_OK, version, result.artifact_uri, message=f"built: {version}",
                            build_report=result.engine_json["build_report"])
    except BuildError as exc:
        return BuildOutcome(exc.exit_code, version, message=f"{exc.reason}: {exc}",
                            build_report=getattr(exc, "metrics", {}))
    except Exception:  # a bug: keep the traceback in the log, one line for the operator
        log.error("unexpected error:\n%s", traceback.format_exc())
        exc_type, exc_value = sys.exc_info()[:2]
        return BuildOutcome(EXIT_UNEXPECTED, version,
                            message=f"BuildFailed: unexpected {exc_type.__name__}: {exc_value} (see the build log)")


@click.command("build", help=__doc__.replace("``", ""))
@click.option("-f", "--file", "manifest", metavar="MANIFEST", default=None,
              help="LLMEngine manifest (YAML or JSON); '-' reads stdin.")
@click.option("--spec-file", default=None, metavar="FILE", help="Manifest file as a Job mounts it.")
@click.option("--store", "store_uri", envvar=STORE_ENV, required=True, metavar="URI",
              help=f"Artifact store: file:///path or s3://bucket/prefix (default ${STORE_ENV}).")
@click.option("--work-dir", envvar=WORK_DIR_ENV, default=None, type=click.Path(file_okay=False),
              help=f"Scratch space for the download and the package (default ${WORK_DIR_ENV} or a temp dir).")
@click.option("--keep-work-dir", is_flag=True, help="Keep the staged engine directory after publishing.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def build(manifest: str | None, spec_file: str | None, store_uri: str, work_dir: str | None,
          keep_work_dir: bool, verbose: bool) -> None:
    setup_logging(verbose)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        engine = resolve_manifest(manifest, spec_file)
    except InvalidSpec as exc:
        outcome = BuildOutcome(exc.exit_code, message=f"{exc.reason}: {exc}")
    else:
        outcome = build_engine(engine, store_uri, work_dir, keep_work_dir)
    if outcome.exit_code == EXIT_OK:
        click.echo(outcome.message)
        click.echo(f"artifact: {outcome.artifact_uri}")
    else:
        click.echo(f"error: {outcome.message}", err=True)
        if outcome.build_report:
            click.echo("report: " + json.dumps(outcome.build_report, indent=2, default=str), err=True)
    write_termination_message(outcome.message if outcome.exit_code else f"{outcome.message} ({outcome.artifact_uri})")
    sys.exit(outcome.exit_code)
