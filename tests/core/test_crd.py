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
from kiln.crd import CRD_NAME, CRDS, POOL_CRD_NAME, generate_crd, generate_pool_crd, render_crd
from kiln.manifest import ManifestError, load_manifest, load_pool, validation_error_lines
from kiln.pool_api import LLMEnginePoolSpec

ROOT = Path(__file__).resolve().parents[2]
CRD_DIRS = [ROOT / "crds", ROOT / "helm/kiln/crds"]
COMMITTED = [(folder / file, kind) for folder in CRD_DIRS for kind, (file, _) in CRDS.items()]
CRD = generate_crd()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
# the only places unknown fields are kept: a container's resources, and chat template variables (any JSON value)
FREE_FORM = {"spec.serving.resources", "spec.serving.defaultChatTemplateKwargs"}
POOL_CRD = generate_pool_crd()
POOL_SCHEMA = POOL_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
POOL_FREE_FORM = {"spec.resources", "spec.defaultChatTemplateKwargs"}


@pytest.mark.parametrize(("path", "kind"), COMMITTED, ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path)
                         else v)
def test_committed_crd_is_current(path: Path, kind: str):
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `make crds`"
    assert path.read_text() == CRDS[kind][1](), f"{path.relative_to(ROOT)} is stale: run `make crds`"


@pytest.mark.parametrize("folder", CRD_DIRS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_crd_folders_hold_the_generated_crds_and_nothing_else(folder: Path):
    assert sorted(p.name for p in folder.iterdir()) == sorted(file for file, _ in CRDS.values())


def test_kiln_crd_prints_either_crd():
    from click.testing import CliRunner

    from kiln.commands import crd

    for kind, (_, text) in CRDS.items():
        result = CliRunner().invoke(crd, ["--kind", kind])
        assert result.exit_code == 0 and result.stdout == text(), kind
    assert CliRunner().invoke(crd, []).stdout == render_crd()
    wrong = CliRunner().invoke(crd, ["--kind", "Pool"])
    assert wrong.exit_code == 2 and "LLMEnginePool" in wrong.output


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


@pytest.mark.parametrize(("schema", "free_form"), [(SCHEMA, FREE_FORM), (POOL_SCHEMA, POOL_FREE_FORM)],
                         ids=["LLMEngine", "LLMEnginePool"])
def test_schema_is_structural(schema: dict[str, Any], free_form: set[str]):
    for path, node in walk(schema, ""):
        path = path.lstrip(".")
        assert "type" in node, f"{path}: every node needs a type"
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "const", "title"):
            assert banned not in node, f"{path}: {banned} is not allowed in a structural schema"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties", {}) is not False, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert path in free_form, f"{path}: unexpected free-form field"
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
    # Kubernetes allows only name and generateName under metadata; name is declared so a rule's fieldPath can name it
    assert schema["properties"]["metadata"] == {"type": "object", "properties": {"name": {"type": "string"}}}


def is_pool(path: Path) -> bool:
    return yaml.safe_load(path.read_text()).get("kind") == "LLMEnginePool"


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path: Path):
    if is_pool(path):
        jsonschema.validate(load_pool(path).to_k8s(), POOL_SCHEMA)
    else:
        jsonschema.validate(load_manifest(path).to_k8s(), SCHEMA)


def test_there_is_a_pool_example():
    assert [p.name for p in sorted((ROOT / "examples").glob("*.yaml")) if is_pool(p)] == ["pool-cpu.yaml"]


