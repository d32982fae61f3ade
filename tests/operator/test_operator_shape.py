"""The operator's code stays readable as steps: no function over 60 lines (def line through body, docstring
included) and no module over 350."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def test_no_operator_function_is_over_60_lines():
    long = []
    for path in sorted(OPERATOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], "split these by concern"


def test_no_operator_module_is_over_350_lines():
    assert [p.name for p in OPERATOR.glob("*.py") if len(p.read_text().splitlines()) > 350] == []
