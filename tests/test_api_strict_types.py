"""The CRD's types, as the API server checks them: `kiln plan` and `kiln render` refuse a number, a boolean or text
written as the wrong type (pydantic's lax mode converted "8" to 8, so a manifest kubectl refuses was planned and
rendered), each line naming the field and how to write it; and they take what the API server takes."""

from __future__ import annotations

import copy

import pytest
import yaml
from click.testing import CliRunner

from kiln.cli import cli
from kiln.manifest import ManifestError, load_manifest, load_pool

API = "serving.kiln.dev/v1alpha1"
MODEL = {"source": "hf://org/model", "revision": "a" * 40}
ENGINE = {"apiVersion": API, "kind": "LLMEngine", "metadata": {"name": "chat"}, "spec": {"model": MODEL, "gpu": "L4"}}
POOL = {"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": "shared"}, "spec": {"gpu": "cpu"}}


def with_field(doc: dict, path: str, value) -> dict:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out["spec"]
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


def run(command: str, tmp_path, doc: dict):
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(doc))
    return CliRunner().invoke(cli, [command, "-f", str(path)], catch_exceptions=False)


@pytest.mark.parametrize(("path", "value", "line"), [
    ("tensorParallel", "2", "spec.tensorParallel: must be one of 1, 2, 4, 8 (got '2'); write it without quotes (2)"),
    ("maxBatchSize", "8", "spec.maxBatchSize: must be an integer (got '8'); write it without quotes (8)"),
    ("maxSeqLen", "4096", "spec.maxSeqLen: must be an integer (got '4096'); write it without quotes (4096)"),
    ("build.timeoutSeconds", "600", "spec.build.timeoutSeconds: must be an integer (got '600'); write it without"),
    ("serving.replicas", "2", "spec.serving.replicas: must be an integer (got '2'); write it without quotes (2)"),
    ("serving.replicas", True, "spec.serving.replicas: must be an integer (got True)"),
    ("kv.memoryFraction", "0.8", "spec.kv.memoryFraction: must be a number (got '0.8'); write it without quotes"),
    ("kv.enablePrefixCaching", "false", "spec.kv.enablePrefixCaching: must be true or false (got 'false'); write it"),
    ("kv.enablePrefixCaching", 1, "spec.kv.enablePrefixCaching: must be true or false (got 1); write true or false"),
    ("lora.maxLoras", "2", "spec.lora.maxLoras: must be an integer (got '2'); write it without quotes (2)"),
    # a boolean is 1 to Python, even strictly: a choice of numbers took `true` as 1
    ("tensorParallel", True, "spec.tensorParallel: must be one of 1, 2, 4, 8 (got true); a boolean is no number"),
    ("kv.blockSize", True, "spec.kv.blockSize: must be one of 1, 2, 4, 8, 16, 32, 64, 128, 256 (got true)"),
])
@pytest.mark.parametrize("command", ["plan", "render"])
def test_an_engine_field_of_the_wrong_json_type_is_refused_naming_it_and_the_fix(tmp_path, command, path, value,
                                                                                  line):
    result = run(command, tmp_path, with_field(ENGINE, path, value))
    assert result.exit_code == 2, result.output
    assert line in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(("path", "value", "line"), [
    ("replicas", "2", "spec.replicas: must be an integer (got '2'); write it without quotes (2)"),
    ("queueSize", "64", "spec.queueSize: must be an integer (got '64'); write it without quotes (64)"),
    ("batchInvariant", "true", "spec.batchInvariant: must be true or false (got 'true'); write it without quotes"),
    ("autoscaling.maxReplicas", "4", "spec.autoscaling.maxReplicas: must be an integer (got '4')"),
])
def test_a_pool_field_of_the_wrong_json_type_is_refused_by_kiln_render(tmp_path, path, value, line):
    result = run("render", tmp_path, with_field(POOL, path, value))
    assert result.exit_code == 2, result.output
    assert "invalid LLMEnginePool manifest" in result.stderr and line in result.stderr


def test_the_operator_reads_a_spec_by_the_same_types(tmp_path):
    """An API server without the CRD's schema (an old CRD) must not hand the builder "8" as an integer either."""
    from kiln.operator.settings import OperatorConfig
    from kiln.operator.validation import InvalidSpec, validate_spec

    with pytest.raises(InvalidSpec, match=r"^spec\.maxBatchSize: must be an integer \(got '8'\)"):
        validate_spec({"model": MODEL, "gpu": "L4", "maxBatchSize": "8"}, OperatorConfig(store_uri="s3://b"))


def test_what_the_api_server_takes_as_an_integer_is_taken():
    """A JSON number without a fraction is an integer to the API server (it stores 8): 8.0 is taken, 8.5 is not."""
    assert load_manifest(with_field(ENGINE, "maxBatchSize", 8.0)).spec.max_batch_size == 8
    gate = load_manifest(with_field(ENGINE, "build.qualityGate", {"maxKLDivergence": 1})).spec.build.quality_gate
    assert gate.max_kl_divergence == 1.0  # and an integer is a number
    with pytest.raises(ManifestError, match=r"spec\.maxBatchSize: must be an integer \(got 8\.5\)"):
        load_manifest(with_field(ENGINE, "maxBatchSize", 8.5))
    assert load_pool(with_field(POOL, "replicas", 2.0)).spec.replicas == 2


def test_an_object_kubectl_get_printed_still_reads(tmp_path):
    """Its status holds timestamps and phases as text (JSON has no other word for them): read as JSON reads them."""
    doc = with_field(ENGINE, "maxBatchSize", 8)
    doc["metadata"].update({"namespace": "ml", "uid": "u-1", "creationTimestamp": "2026-01-01T00:00:00Z"})
    doc["status"] = {
        "phase": "Ready", "observedGeneration": 3,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Serving", "message": "ok",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "history": [{"engineVersion": "v1", "artifactURI": "s3://b/engines/v1", "builtAt": "2026-01-01T00:00:00Z"}],
        "build": {"engineVersion": "v1", "attempts": 1, "retryAt": "2026-01-01T00:00:00Z"}}
    engine = load_manifest(doc)
    assert engine.status.phase == "Ready" and engine.status.conditions[0].last_transition_time.year == 2026
    assert run("plan", tmp_path, doc).exit_code == 0


def test_yaml_is_read_as_kubectl_reads_it(tmp_path):
    """kubectl (go-yaml) reads an unquoted 1e9 as a number, which the API server refuses for a text field: so does
    kiln, where PyYAML alone read it as text (and the quantity rule took it)."""
    text = yaml.safe_dump(POOL).replace("gpu: cpu", "gpu: cpu\n  memoryBudget: 1e9")
    assert "memoryBudget: 1e9" in text
    with pytest.raises(ManifestError, match=r"spec\.memoryBudget: must be a string \(got 1000000000\.0\); quote it"):
        load_pool(text)
    assert load_pool(text.replace("1e9", "'1e9'")).spec.memory_budget_bytes == 10**9
