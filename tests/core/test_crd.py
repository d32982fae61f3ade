"""The generated CRD: current, structural, valid as a Kubernetes object, and in step with the pydantic rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kiln.api import LLMEngineSpec
from kiln.crd import CRD_NAME, generate_crd, render_crd
from kiln.manifest import ManifestError, load_manifest, validation_error_lines

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = [ROOT / "crds/llmengines.serving.kiln.dev.yaml", ROOT / "helm/kiln/crds/llmengines.serving.kiln.dev.yaml"]
CRD = generate_crd()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
FREE_FORM = {"spec.serving.resources"}  # the only places unknown fields are kept


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_crd_is_current(path: Path):
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `make crds`"
    assert path.read_text() == render_crd(), f"{path.relative_to(ROOT)} is stale: run `make crds`"


def test_rendering_is_deterministic():
    assert render_crd() == render_crd()
    assert yaml.safe_load(render_crd()) == CRD


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(CRD, "1.33", strict=True)
    assert CRD["metadata"]["name"] == CRD_NAME == "llmengines.serving.kiln.dev"
    names = CRD["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("LLMEngine", "llmengines", ["llme"])
    version = CRD["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Model"] == ".spec.model.source"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Version"] == ".status.servingVersion" and columns["Age"] == ".metadata.creationTimestamp"


def walk(node: dict[str, Any], path: str):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in walk(SCHEMA, ""):
        path = path.lstrip(".")
        assert "type" in node, f"{path}: every node needs a type"
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "const", "title"):
            assert banned not in node, f"{path}: {banned} is not allowed in a structural schema"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties", {}) is not False, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert path in FREE_FORM, f"{path}: unexpected free-form field"
        if "enum" in node:
            kind = {"string": str, "integer": int}[node["type"]]
            assert all(isinstance(v, kind) for v in node["enum"]), path
        if "default" in node:
            jsonschema.validate(node["default"], node)
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), path
        if path.startswith(("spec.", "status.")) and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path}: no description"
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path: Path):
    jsonschema.validate(load_manifest(path).to_k8s(), SCHEMA)


@pytest.mark.parametrize(("field", "value"), [
    ("tensorParallel", 3), ("dtype", "fp32"), ("maxSeqLen", "long"), ("gpu", "H100"),
    ("model", {"source": "gs://bucket/x"}), ("model", {"source": "hf://only-name"}), ("kv", {"blockSize": 12}),
    ("maxBatchSize", 0), ("kv", {"memoryFraction": 1.5}), ("pipelineParallel", 3), ("pipelineParallel", 16),
    ("gpusPerNode", 3), ("gpusPerNode", 0),
    ("speculative", {"method": "eagle"}), ("speculative", {"method": "ngram", "numSpeculativeTokens": 0}),
    ("speculative", {"method": "ngram", "numSpeculativeTokens": 9}), ("speculative", {"promptLookupMax": 9}),
    ("speculative", {"promptLookupMin": 0}),
])
def test_crd_schema_rejects_what_pydantic_rejects(field: str, value: object):
    data = load_manifest(ROOT / "examples/cpu-small.yaml").to_k8s()
    data["spec"][field] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)
    with pytest.raises(ManifestError):
        load_manifest(data)


@pytest.mark.parametrize(("speculative", "field"), [
    ({"method": "eagle"}, "spec.speculative.method"),
    ({"method": "ngram", "numSpeculativeTokens": 9}, "spec.speculative.numSpeculativeTokens"),
    ({"method": "ngram", "numSpeculativeTokens": 0}, "spec.speculative.numSpeculativeTokens"),
    ({"promptLookupMax": 0}, "spec.speculative.promptLookupMax"),
    ({"promptLookupMin": 9}, "spec.speculative.promptLookupMin"),
    ({"promptLookupMin": 3, "promptLookupMax": 2}, "spec.speculative.promptLookupMin"),
    ({"method": "ngram", "numSpeculativeTokens": 4, "draftModel": "x"}, "spec.speculative.draftModel"),
    ({"method": "ngram", "draftModel": {"source": "file:///d"}}, "spec.speculative.draftModel"),
    ({"method": "draft_model"}, "spec.speculative.draftModel"),
    ({"method": "draft_model", "draftModel": {"source": "gs://b/d"}}, "spec.speculative.draftModel.source"),
])
def test_invalid_speculative_values_name_the_field(speculative: dict, field: str):
    data = load_manifest(ROOT / "examples/cpu-small.yaml").to_k8s()
    data["spec"]["speculative"] = speculative
    with pytest.raises(ManifestError) as info:
        load_manifest(data)
    assert any(line.startswith(f"{field}:") for line in info.value.problems), info.value.problems


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """What the API server does on create: defaults top-down, then recurse into what is present."""
    if not isinstance(obj, dict) or "properties" not in schema:
        return obj
    for name, child in schema["properties"].items():
        if name not in obj and "default" in child:
            obj[name] = copy.deepcopy(child["default"])
        if name in obj:
            obj[name] = apply_defaults(child, obj[name])
    return obj


def test_crd_defaults_equal_pydantic_defaults():
    minimal = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "gpu": "L4"}
    assert apply_defaults(SPEC_SCHEMA, copy.deepcopy(minimal)) == LLMEngineSpec.model_validate(minimal).to_k8s()


CEL_SAMPLES = [
    {},
    {"maxInputLen": 1024},
    {"maxInputLen": 1023},
    {"maxNumTokens": 4, "maxBatchSize": 8},
    {"maxNumTokens": 8, "maxBatchSize": 8},
    {"quantization": "fp8", "gpu": "A100-80GB"},
    {"quantization": "fp8", "gpu": "A100-40GB", "maxInputLen": 4096},
    {"quantization": "fp8", "gpu": "L4"},
    {"quantization": "int8", "gpu": "A100-40GB"},
    {"model": {"source": "file:///m", "credentialsSecret": "tok"}},
    {"model": {"source": "pvc://claim/m", "credentialsSecret": "tok"}},
    {"model": {"source": "s3://bucket/m", "credentialsSecret": "tok"}},
    {"model": {"source": "hf://org/m", "credentialsSecret": "tok"}},
    # The replica shape: a tensor-parallel group must fit one node (kiln.skus.shape_problem / SHAPE_RULE).
    {"gpu": "H100-80GB", "tensorParallel": 8, "pipelineParallel": 2},
    {"gpu": "H100-80GB", "tensorParallel": 8, "pipelineParallel": 2, "gpusPerNode": 4},
    {"gpu": "H100-80GB", "tensorParallel": 8, "pipelineParallel": 1, "gpusPerNode": 4},
    {"gpu": "H100-80GB", "tensorParallel": 4, "pipelineParallel": 8, "gpusPerNode": 4},
    {"gpu": "L4", "tensorParallel": 2, "pipelineParallel": 4, "gpusPerNode": 1},
    {"gpu": "A100-40GB", "tensorParallel": 8, "pipelineParallel": 2, "gpusPerNode": 16},
    {"gpu": "cpu", "tensorParallel": 8, "pipelineParallel": 8},
    {"gpu": "cpu", "tensorParallel": 4, "pipelineParallel": 2, "gpusPerNode": 2},
    {"gpu": "cpu", "tensorParallel": 2, "pipelineParallel": 2, "gpusPerNode": 2},
    {"serving": {"autoscaling": {"maxReplicas": 3}}},
    {"serving": {"autoscaling": {"minReplicas": 0, "maxReplicas": 1}}},
    {"serving": {"autoscaling": {"minReplicas": 4, "maxReplicas": 3}}},
    {"serving": {"autoscaling": {"minReplicas": 3, "maxReplicas": 3}, "rolloutStrategy": "RecreateOneAtATime"}},
    # spec.speculative: lookup bounds, and a verified row (1 + k tokens) must fit one step.
    {"speculative": {"method": "ngram"}},
    {"speculative": {"method": "off"}},
    {"speculative": {"method": "ngram", "promptLookupMin": 3, "promptLookupMax": 3}},
    {"speculative": {"method": "ngram", "promptLookupMin": 4, "promptLookupMax": 2}},
    {"speculative": {"method": "off", "promptLookupMin": 4, "promptLookupMax": 2}},
    {"speculative": {"method": "ngram", "numSpeculativeTokens": 8}, "maxNumTokens": 8, "maxBatchSize": 8},
    {"speculative": {"method": "ngram", "numSpeculativeTokens": 7}, "maxNumTokens": 8, "maxBatchSize": 8},
    {"speculative": {"method": "off", "numSpeculativeTokens": 8}, "maxNumTokens": 8, "maxBatchSize": 8},
    {"speculative": {"method": "ngram", "numSpeculativeTokens": 8, "promptLookupMin": 5, "promptLookupMax": 1},
     "maxNumTokens": 8, "maxBatchSize": 8},
    # A draft model is named exactly when the method is draft_model.
    {"speculative": {"method": "draft_model", "draftModel": {"source": "file:///draft.gguf"}}},
    {"speculative": {"method": "draft_model"}},
    {"speculative": {"method": "ngram", "draftModel": {"source": "hf://org/small"}}},
    {"speculative": {"method": "off", "draftModel": {"source": "hf://org/small"}}},
    {"speculative": {"method": "draft_model", "draftModel": {"source": "s3://bucket/d.gguf", "file": "d.gguf"}}},
    {"speculative": {"method": "draft_model", "draftModel": {"source": "hf://o/d", "file": "d.gguf"}}},
    {"speculative": {"method": "draft_model", "draftModel": {"source": "file:///d", "credentialsSecret": "t"}}},
    {"speculative": {"method": "draft_model", "draftModel": {"source": "hf://o/d", "credentialsSecret": "t"}}},
    {"model": {"source": "hf://o/m", "credentialsSecret": "t"},
     "speculative": {"method": "draft_model", "draftModel": {"source": "hf://o/d", "credentialsSecret": "t"}}},
    {"model": {"source": "hf://o/m", "credentialsSecret": "u"},
     "speculative": {"method": "draft_model", "draftModel": {"source": "hf://o/d", "credentialsSecret": "t"}}},
]


@pytest.mark.parametrize("change", CEL_SAMPLES, ids=str)
def test_cel_rules_agree_with_pydantic(change: dict):
    celpy = pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules")
    spec = {**load_manifest(ROOT / "examples/cpu-small.yaml").spec.to_k8s(), **change}
    rules = SPEC_SCHEMA["x-kubernetes-validations"]
    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel(apply_defaults(SPEC_SCHEMA, copy.deepcopy(spec)))}
    failed = [r for r in rules if not bool(env.program(env.compile(r["rule"])).evaluate(activation))]
    try:
        LLMEngineSpec.model_validate(spec)
        python_lines: list[str] = []
    except ValueError as exc:
        from pydantic import ValidationError

        assert isinstance(exc, ValidationError)
        python_lines = validation_error_lines(exc, LLMEngineSpec)
    assert bool(failed) == bool(python_lines), (failed, python_lines)
    # Both name the same fields.
    assert sorted(r["fieldPath"].lstrip(".") for r in failed) == sorted(line.split(":")[0] for line in python_lines)
    for rule in failed:
        assert f"spec{rule['fieldPath']}" in rule["message"]
