"""Local sources (``file://``, ``pvc://``): the path each names, and the checks that it names only that.

They are read in place, so they must be what they say: a symlink (the named path, a folder
on the way inside a claim, or a file in the checkpoint) or a ``..`` that leaves the given
root is refused, naming ``spec.model.source`` and the path. A ``pvc://claim/sub/path`` is
mounted at ``$KILN_PVC_ROOT/claim`` (default ``/models/claim``; the operator's build Job sets it).
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.builder.errors import FetchError

from kiln.model_source import PVC_ROOT_ENV


def local_path(source: str) -> Path:
    """The path a ``file://`` or ``pvc://`` source names (not checked)."""
    if source.startswith("file://"):
        rest = source[len("file://"):]
        path = Path(rest).expanduser()
        return path if path.is_absolute() else Path.cwd() / path
    if source.startswith("pvc://"):
        claim, _, sub = source[len("pvc://"):].partition("/")
        return pvc_root(claim) / sub
    raise ValueError(source)


def pvc_root(claim: str) -> Path:
    return Path(os.environ.get(PVC_ROOT_ENV, "/models")) / claim


def _refuse(source: str, why: str, fix: str) -> FetchError:
    return FetchError(f"spec.model.source: {source} {why}; {fix}")


def check_local_path(source: str) -> Path:
    """The path a local source names, refusing ``..`` escapes and symlinks (returns the unresolved path)."""
    path = local_path(source)
    if source.startswith("pvc://"):
        claim = source[len("pvc://"):].partition("/")[0]
        root = pvc_root(claim)
        sub = source[len("pvc://") + len(claim):].strip("/")
        if ".." in sub.split("/"):
            raise _refuse(source, "has a '..' segment", f"name a path inside the claim {claim}")
        here = root
        for part in [p for p in sub.split("/") if p not in ("", ".")]:
            here = here / part
            if here.is_symlink():
                raise _refuse(source, f"goes through the symlink {here}", "point at the real path inside the claim")
        if root.exists() and path.exists() and not path.resolve().is_relative_to(root.resolve()):
            raise _refuse(source, f"resolves to {path.resolve()}, outside the claim's root {root}",
                          "name a path inside the claim")
        return path
    rest = source[len("file://"):]
    parts = rest.split("/")
    leading = 0
    while leading < len(parts) and parts[leading] in ("", ".", ".."):
        leading += 1
    if ".." in parts[leading:]:
        raise _refuse(source, "has a '..' segment inside the path", "write the path without '..' after its start")
    if path.is_symlink():
        raise _refuse(source, f"-> {path} is a symlink (to {path.resolve()})",
                      "point at the real checkpoint directory or file, not a link to it")
    return path


def refuse_linked_files(source: str, root: Path, names: list[str]) -> None:
    """Refuse a checkpoint whose files (``names`` in ``root``) are symlinks or resolve outside it."""
    for n in sorted(names):
        p = root / n
        if p.is_symlink() or not p.resolve().is_relative_to(root.resolve()):
            raise _refuse(source, f"contains {n}, a symlink to {p.resolve()}",
                          "copy the real file into the checkpoint directory (kiln reads no links)")


def local_hint(source: str, path: Path) -> str:
    """Where a local source that is not there was looked for, for the error message."""
    if source.startswith("pvc://"):
        return f" (pvc:// sources are read from ${PVC_ROOT_ENV}/<claim>, here {path.parent})"
    return f" (relative file:// paths are resolved against the working directory {Path.cwd()})"
