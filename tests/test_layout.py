"""The distribution's layout: every package folder is installed, and the core
and operator import without torch (the operator image stays small)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kiln": "kiln", "kiln.operator": "operator", "kiln.engine": "engine",
           "kiln.builder": "builder_job", "kiln.serving": "serving_image"}


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == FOLDERS
    found = set()
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == set(cfg["packages"]), "add new subpackages to [tool.setuptools] packages"


def test_the_bench_is_a_distribution_of_its_own():
    """kiln bench is not runtime: the images install `kiln` (pyproject.toml) and never carry it."""
    cfg = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())
    assert cfg["project"]["name"] == "kiln-bench"
    assert cfg["tool"]["setuptools"]["package-dir"] == {"kiln_bench": "."}
    assert cfg["tool"]["setuptools"]["packages"] == ["kiln_bench"]
    assert not list((ROOT / "bench").glob("*/__init__.py")), "kiln-bench has one package: list new ones"
    for dockerfile in ("serving_image/Dockerfile", "builder_job/Dockerfile"):
        assert "COPY bench" not in (ROOT / dockerfile).read_text()


def test_core_and_operator_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import kiln, kiln.api, kiln.manifest, kiln.envelope, kiln.artifacts, kiln.cli, kiln.operator\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_test_module_basenames_are_unique():
    # Test folders are not packages (tests/operator would shadow the stdlib), so pytest
    # imports test modules by basename: two files of one name break collection.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"rename these test modules to unique names: {dupes}"


def test_every_component_says_its_import_name_at_the_door():
    """The folders are not named after their import paths (docs/architecture.md); each package's
    docstring says the name it is imported as, first."""
    for name, folder in FOLDERS.items():
        text = (ROOT / folder / "__init__.py").read_text()
        assert text.startswith(f'"""Imported as ``{name}`` (folder ``{folder}/``'), folder
