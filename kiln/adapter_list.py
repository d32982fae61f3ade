"""The adapter list: the one file that tells a server which LoRA adapter artifacts to hold (docs/lora.md).

On a cluster the operator writes it into the engine's ``<engine>-adapters`` ConfigMap, which serving pods
mount; ``kiln up`` writes it beside its local store. The server finds it at ``$KILN_LORA_ADAPTERS_FILE``
and holds exactly the entries whose ``baseEngineVersion`` is the engine it serves::

    {"format": 1, "adapters": [{"name": ..., "artifactURI": ..., "version": ...,
                                "baseEngineVersion": ..., "contentDigest": ...}, ...]}

``contentDigest`` (the manifest's content digest the operator pinned) is absent where nobody pinned one.
An adapter's build Job is told the version the operator computed in ``$KILN_ADAPTER_VERSION``, and refuses
to build when its own differs. Both sides of the file import this module; neither spells the format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADAPTERS_FILE_ENV = "KILN_LORA_ADAPTERS_FILE"
ADAPTER_VERSION_ENV = "KILN_ADAPTER_VERSION"
FORMAT = 1


def entry(name: str, artifact_uri: str, version: str, base_version: str,
          content_digest: str | None = None) -> dict[str, str]:
    """One adapter of the list, as the file spells it."""
    out = {"name": name, "artifactURI": artifact_uri, "version": version, "baseEngineVersion": base_version}
    if content_digest is not None:
        out["contentDigest"] = content_digest
    return out


def document(entries: list[dict[str, str]]) -> dict[str, Any]:
    """The whole file: ``entries`` (from :func:`entry`) in a stable order, so an unchanged list writes the same."""
    return {"format": FORMAT, "adapters": sorted(entries, key=lambda e: (e["baseEngineVersion"], e["name"]))}


def write(path: Path, entries: list[dict[str, str]]) -> Path:
    """Write the list to ``path`` (its folder made if missing) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document(entries), indent=1))
    return path


def wanted(doc: Any, engine_version: str | None) -> dict[str, dict[str, str]]:
    """The list's adapters for ``engine_version``, by name ({} for a document of another format or none)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return {}
    out = {}
    for item in doc.get("adapters") or []:
        if isinstance(item, dict) and item.get("baseEngineVersion") == engine_version \
                and isinstance(item.get("name"), str) and isinstance(item.get("artifactURI"), str):
            out[item["name"]] = item
    return out

