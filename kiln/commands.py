"""``kiln crd`` and ``kiln plan``: the API's two commands, usable without a cluster or torch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import yaml

from kiln.manifest import ManifestError, load_manifest

EXIT_INVALID_SPEC = 2


@click.command()
@click.option("--kind", type=click.Choice(["LLMEngine", "LLMEnginePool"]), default="LLMEngine", show_default=True,
              help="Which CRD: the engine's or the pool's (docs/pools.md).")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the CRD to this file instead of stdout.")
def crd(kind: str, out: Path | None) -> None:
    """Print or write a CRD generated from the API types (`make crds` writes both to crds/)."""
    from kiln.crd import CRDS

    text = CRDS[kind][1]()
    if out is None:
        click.echo(text, nl=False)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    click.echo(f"wrote {out}", err=True)


@click.command()
@click.option("-f", "--file", "manifest", required=True, metavar="MANIFEST",
              help="LLMEngine manifest (YAML or JSON); '-' reads stdin.")
@click.option("--json", "as_json", is_flag=True, help="Print {engineVersion, digest, envelope} as JSON.")
def plan(manifest: str, as_json: bool) -> None:
    """Show the build envelope and engine version of a manifest.

    Exit status 2 (and one line per problem on stderr) when the manifest is invalid.
    """
    from kiln.envelope import build_envelope, engine_version, envelope_digest, is_pinned

    try:
        engine = load_manifest(sys.stdin.read() if manifest == "-" else Path(manifest))
    except ManifestError as exc:
        where = "stdin" if manifest == "-" else manifest
        click.echo(f"error: invalid LLMEngine manifest {where}:", err=True)
        for line in exc.problems:
            click.echo(f"  {line}", err=True)
        sys.exit(EXIT_INVALID_SPEC)
    spec = engine.spec
    envelope = build_envelope(spec)
    version, digest = engine_version(spec), envelope_digest(envelope)
    if not is_pinned(spec):
        click.echo(f"warning: spec.model.revision {spec.model.revision or '(unset: main)'} can move; pin a "
                   "40-hex commit sha so the engine version names one set of weights", err=True)
    if as_json:
        click.echo(json.dumps({"engineVersion": version, "digest": digest, "envelope": envelope}, indent=2))
        return
    click.echo(f"engine version: {version}")
    click.echo(f"envelope sha256: {digest}")
    click.echo("envelope (only these fields change the engine version):")
    click.echo(yaml.safe_dump(envelope, sort_keys=False).rstrip().replace("\n", "\n  ").join(["  ", ""]))
