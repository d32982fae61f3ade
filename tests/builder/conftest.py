"""Builder test helpers: manifests for toy models, `kiln build` in-process and as a subprocess."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from builder_helpers import manifest_dict
from click.testing import CliRunner


@pytest.fixture
def write_manifest(tmp_path: Path) -> Callable[..., Path]:
    count = iter(range(1000))

    def write(source: str, **spec) -> Path:
        path = tmp_path / f"manifest-{next(count)}.yaml"
        path.write_text(yaml.safe_dump(manifest_dict(source, **spec)))
        return path

    return write


@pytest.fixture
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("KILN_TERMINATION_LOG", str(path))
    return path


@pytest.fixture
def kiln_build(tmp_path: Path, termination_log: Path) -> Callable[..., object]:
    """Run `kiln build ARGS` in this process (torch already imported: fast); returns the click Result."""
    from kiln.builder.cli import build

    def run(*args: str, env: dict[str, str] | None = None):
        result = CliRunner().invoke(build, [*args, "--work-dir", str(tmp_path / "work")], env=env,
                                    catch_exceptions=False)
        return result

    return run
