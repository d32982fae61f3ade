"""The pool's engines: ``--engine NAME=ARTIFACT_URI`` flags, or the engines file a pod follows.

The file has the adapter list's shape (``kiln.adapter_list``), one entry per engine::

    {"format": 1, "engines": [{"name": "chat", "artifactURI": "s3://bucket/engines/<version>",
                               "contentDigest": "<optional: the manifest's content digest a controller pinned>"}]}

YAML is read as well as JSON. The server re-reads it every few seconds (``kiln.serving.pool.follow``): an engine
added is served from its first request, one removed is unloaded, without a restart. The operator writes it for an
LLMEnginePool (a ConfigMap its pods mount); it lives in kiln's core so that both sides share one format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class EngineEntry:
    """One engine of the pool: the name clients send as ``model`` and the artifact it serves."""

    name: str
    artifact_uri: str
    content_digest: str | None = None


def check_name(name: str, where: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{where}: engine name {name!r} must be 1-128 letters, digits or . _ : / - (starting with "
                         "a letter or digit); it is what clients send as \"model\"")
    return name


def parse_engine_flag(text: str) -> EngineEntry:
    """``NAME=ARTIFACT_URI`` (``--engine``); ValueError naming the flag and the fix."""
    name, sep, uri = text.partition("=")
    if not sep or not name.strip() or not uri.strip():
        raise ValueError(f"--engine {text!r}: expected NAME=ARTIFACT_URI, e.g. --engine chat=file:///store/engines/"
                         "<version>")
    return EngineEntry(check_name(name.strip(), f"--engine {text!r}"), uri.strip())


def unique(entries: list[EngineEntry], where: str) -> dict[str, EngineEntry]:
    """``entries`` by name; ValueError naming ``where`` when a name repeats."""
    out: dict[str, EngineEntry] = {}
    for entry in entries:
        if entry.name in out:
            raise ValueError(f"{where}: the engine name {entry.name!r} is given twice; give each engine its own name")
        out[entry.name] = entry
    return out


def parse_document(doc: Any, where: str) -> dict[str, EngineEntry]:
    """The engines of a file's document; ValueError naming the entry and field at fault."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("engines"), list):
        raise ValueError(f"{where}: expected {{\"format\": {FORMAT}, \"engines\": [{{\"name\": ..., \"artifactURI\": "
                         "...}, ...]}")
    entries = []
    for i, item in enumerate(doc["engines"]):
        at = f"{where}: engines[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not isinstance(item.get("artifactURI"), str):
            raise ValueError(f"{at}: needs string fields \"name\" and \"artifactURI\"")
        digest = item.get("contentDigest")
        entries.append(EngineEntry(check_name(item["name"], at), item["artifactURI"],
                                   digest if isinstance(digest, str) else None))
    return unique(entries, where)


def read_file(path: Path) -> dict[str, EngineEntry]:
    """The engines ``path`` lists; an empty or missing file lists none; ValueError for one that cannot be read."""
    import yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"--engines-file {path}: cannot be read: {exc}") from None
    if not text.strip():
        return {}
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"--engines-file {path}: not JSON or YAML: {exc}") from None
    return parse_document(doc, f"--engines-file {path}")


def document(entries: list[EngineEntry]) -> dict[str, Any]:
    """The file's document for ``entries`` (what a controller or a test writes)."""
    out = []
    for e in sorted(entries, key=lambda e: e.name):
        item = {"name": e.name, "artifactURI": e.artifact_uri}
        if e.content_digest:
            item["contentDigest"] = e.content_digest
        out.append(item)
    return {"format": FORMAT, "engines": out}
