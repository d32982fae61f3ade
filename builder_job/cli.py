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

\b
Two steps, for a build Job (model and store credentials in separate containers):
  --fetch-only   fetch the checkpoint into --work-dir and stop (needs no store)
  --prefetched   build from what --fetch-only left in --work-dir (never fetches)
$KILN_BUILT_BY (set by the operator) is recorded in the artifact's manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import click
from kiln.builder.errors import EXIT_OK, EXIT_UNEXPECTED, BuildError, InvalidSpec
from kiln.builder.manifest_input import check_expected_version, resolve_manifest
from kiln.builder.outcome import BuildOutcome, cached, publisher
from kiln.builder.prefetch import fetch_only, load_fetched, load_fetched_draft
from kiln.builder.report import BuildReport, setup_logging, write_termination_message

from kiln.artifacts import STORE_ENV, STORE_ENV_ALIAS
from kiln.cache_cli import env_store
from kiln.envelope import build_envelope, engine_version

log = logging.getLogger("kiln.build")
WORK_DIR_ENV = "KILN_WORK_DIR"


def fetch_engine(engine, work_dir: str | Path) -> BuildOutcome:
    """``--fetch-only``: fetch ``engine``'s checkpoint into ``work_dir``; never raises for user errors."""
    version = None
    try:
        version = engine_version(engine.spec)
        check_expected_version(version)
        work = Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
        ckpt = fetch_only(engine, work)
        return BuildOutcome(EXIT_OK, version, message=f"fetched: {engine.spec.model.source} -> {ckpt.path} "
                                                      f"({len(ckpt.files)} files) for {version}")
    except BuildError as exc:
        return BuildOutcome(exc.exit_code, version, message=f"{exc.reason}: {exc}")
    except Exception:  # a bug: keep the traceback in the log, one line for the operator
        log.error("unexpected error:\n%s", traceback.format_exc())
        exc_type, exc_value = sys.exc_info()[:2]
        return BuildOutcome(EXIT_UNEXPECTED, version,
                            message=f"FetchFailed: unexpected {exc_type.__name__}: {exc_value} (see the log)")


def build_engine(engine, store_uri: str, work_dir: str | Path | None = None, keep_work_dir: bool = False,
                 prefetched: bool = False, signing_key: str | Path | None = None) -> BuildOutcome:
    """Build ``engine`` (an ``LLMEngine``) into ``store_uri`` unless it is there; never raises for user errors.

    ``prefetched``: build from the checkpoint ``fetch_engine`` left in ``work_dir`` instead of fetching.
    ``signing_key``: the PEM private key the published manifest is signed with (else ``$KILN_SIGNING_KEY``).
    """
    version = None
    try:
        version = engine_version(engine.spec)
        check_expected_version(version)
        built_by, signer = publisher(signing_key)
        checkpoint = draft_checkpoint = None
        if prefetched:
            if work_dir is None:
                raise InvalidSpec(f"--prefetched needs --work-dir (or ${WORK_DIR_ENV}): the directory "
                                  "`kiln build --fetch-only` fetched into")
            checkpoint = load_fetched(engine, Path(work_dir))
            draft_checkpoint = load_fetched_draft(engine, Path(work_dir))
        store, hit = cached(store_uri, version, build_envelope(engine.spec))
        if hit is not None:
            return hit
        made_tmp = work_dir is None
        work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="kiln-build-"))
        work.mkdir(parents=True, exist_ok=True)
        report = BuildReport(version)
        log.info("building %s (%s -> %s)", version, engine.spec.model.source, store.uri)
        try:
            from kiln.builder.pipeline import (
                run_build,  # deferred: torch; the cache-hit path above is torch-free
            )

            result = run_build(engine, store, version, build_envelope(engine.spec), work, report,
                               checkpoint=checkpoint, built_by=built_by, draft_checkpoint=draft_checkpoint,
                               signer=signer)
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
@click.option("--store", "store_uri", default=env_store(), metavar="URI",
              help=f"Artifact store: file:///path or s3://bucket/prefix (default ${STORE_ENV} or ${STORE_ENV_ALIAS}); "
                   "required unless --fetch-only.")
@click.option("--work-dir", envvar=WORK_DIR_ENV, default=None, type=click.Path(file_okay=False),
              help=f"Scratch space for the download and the package (default ${WORK_DIR_ENV} or a temp dir).")
@click.option("--keep-work-dir", is_flag=True, help="Keep the staged engine directory after publishing.")
@click.option("--fetch-only", is_flag=True,
              help="Only fetch the checkpoint into --work-dir (with the model's credentials, no store's).")
@click.option("--prefetched", is_flag=True,
              help="Build from the checkpoint --fetch-only left in --work-dir (with the store's credentials only).")
@click.option("--signing-key", envvar="KILN_SIGNING_KEY", default=None, metavar="PEM",
              help="PEM private key (Ed25519 or ECDSA P-256, as `openssl genpkey` writes it) that signs the "
                   "published manifest [env KILN_SIGNING_KEY]; serving pods verify it (docs/operator-trust.md).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def build(manifest: str | None, spec_file: str | None, store_uri: str | None, work_dir: str | None,
          keep_work_dir: bool, fetch_only: bool, prefetched: bool, signing_key: str | None, verbose: bool) -> None:
    setup_logging(verbose)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if fetch_only and prefetched:
        raise click.UsageError("--fetch-only and --prefetched are the two halves of one build; pass one")
    if fetch_only and not work_dir:
        raise click.UsageError(f"--fetch-only needs --work-dir (or ${WORK_DIR_ENV}): the directory the "
                               "--prefetched build reads")
    if not fetch_only and not store_uri:
        raise click.UsageError(f"no artifact store: pass --store file:///path or s3://bucket/prefix "
                               f"(or set ${STORE_ENV})")
    try:
        engine = resolve_manifest(manifest, spec_file)
    except InvalidSpec as exc:
        outcome = BuildOutcome(exc.exit_code, message=f"{exc.reason}: {exc}")
    else:
        if fetch_only:
            outcome = fetch_engine(engine, work_dir)
        else:
            outcome = build_engine(engine, store_uri, work_dir, keep_work_dir, prefetched=prefetched,
                                   signing_key=signing_key)
    if outcome.exit_code == EXIT_OK:
        click.echo(outcome.message)
        if not fetch_only:
            click.echo(f"artifact: {outcome.artifact_uri}")
    else:
        click.echo(f"error: {outcome.message}", err=True)
        if outcome.build_report:
            click.echo("report: " + json.dumps(outcome.build_report, indent=2, default=str), err=True)
    ok_message = outcome.message if fetch_only else f"{outcome.message} ({outcome.artifact_uri})"
    write_termination_message(outcome.message if outcome.exit_code else ok_message)
    sys.exit(outcome.exit_code)
