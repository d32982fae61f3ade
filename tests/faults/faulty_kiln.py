"""``python -P faulty_kiln.py ARGS`` is ``kiln ARGS`` that stops at a fault point and waits to be killed.

The fault suite (tests/faults/) runs this instead of ``python -m kiln`` when it must kill a build at an
exact point. ``$KILN_FAULT_PAUSE`` names the point:

- a build stage (``fetch``, ``check``, ..., ``package``): right after that stage's work, before the
  next stage starts (its outputs are on disk in the work dir);
- ``publish:staged``: inside the publish, every file uploaded to ``staging/`` and verified, nothing moved
  under ``engines/<version>/`` yet;
- ``publish:moved``: inside the publish, every file moved under ``engines/<version>/`` and the publish
  claim held, the manifest not yet created (the last instant before the version becomes visible);
- ``never``: no pause (the same process, run to the end).

At the point it writes ``$KILN_FAULT_DIR/paused`` (the point's name) and sleeps until
``$KILN_FAULT_DIR/resume`` exists (the test usually SIGKILLs it instead). Nothing else changes.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path


def pause(point: str) -> None:
    folder = Path(os.environ["KILN_FAULT_DIR"])
    (folder / "paused.tmp").write_text(point)
    (folder / "paused.tmp").rename(folder / "paused")
    sys.stderr.write(f"faulty_kiln: paused at {point}\n")
    sys.stderr.flush()
    while not (folder / "resume").exists():
        time.sleep(0.02)


def _after(fn, point: str):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        pause(point)
        return result

    return wrapped


def _before(fn, point: str, when=lambda *a, **k: True):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            pause(point)
        return fn(*args, **kwargs)

    return wrapped


def install(point: str) -> None:
    if point == "publish:staged":
        from kiln import artifacts

        artifacts.move_in = _before(artifacts.move_in, point)
    elif point == "publish:moved":
        from kiln.storage_file import FileBackend
        from kiln.storage_s3 import S3Backend

        def is_manifest(self, key, data):
            return key.endswith("/manifest.json")

        for backend in (FileBackend, S3Backend):
            backend.create_exclusive = _before(backend.create_exclusive, point, is_manifest)
    elif point != "never":
        import importlib

        stage = importlib.import_module(f"kiln.builder.stages.{point}")
        stage.run = _after(stage.run, point)


if __name__ == "__main__":
    if point := os.environ.get("KILN_FAULT_PAUSE"):
        install(point)
    from kiln.cli import main

    sys.argv[0] = "kiln"
    main()
