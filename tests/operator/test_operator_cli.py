"""``kiln operator`` flags: namespaces and store are required and checked before kopf starts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from kiln.operator.cli import _namespaces, operator


@pytest.fixture(autouse=True)
def _restore_environ(monkeypatch: pytest.MonkeyPatch):
    """The command exports its flags as KILN_* variables; keep them out of other tests."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_help_lists_the_flags():
    result = CliRunner().invoke(operator, ["--help"])
    assert result.exit_code == 0
    for flag in ("--namespace", "--all-namespaces", "--store", "--metrics-port", "--ha"):
        assert flag in result.output


@pytest.mark.parametrize("args, message", [
    (["--store", "s3://b/p"], "--namespace NS"),
    (["-n", "a", "-A", "--store", "s3://b/p"], "not both"),
    (["-n", "ml"], "no artifact store"),
])
def test_usage_errors_exit_2_with_a_fix(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch):
    for var in ("KILN_NAMESPACES", "KILN_STORE_URI"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(operator, args)
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_bad_config_variable_is_a_usage_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KILN_SKU_NODE_LABELS", "[1]")
    result = CliRunner().invoke(operator, ["-n", "ml", "--store", "s3://b/p"])
    assert result.exit_code == 2 and "KILN_SKU_NODE_LABELS must be a JSON dict" in result.output


def test_namespaces_from_flags_or_env(monkeypatch: pytest.MonkeyPatch):
    assert _namespaces(("a", "b"), False) == (False, ["a", "b"])
    assert _namespaces((), True) == (True, [])
    monkeypatch.setenv("KILN_NAMESPACES", "x, y")
    assert _namespaces((), False) == (False, ["x", "y"])
    monkeypatch.setenv("KILN_NAMESPACES", "*")
    assert _namespaces((), False) == (True, [])


def test_kiln_cli_reaches_the_operator_command():
    from kiln.cli import cli

    result = CliRunner().invoke(cli, ["operator", "--help"])
    assert result.exit_code == 0 and "--all-namespaces" in result.output


def test_operator_modules_import_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import kiln.operator.handlers, kiln.operator.cli, kiln.operator.reconcile\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
