"""``kiln build-adapter``: build one LoRA adapter of ``spec.lora.adapters`` into the store, for the base engine
the spec builds to (docs/lora.md).

\b
Stages (the build report's names): base (the base artifact's config.json, its manifest verified against the
signing key's public half) -> fetch (the PEFT adapter) -> check (against the base and maxLoraRank) -> convert
(to the engine's dtype, PEFT layout kept) -> fetch_base (the base checkpoint) -> gate (quality) -> package
(adapter.json: provenance, gate, stage timings) -> publish as <base version>-<name>-<hash>, signed like engines.

\b
Exit codes: as `kiln build` (0 built or cache hit, 2 the adapter does not fit the engine: the message names
spec.lora.adapters[i].source, 3 storage, 4 quality gate, 5 fetch). A failed adapter build never touches
the base engine, which keeps serving.
--fetch-only / --prefetched split the work as a build Job does (credentials apart from the store's).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
from kiln.builder.adapter.source import fetch_adapter
from kiln.builder.errors import EXIT_OK, BuildError, InvalidSpec
from kiln.builder.manifest_input import check_expected_version, resolve_manifest
from kiln.builder.outcome import BuildOutcome, cached, publisher
from kiln.builder.report import BuildReport, setup_logging, write_termination_message

from kiln.adapter_list import ADAPTER_VERSION_ENV
from kiln.artifacts import STORE_ENV, STORE_ENV_ALIAS
from kiln.cache_cli import env_store
from kiln.envelope import adapter_envelope, adapter_version, engine_version

log = logging.getLogger("kiln.build.adapter")


def find_adapter(engine, name: str) -> tuple[int, Any]:
    adapters = engine.spec.lora.adapters if engine.spec.lora is not None else []
    for i, adapter in enumerate(adapters):
        if adapter.name == name:
            return i, adapter
    raise InvalidSpec(f"--adapter: no adapter named {name!r} in spec.lora.adapters "
                      f"({', '.join(a.name for a in adapters) or 'none'})")


def versions(engine, adapter) -> tuple[str, str]:
    base = engine_version(engine.spec)
    check_expected_version(base)
    version = adapter_version(base, adapter)
    expected = os.environ.get(ADAPTER_VERSION_ENV)
    if expected and expected != version:
        raise InvalidSpec(f"${ADAPTER_VERSION_ENV} is {expected} but this builder computes {version}: the operator "
                          "and builder images disagree (different kiln versions?); run matching images")
    return base, version


def build_adapter(engine, name: str, store_uri: str, work_dir: str | Path | None = None, prefetched: bool = False,
                  signing_key: str | Path | None = None) -> BuildOutcome:
    """Build adapter ``name`` of ``engine`` into ``store_uri`` unless it is there; never raises for user errors."""
    version = None
    try:
        index, adapter = find_adapter(engine, name)
        base, version = versions(engine, adapter)
        built_by, signer = publisher(signing_key)
        envelope = adapter_envelope(base, adapter)
        store, hit = cached(store_uri, version, envelope)
        if hit is not None:
            return hit
        from kiln.builder.adapter.context import AdapterContext
        from kiln.builder.adapter.pipeline import run_adapter_build  # deferred: torch, peft

        work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="kiln-adapter-"))
        ctx = AdapterContext(engine=engine, index=index, adapter=adapter, base=base, version=version,
                             envelope=envelope, store=store, work_dir=work, report=BuildReport(version),
                             built_by=built_by, signer=signer, prefetched=prefetched)
        report = run_adapter_build(ctx)
        return BuildOutcome(EXIT_OK, version, store.artifact_uri(version), message=f"built: {version}",
                            build_report=report)
    except BuildError as exc:
        return BuildOutcome(exc.exit_code, version, message=f"{exc.reason}: {exc}",
                            build_report=getattr(exc, "metrics", {}))


@click.command("build-adapter", help=__doc__.replace("``", ""))
@click.option("--adapter", "name", required=True, help="Name of the adapter in spec.lora.adapters to build.")
@click.option("-f", "--file", "manifest", default=None, help="LLMEngine manifest (YAML or JSON); '-' reads stdin.")
@click.option("--spec-file", default=None, help="Manifest file as a Job mounts it.")
@click.option("--store", "store_uri", default=env_store(), metavar="URI",
              help=f"Artifact store URI (default ${STORE_ENV} or ${STORE_ENV_ALIAS}).")
@click.option("--work-dir", envvar="KILN_WORK_DIR", default=None, help="Scratch space (default: a temp dir).")
@click.option("--fetch-only", is_flag=True, help="Only fetch the adapter and the base checkpoint into --work-dir.")
@click.option("--prefetched", is_flag=True, help="Build from what --fetch-only left in --work-dir.")
@click.option("--signing-key", envvar="KILN_SIGNING_KEY", default=None, help="PEM key that signs the manifest.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def build_adapter_command(name: str, manifest: str | None, spec_file: str | None, store_uri: str | None,
                          work_dir: str | None, fetch_only: bool, prefetched: bool, signing_key: str | None,
                          verbose: bool) -> None:
    setup_logging(verbose)
    if (fetch_only or prefetched) and not work_dir:
        raise click.UsageError("--fetch-only and --prefetched need --work-dir (or $KILN_WORK_DIR)")
    if not fetch_only and not store_uri:
        raise click.UsageError("no artifact store: pass --store file:///path or s3://bucket/prefix")
    try:
        engine = resolve_manifest(manifest, spec_file)
        if fetch_only:
            index, adapter = find_adapter(engine, name)
            outcome = BuildOutcome(EXIT_OK, message=f"fetched: {fetch_adapter(engine, index, adapter, Path(work_dir))}")
        else:
            outcome = build_adapter(engine, name, store_uri, work_dir, prefetched, signing_key)
    except BuildError as exc:
        outcome = BuildOutcome(exc.exit_code, message=f"{exc.reason}: {exc}")
    if outcome.exit_code == EXIT_OK:
        click.echo(outcome.message + (f"\nartifact: {outcome.artifact_uri}" if outcome.artifact_uri else ""))
    else:
        click.echo(f"error: {outcome.message}", err=True)
    write_termination_message(outcome.message)
    sys.exit(outcome.exit_code)
