"""``kiln cache``: list, show, remove and garbage-collect engine versions in an artifact store.

Exit codes: 0 ok; 1 the version is not in the store; 2 usage error (bad
option, bad version name or duration); 3 storage error (unreachable endpoint,
missing bucket, credentials, access denied, corrupt object) — the same code
``kiln build`` uses. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable
from datetime import timedelta

import click

from kiln.artifact_manifest import ArtifactNotFound, Manifest, StoreError
from kiln.artifacts import STORE_ENV, STORE_ENV_ALIAS, ArtifactStore, default_store_uri, store_from_env

EXIT_NOT_FOUND = 1
EXIT_STORAGE = 3

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNITS = {"s": 1, "": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``1h``, ``2d`` or plain seconds."""
    m = _DURATION_RE.match(text.strip().lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration; use e.g. 30m, 1h, 2d or 0")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _store_errors(fn: Callable) -> Callable:
    """Turn store failures into one stderr line and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ArtifactNotFound as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_NOT_FOUND)
        except StoreError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_STORAGE)
        except ValueError as exc:  # a malformed version name
            raise click.UsageError(str(exc)) from None

    return wrapper


def env_store(fallback: Callable[[], str | None] = lambda: None) -> Callable[[], str | None]:
    """A ``--store`` option's default (every command's: kiln build, cache, up, render): the store the environment
    names (``kiln.artifacts.store_from_env``), else ``fallback()``; the two names set to different stores is a
    usage error naming both."""

    def default() -> str | None:
        try:
            return store_from_env() or fallback()
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None

    return default


def store_option(fn: Callable) -> Callable:
    return click.option(
        "--store", "store_uri", default=env_store(default_store_uri), metavar="URI",
        show_default=f"${STORE_ENV} (or ${STORE_ENV_ALIAS}), else file://<user cache dir>/kiln/store",
        help="Artifact store: file:///path or s3://bucket/prefix[?endpoint_url=URL&profile=NAME].",
    )(fn)


@click.group("cache", epilog="Exit codes: 0 ok, 1 version not found, 2 usage error, 3 storage error.")
def cache() -> None:
    """List, show, remove and garbage-collect built engines in an artifact store."""


@cache.command("ls")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print the manifests as a JSON list.")
@_store_errors
def ls(store_uri: str, as_json: bool) -> None:
    """List the published engine versions, oldest first."""
    store = ArtifactStore.from_uri(store_uri)
    manifests = store.list_versions()
    if as_json:
        click.echo(json.dumps([m.model_dump(mode="json") for m in manifests], indent=2))
        return
    if not manifests:
        click.echo(f"no engines in {store.uri}", err=True)
        return
    click.echo(f"store: {store.uri}", err=True)  # which one: --store, $KILN_STORE_URI or the user cache dir
    rows = [("VERSION", "SIZE", "FILES", "CREATED", "KILN")]
    rows += [(m.engine_version, human_size(m.total_size), str(len(m.files)),
              m.created_at.strftime("%Y-%m-%d %H:%M:%SZ"), m.kiln_version) for m in manifests]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _describe(store: ArtifactStore, m: Manifest) -> str:
    lines = [f"version:        {m.engine_version}",
             f"uri:            {store.artifact_uri(m.engine_version)}",
             f"created:        {m.created_at.isoformat()}",
             f"kiln version:   {m.kiln_version}",
             f"total size:     {human_size(m.total_size)} ({m.total_size} bytes)",
             f"content digest: {m.content_digest}",
             "envelope:"]
    lines += ["  " + line for line in json.dumps(m.envelope, indent=2, sort_keys=True).splitlines()]
    lines.append(f"files ({len(m.files)}):")
    lines += [f"  {f.sha256[:16]}  {human_size(f.size):>10}  {f.path}" for f in m.files]
    return "\n".join(lines)


@cache.command("show")
@click.argument("version")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@_store_errors
def show(version: str, store_uri: str, as_json: bool) -> None:
    """Show one version's manifest: envelope, files, sizes and checksums."""
    store = ArtifactStore.from_uri(store_uri)
    manifest = store.read_manifest(version)
    if manifest is None:
        raise store.not_found(version)
    click.echo(manifest.model_dump_json(indent=2) if as_json else _describe(store, manifest))


@cache.command("rm")
@click.argument("version")
@store_option
@_store_errors
def rm(version: str, store_uri: str) -> None:
    """Remove one version (its manifest first, so readers never see a partial version)."""
    store = ArtifactStore.from_uri(store_uri)
    removed = store.delete(version)
    click.echo(f"removed {store.artifact_uri(version)} ({len(removed)} objects)")


@cache.command("gc")
@store_option
@click.option("--staging-older-than", "older_than", default="1h", show_default=True, metavar="DURATION",
              help="Remove uploads untouched for this long (30m, 1h, 2d); must exceed your longest upload.")
@_store_errors
def gc(store_uri: str, older_than: str) -> None:
    """Remove abandoned staging uploads and manifest-less engine files."""
    store = ArtifactStore.from_uri(store_uri)
    removed = store.gc(parse_duration(older_than))
    for item in removed:
        click.echo(f"removed {item}")
    if not removed:
        click.echo(f"nothing to collect in {store.uri}", err=True)
