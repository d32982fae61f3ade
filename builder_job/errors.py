"""Build failures and the exit codes a build Job reports.

Every failure a user (or their infrastructure) can cause is a :class:`BuildError`
subclass whose ``str`` is one user-facing line naming the field or input and the
fix. ``kiln build`` turns it into that line on stderr, the termination message
the operator shows in ``status``, and the class's exit code — never a traceback.

Exit codes (also in ``kiln build --help`` and docs/build.md):

====  =====================================================================
0     built and published, or the store already had this engine version
1     unexpected error (a bug: the traceback is logged)
2     invalid spec or envelope (bad manifest, spec does not fit the model/GPU)
3     storage error (same code as ``kiln cache``)
4     quality gate failed (nothing published; the report says by how much)
5     fetch error (checkpoint source unreachable, missing, or not safetensors)
====  =====================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_INVALID_SPEC = 2
EXIT_STORAGE = 3
EXIT_QUALITY_GATE = 4
EXIT_FETCH = 5


class BuildError(Exception):
    """A build failure with a user-facing message and an exit code."""

    exit_code = EXIT_UNEXPECTED
    reason = "BuildFailed"


class InvalidSpec(BuildError):
    """The manifest is invalid, or its envelope cannot work for this model or GPU."""

    exit_code = EXIT_INVALID_SPEC
    reason = "InvalidSpec"


class ArtifactMismatch(InvalidSpec):
    """The store holds this version, built from another envelope (a hash-prefix collision or a rewrite)."""

    reason = "ArtifactUntrusted"


class StorageFailure(BuildError):
    """The artifact store could not be read or written."""

    exit_code = EXIT_STORAGE
    reason = "StorageError"


class QualityGateFailed(BuildError):
    """The converted model drifted from the source more than the spec allows."""

    exit_code = EXIT_QUALITY_GATE
    reason = "QualityGateFailed"

    def __init__(self, message: str, metrics: dict | None = None) -> None:
        super().__init__(message)
        self.metrics = metrics or {}


class FetchError(BuildError):
    """The checkpoint could not be fetched, or is not an acceptable checkpoint."""

    exit_code = EXIT_FETCH
    reason = "FetchError"
