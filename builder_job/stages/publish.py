"""The build's ``publish`` stage: the staged engine into the artifact store, atomically.

Nothing reaches the store before this stage, and the store's publish is atomic, so a build that fails
or is killed at any point leaves no visible version.
"""

from __future__ import annotations

import logging
import time

from kiln.builder.context import BuildContext
from kiln.builder.errors import StorageFailure
from kiln.builder.report import human_bytes

from kiln.artifact_manifest import ArtifactConflict, StoreError

log = logging.getLogger("kiln.build")


def run(ctx: BuildContext) -> None:
    """Publish ``ctx.out`` as ``ctx.version``; a concurrent publish of the same version wins."""
    try:
        ctx.store.publish(ctx.version, ctx.out, ctx.envelope, progress=_publish_progress(), built_by=ctx.built_by,
                          signer=ctx.signer)
    except ArtifactConflict:
        # Another builder of the same version won the race; its artifact differs from ours only in
        # what was measured (timings), and a version is immutable once published: use theirs.
        log.warning("%s was published concurrently by another build; keeping that one", ctx.version)
    except StoreError as exc:
        raise StorageFailure(str(exc)) from None


def _publish_progress():
    last = {"t": 0.0}

    def progress(path: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last["t"] > 5:
            last["t"] = now
            log.info("publish %s: %s/%s", path, human_bytes(done), human_bytes(total))

    return progress