def test_pool_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(POOL_CRD, "1.33", strict=True)
    assert POOL_CRD["metadata"]["name"] == POOL_CRD_NAME == "llmenginepools.serving.kiln.dev"
    names = POOL_CRD["spec"]["names"]
    assert (names["kind"], names["plural"], names["singular"], names["shortNames"], names["categories"]) == (
        "LLMEnginePool", "llmenginepools", "llmenginepool", ["llmep"], ["kiln"])
    version = POOL_CRD["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}} and version["name"] == CRD["spec"]["versions"][0]["name"]
    columns = {c["name"]: (c["jsonPath"], c.get("priority", 0)) for c in version["additionalPrinterColumns"]}
    assert [name for name, (_, priority) in columns.items() if priority == 0] == [
        "Phase", "Engines", "Budget", "Ready", "Age"]
    assert columns["Engines"][0] == ".status.listedEngines" and columns["Budget"][0] == ".spec.memoryBudget"
    # The API server prints a column's first match only: no column may name every element of a list.
    assert not any("[*]" in path for path, _ in columns.values())
    assert columns["Ready"][0] == '.status.conditions[?(@.type=="Ready")].status'
    # Each column's path is a field of the schema (a renamed field would leave an empty column).
    for path, _ in columns.values():
        node = {"properties": {**POOL_SCHEMA["properties"], "metadata": {"properties": {"creationTimestamp": {}}}}}
        for part in path.split("[")[0].strip(".").split("."):
            node = node["properties"][part] if "properties" in node else node["items"]["properties"][part]


def test_pool_crd_defaults_equal_pydantic_defaults():
    pool_spec = POOL_SCHEMA["properties"]["spec"]
    for minimal in ({}, {"gpu": "L4", "memoryBudget": "6Gi"}):
        assert apply_defaults(pool_spec, copy.deepcopy(minimal)) == LLMEnginePoolSpec.model_validate(minimal).to_k8s()


@pytest.mark.parametrize(("field", "value"), [
    ("memoryBudget", "6 GB"), ("memoryBudget", "-1Gi"), ("replicas", -1), ("loadTimeout", 0), ("gpu", "H100"),
    ("maxLoadedEngines", 0), ("idleUnloadAfter", 0), ("port", 80), ("colour", "red"), ("nodeSelector", {"a": 1}),
])
def test_pool_crd_schema_rejects_what_pydantic_rejects(field: str, value: object):
    data = load_pool(ROOT / "examples/pool-cpu.yaml").to_k8s()
    data["spec"][field] = value
    if field == "colour":  # unknown fields: the API server prunes them (structural schema); pydantic names them
        assert "colour" not in POOL_SCHEMA["properties"]["spec"]["properties"]
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(data, POOL_SCHEMA)
    with pytest.raises(ManifestError) as info:
        load_pool(data)
    assert any(line.startswith((f"spec.{field}:", f"spec.{field}.")) for line in info.value.problems), \
        info.value.problems


@pytest.mark.parametrize(("name", "spec"), [
    ("cpu-pool", {}), ("a" * 58, {}), ("a" * 59, {}), ("9pool", {}), ("pool-", {}), ("p", {"engines": ["a.yaml"]}),
    ("p", {"engines": []}), ("p", {"batchInvariant": True}), ("p", {"gpu": "L4", "batchInvariant": True}),
    ("p", {"gpu": "L4", "batchInvariant": False}),
])
def test_pool_cel_rules_agree_with_the_operator(name: str, spec: dict):
    """The pool CRD refuses at admission what the operator's validate_pool refuses of the name and spec.engines."""
    celpy = pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules")
    from kiln.operator.pools import validate_pool
    from kiln.operator.settings import OperatorConfig
    from kiln.operator.validation import InvalidSpec

    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel({"metadata": {"name": name}, "spec": spec})}
    failed = [r["fieldPath"] for r in POOL_SCHEMA["x-kubernetes-validations"]
              if not bool(env.program(env.compile(r["rule"])).evaluate(activation))]
    try:
        validate_pool(name, spec, OperatorConfig())
        refused = []
    except InvalidSpec as exc:
        refused = [str(exc).split(":")[0]]
    assert [f"{path.lstrip('.')}" for path in failed] == refused


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
    # batchInvariant: CPU engines only (kiln's tactic table)
    {"serving": {"batchInvariant": True}},
    {"gpu": "L4", "serving": {"batchInvariant": True}},
    {"gpu": "L4", "serving": {"batchInvariant": False}},
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
