"""The build's input manifest: where ``kiln build`` gets it: ``-f FILE``, ``--spec-file FILE`` or
``$KILN_SPEC``.

A build Job passes the ``LLMEngine`` as JSON in ``KILN_SPEC`` (the Job the operator renders in
:mod:`kiln.operator.jobs`; docs/build.md); people pass ``-f manifest.yaml``. Either way the result is
validated by :func:`kiln.manifest.load_manifest`, and a problem becomes :class:`InvalidSpec` (exit 2)
naming the field.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kiln.builder.errors import InvalidSpec

from kiln.manifest import ManifestError, load_manifest

SPEC_ENV = "KILN_SPEC"
EXPECTED_VERSION_ENV = "KILN_ENGINE_VERSION"


def resolve_manifest(manifest: str | None, spec_file: str | None):
    """The ``LLMEngine`` to build; :class:`InvalidSpec` when missing or invalid."""
    try:
        if manifest == "-":
            return load_manifest(sys.stdin.read())
        if manifest or spec_file:
            path = Path(manifest or spec_file)
            if not path.is_file():
                raise InvalidSpec(f"{'-f' if manifest else '--spec-file'}: {path} is not a file")
            return load_manifest(path)
        text = os.environ.get(SPEC_ENV)
        if not text:
            raise InvalidSpec(f"no manifest: pass -f manifest.yaml, --spec-file FILE or set ${SPEC_ENV} "
                              "to the LLMEngine as JSON")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidSpec(f"${SPEC_ENV} is not valid JSON ({exc.msg} at position {exc.pos})") from None
        return load_manifest(data)
    except ManifestError as exc:
        raise InvalidSpec("invalid LLMEngine manifest: " + "; ".join(exc.problems)) from None


def check_expected_version(version: str) -> None:
    """The operator names the version it expects; a builder that computes another must not publish."""
    expected = os.environ.get(EXPECTED_VERSION_ENV)
    if expected and expected != version:
        raise InvalidSpec(
            f"${EXPECTED_VERSION_ENV} is {expected} but this builder computes {version} for the same spec; the "
            "operator and builder images disagree on the envelope (different kiln versions?): run matching images"
        )
