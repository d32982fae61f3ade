"""The house stays readable (docs/architecture.md): the orchestrators read as steps, so no function of any
component runs over 60 lines (def line through body, docstring included), and no module of any component
passes 350 lines: split by concern, not by size.

``LONG_FUNCTIONS`` would name a function let over 60 lines, with its length: a list that only shrinks (a
listed function may not grow, and once split its row must go). It is empty: keep it so."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("kiln", "operator", "builder_job", "engine", "serving_image", "bench", "cluster")
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS: dict[str, int] = {}  # "path qualified.name": its length today; empty since issue 39


def _sources(place: str) -> list[Path]:
    path = ROOT / place
    return [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function under ``node``, nested ones and methods included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, f"{name}.")
        else:
            yield from _functions(child, prefix)


def _lengths(place: str) -> dict[str, int]:
    out = {}
    for path in _sources(place):
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            out[f"{path.relative_to(ROOT)} {name}"] = node.end_lineno - node.lineno + 1
    return out


@pytest.mark.parametrize("place", COMPONENTS)
def test_no_function_is_over_60_lines(place):
    lengths = _lengths(place)
    long = [f"{name} ({n} lines)" for name, n in lengths.items()
            if n > LONG_FUNCTIONS.get(name, MAX_FUNCTION_LINES)]
    assert long == [], "split these by concern (a function on LONG_FUNCTIONS may not grow)"
    done = [name for name in LONG_FUNCTIONS
            if name.startswith(f"{place}/") and lengths.get(name, 0) <= MAX_FUNCTION_LINES]
    assert done == [], "split or gone: drop these from LONG_FUNCTIONS"


@pytest.mark.parametrize("place", COMPONENTS)
def test_no_module_is_over_350_lines(place):
    big = [f"{p.relative_to(ROOT)} ({n})" for p in _sources(place) if (n := len(p.read_text().splitlines())) > 350]
    assert big == [], "split these by concern"
