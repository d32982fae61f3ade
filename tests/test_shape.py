"""The house stays readable (docs/architecture.md): the orchestrators read as steps, so no function in the
builder, the operator or the engine's settings runs over 60 lines (def line through body, docstring
included), and no module of any component passes 350 lines: split by concern, not by size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPWISE = ("builder_job", "operator", "engine/config.py")
COMPONENTS = ("kiln", "operator", "builder_job", "engine", "serving_image", "bench", "cluster")


def _sources(place: str) -> list[Path]:
    path = ROOT / place
    return [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("place", STEPWISE)
def test_no_function_is_over_60_lines(place):
    long = []
    for path in _sources(place):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], "split these by concern"


@pytest.mark.parametrize("place", COMPONENTS)
def test_no_module_is_over_350_lines(place):
    big = [f"{p.relative_to(ROOT)} ({n})" for p in _sources(place) if (n := len(p.read_text().splitlines())) > 350]
    assert big == [], "split these by concern"
