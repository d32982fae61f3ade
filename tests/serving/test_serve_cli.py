"""`kiln serve` usage errors (exit 2) and load failures (exit 1, one clear line, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from kiln.serving.cli import serve


def test_needs_exactly_one_source(tmp_path):
    runner = CliRunner()
    for args in ([], ["--model", str(tmp_path), "--artifact", "file:///x/engines/tiny-0123456789ab"]):
        result = runner.invoke(serve, args)
        assert result.exit_code == 2
        assert "exactly one of --model DIR or --artifact URI" in result.output


def test_missing_model_dir_and_empty_key_file_are_usage_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(serve, ["--model", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.output
    key = tmp_path / "key"
    key.write_text("\n")
    result = runner.invoke(serve, ["--model", str(tmp_path), "--api-key-file", str(key)])
    assert result.exit_code == 2 and "--api-key-file" in result.output and "empty" in result.output


def test_a_busy_port_is_a_usage_error_before_anything_loads(monkeypatch, tmp_path):
    """`--port` taken by another process: one line naming the flag, exit 2, before the model loads (not
    uvicorn's bind error after the load)."""
    import socket

    from kiln.serving import cli

    monkeypatch.setattr("kiln.serving.server.run_server", lambda config: pytest.fail("loaded with a busy port"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = CliRunner().invoke(cli.serve, ["--model", str(tmp_path), "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli.serve, ["--model", str(tmp_path), "--host", "192.0.2.1", "--port", "0"])
    assert result.exit_code == 2 and "--host 192.0.2.1: not an address of this host" in result.output


def test_missing_artifact_exits_1_with_a_clear_message(tmp_path):
    uri = f"file://{tmp_path}/store/engines/tiny-0123456789ab"
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", "--artifact", uri, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "could not load the model" in proc.stderr and "tiny-0123456789ab" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_engine_setting_exits_1_naming_it(model_dir):
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", "--model", str(model_dir), "--port", "0",
                           "--max-seq-len", "99999"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert "max_seq_len" in proc.stderr and "Traceback" not in proc.stderr


def test_engine_flags_are_generated_from_the_engine_settings(monkeypatch, tmp_path):
    """EngineConfig's fields are the one list of engine settings: every field marked as a flag is a
    `kiln serve` option with the field's help, and values arrive typed as the engine takes them."""
    from dataclasses import fields

    from kiln.engine.config import EngineConfig
    from kiln.serving import cli

    flagged = {f.name for f in fields(EngineConfig) if f.metadata.get("flag")}
    assert {dest for _, dest, _ in cli.engine_flags()} == flagged
    assert {"dtype", "max_batch_size", "quantization", "tensor_parallel_size", "speculative_config",
            "enable_prefix_caching", "distributed_timeout_s", "join_timeout_s"} <= flagged
    help_text = " ".join(CliRunner().invoke(serve, ["--help"]).output.split())
    for flag, _, setting in cli.engine_flags():
        assert flag in help_text
        assert " ".join(setting.metadata["help"].split())[:40] in help_text
    seen = {}
    monkeypatch.setattr("kiln.serving.server.run_server", lambda config: seen.update(config.engine_kwargs) or 0)
    monkeypatch.setattr(cli, "_exit", lambda code: None)
    result = CliRunner().invoke(serve, [
        "--model", str(tmp_path), "--port", "0", "--quantization", "none", "--tensor-parallel-size", "2",
        "--kv-memory-fraction", "0.5", "--no-enable-prefix-caching", "--join-timeout", "9",
        "--speculative-config", '{"method": "ngram"}'])
    assert result.exit_code == 0, result.output
    assert seen == {"quantization": "none", "tensor_parallel_size": 2, "kv_memory_fraction": 0.5,
                    "enable_prefix_caching": False, "join_timeout_s": 9.0,
                    "speculative_config": {"method": "ngram"}}
    for bad in (["--tensor-parallel-size", "3"], ["--kv-memory-fraction", "0"], ["--quantization", "int4"],
                ["--max-seq-len", "-5"], ["--max-input-len", "0"]):  # before the load, not after
        result = CliRunner().invoke(serve, ["--model", str(tmp_path), *bad])
        assert result.exit_code == 2 and bad[0] in result.output


def test_version_reports_the_settings_marked_reported(tmp_path):
    from dataclasses import fields

    from kiln.engine.config import EngineConfig, reported_settings

    reported = [f.name for f in fields(EngineConfig) if f.metadata.get("reported")]
    assert {"dtype", "device", "quantization", "tensor_parallel_size", "max_batch_size", "block_size",
            "enable_prefix_caching", "num_micro_batches"} <= set(reported)

    class Loaded:
        dtype, block_size = "bfloat16", 32

    assert reported_settings(Loaded()) == {name: {"dtype": "bfloat16", "block_size": 32}.get(name)
                                           for name in reported}


def test_default_chat_template_kwargs_must_be_an_object_of_variables_kiln_does_not_set(tmp_path):
    many = json.dumps({f"v{i}": i for i in range(65)})  # the rules a manifest's defaultChatTemplateKwargs follows
    for bad, says in (('["enable_thinking"]', "JSON object"), ('{"messages": []}', "messages"), ("{", "JSON"),
                      ('{"1st": true}', "not a name a chat template can read"), (many, "at most 64")):
        result = CliRunner().invoke(serve, ["--model", str(tmp_path), "--default-chat-template-kwargs", bad])
        assert result.exit_code == 2 and "--default-chat-template-kwargs" in result.output and says in result.output
