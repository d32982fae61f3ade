"""LLMEngine API types: round trips, defaults, and rejections whose messages name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kiln import api
from kiln.api import LLMEngine, LLMEngineSpec
from kiln.engine_status import LLMEngineStatus, Phase, add_to_history
from kiln.manifest import ManifestError, _model_in, load_manifest, load_spec
from kiln.skus import GPU_SKUS, gpus_per_node, replica_shape, shape_problem

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if "\nkind: LLMEnginePool" not in p.read_text())


def manifest(**spec: object) -> dict:
    base = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "gpu": "H100-80GB"}
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "demo"},
            "spec": {**base, **spec}}


def problems(data: object) -> list[str]:
    with pytest.raises(ManifestError) as info:
        load_manifest(data)
    assert "Traceback" not in str(info.value) and "pydantic" not in str(info.value)
    return str(info.value).splitlines()


def test_examples_exist_and_load():
    names = {p.name for p in EXAMPLES}
    assert {"cpu-small.yaml", "llama-3.1-8b-h100-fp8.yaml", "llama-3.1-70b-4xh100.yaml",
            "qwen2-7b-l40s-int8.yaml"} <= names
    for path in EXAMPLES:
        engine = load_manifest(path)
        assert engine.kind == "LLMEngine" and engine.metadata.name


def test_cpu_example_is_a_small_cpu_engine():
    spec = load_manifest(ROOT / "examples/cpu-small.yaml").spec
    assert spec.gpu == "cpu" and spec.dtype in ("float32", "bfloat16")
    assert spec.model.source == "file://./.kiln-work/models/llama-demo"
    assert spec.max_seq_len <= 2048  # the llama-demo preset's max_position_embeddings


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_round_trip_through_k8s_dict_and_yaml(path: Path):
    engine = load_manifest(path)
    as_k8s = engine.to_k8s()
    assert LLMEngine.model_validate(as_k8s) == engine
    assert load_manifest(yaml.safe_dump(as_k8s)) == engine
    # The operator validates the spec dict the API server stores, camelCase and all.
    assert LLMEngineSpec.model_validate(as_k8s["spec"]) == engine.spec
    assert engine.spec.model_dump(by_alias=True, exclude_none=True, mode="json") == as_k8s["spec"]


def test_snake_case_and_camel_case_are_both_accepted():
    camel = LLMEngineSpec.model_validate(manifest(maxSeqLen=8192, kv={"blockSize": 32})["spec"])
    snake = LLMEngineSpec(model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, gpu="H100-80GB",
                          max_seq_len=8192, kv={"block_size": 32})
    assert camel == snake and snake.max_seq_len == 8192 and snake.kv.block_size == 32


def test_defaults_fill_a_minimal_spec():
    spec = load_manifest(manifest()).spec
    assert (spec.dtype, spec.quantization, spec.kv_cache_dtype, spec.tensor_parallel) == ("bfloat16", "none",
                                                                                           "auto", 1)
    assert spec.resolved_kv_cache_dtype == "bfloat16"
    assert spec.kv.block_size == 16 and spec.kv.enable_prefix_caching and spec.serving.replicas == 1
    assert spec.build.quality_gate.max_kl_divergence > 0 and spec.max_input_len < spec.max_seq_len


def test_every_field_has_a_description():
    def walk(model: type) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            inner = _model_in(field.annotation)
            if inner is not None:
                walk(inner)
    walk(LLMEngineSpec)
    walk(LLMEngineStatus)


@pytest.mark.parametrize(("spec", "expected"), [
    ({"tensorParallel": 3}, "spec.tensorParallel: must be one of 1, 2, 4, 8 (got 3)"),
    ({"maxInputLen": 4096, "maxSeqLen": 4096}, "spec.maxInputLen: must be less than maxSeqLen"),
    ({"maxNumTokens": 16, "maxBatchSize": 32}, "spec.maxNumTokens: must be at least maxBatchSize"),
    ({"kv": {"blockSize": 12}}, "spec.kv.blockSize: must be one of 1, 2, 4, 8, 16, 32, 64, 128, 256 (got 12)"),
    ({"maxSeqLen": "long"}, "spec.maxSeqLen: must be an integer (got 'long')"),
    ({"maxSeqlen": 4096}, "spec.maxSeqlen: unknown field; did you mean maxSeqLen?"),
    ({"frobnicate": True}, "spec.frobnicate: unknown field; remove it (allowed: model, gpu,"),
    ({"gpu": "H100"}, "spec.gpu: must be one of cpu, L4, L40S, A100-40GB, A100-80GB, H100-80GB, H200-141GB"),
    ({"dtype": "fp32"}, "spec.dtype: must be one of bfloat16, float16, float32 (got 'fp32')"),
    ({"quantization": "fp8", "gpu": "A100-80GB"}, "spec.quantization: fp8 needs a GPU with FP8 support"),
    ({"model": {"source": "hf://llama"}}, "spec.model.source: malformed hf:// source 'hf://llama'"),
    ({"model": {"source": "gs://bucket/x"}}, "spec.model.source: unsupported model source 'gs://bucket/x'"),
    ({"model": {"source": "file://relative"}}, "spec.model.source: malformed file:// source"),
    ({"model": {"source": "s3://B/x"}}, "spec.model.source: malformed s3:// source"),
    ({"model": {"source": "file://./models/tiny a"}}, "spec.model.source: malformed file:// source 'file://./models/"
                                                       "tiny a'; expected file:///absolute/path or file://./relative/"
                                                       "path; it holds whitespace, which a source may not"),
    ({"model": {"source": "hf://org/name\n"}}, "spec.model.source: malformed hf:// source"),  # `source: |`
    ({"model": {"source": "file:///m", "credentialsSecret": "tok"}}, "spec.model.credentialsSecret: only used"),
    ({"model": {}}, "spec.model.source: required field is missing"),
    ({"serving": {"replicas": -1}}, "spec.serving.replicas: must be >= 0 (got -1)"),
    ({"serving": {"resources": {"limit": {}}}}, "spec.serving.resources: unknown key(s) limit"),
    ({"kv": {"memoryFraction": 1.5}}, "spec.kv.memoryFraction: must be <= 0.98 (got 1.5)"),
    ({"build": {"calibrationPrompts": [1]}}, "spec.build.calibrationPrompts[0]: must be a string (got 1)"),
    ({"build": {"qualityGate": {"minTokenAgreement": 2}}}, "spec.build.qualityGate.minTokenAgreement: must be <="),
])
def test_rejections_name_the_field(spec: dict, expected: str):
    lines = problems(manifest(**spec))
    assert any(line.startswith(expected) for line in lines), lines


def test_one_line_per_problem():
    lines = problems(manifest(tensorParallel=3, dtype="fp32", kv={"blockSize": 3}))
    assert len(lines) == 3 and {line.split(":")[0] for line in lines} == {
        "spec.tensorParallel", "spec.dtype", "spec.kv.blockSize"}


def test_metadata_and_kind_are_checked():
    data = manifest()
    data["kind"], data["metadata"]["name"] = "Deployment", "Not_A_Name"
    lines = problems(data)
    assert any(line.startswith("kind: must be one of LLMEngine") for line in lines)
    assert any(line.startswith("metadata.name: must be a DNS-1123 label") for line in lines)


def test_the_other_kind_is_one_line_and_a_number_where_text_goes_says_quote_it():
    from kiln.manifest import load_pool

    pool = {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool", "metadata": {"name": "p"},
            "spec": {"replicas": 1, "memoryBudget": "4Gi"}}
    with pytest.raises(ManifestError) as err:
        load_manifest(yaml.safe_dump(pool))
    assert err.value.problems == [err.value.problems[0]] and err.value.problems[0].startswith(
        "kind: LLMEnginePool where an LLMEngine is expected; give an LLMEngine manifest")
    with pytest.raises(ManifestError, match="kind: LLMEngine where an LLMEnginePool is expected"):
        load_pool(manifest())
    data = yaml.safe_load(yaml.safe_dump(manifest()).replace("source:", "revision: 20240101\n    source:", 1))
    assert problems(data) == ["spec.model.revision: must be a string (got 20240101); quote it in YAML so it "
                              "stays text as written"]


@pytest.mark.parametrize("source", [
    "hf://meta-llama/Llama-3.1-8B-Instruct", "hf://Qwen/Qwen2-7B-Instruct", "s3://models/llama/v1",
    "s3://models", "file:///models/llama", "file://./.kiln-work/models/x", "file://../models/x",
    "pvc://model-cache/llama/3.1", "pvc://model-cache",
])
def test_accepted_sources(source: str):
    assert load_manifest(manifest(model={"source": source})).spec.model.source == source


def test_fp8_is_allowed_on_fp8_gpus_and_on_cpu_reference_path():
    for gpu, spec in GPU_SKUS.items():
        accepted = spec.is_cpu or float(spec.compute_capability) >= 8.9
        try:
            load_manifest(manifest(gpu=gpu, quantization="fp8"))
            assert accepted, gpu
        except ManifestError as exc:
            assert not accepted, (gpu, str(exc))


def test_cpu_allows_tensor_parallel():
    assert load_manifest(manifest(gpu="cpu", tensorParallel=2)).spec.tensor_parallel == 2


def test_gpu_table():
    assert set(GPU_SKUS) == {"cpu", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"}
    for name, gpu in GPU_SKUS.items():
        if gpu.is_cpu:
            assert gpu.memory_gib is None and gpu.product_label is None
            continue
        major, minor = gpu.compute_capability.split(".")
        assert gpu.arch == f"sm{major}{minor}" and gpu.memory_gib > 0
        assert gpu.product_label.startswith("NVIDIA-"), name


def test_load_from_path_text_and_yaml_errors(tmp_path: Path):
    text = yaml.safe_dump(manifest())
    path = tmp_path / "m.yaml"
    path.write_text(text)
    assert load_manifest(path) == load_manifest(str(path)) == load_manifest(text)
    lines = problems("kind: LLMEngine\nspec:\n  gpu: cpu\n  model: source: x\n")
    assert lines == ["line 4, column 16: invalid YAML (mapping values are not allowed here); fix the syntax there"]
    assert problems(str(tmp_path / "missing.yaml"))[0].endswith("check the path")
    assert "found 0" in problems("")[0]
    assert problems("- a\n- b\n")[0].startswith("manifest: must be a mapping")


def test_multi_document_file_picks_the_llmengine():
    other = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}
    text = yaml.safe_dump(other) + "---\n" + yaml.safe_dump(manifest())
    assert load_manifest(text).metadata.name == "demo"


def test_status_round_trip_and_bounded_history():
    raw = {
        "phase": "Ready", "engineVersion": "v1", "servingVersion": "v1", "artifactURI": "s3://b/engines/v1",
        "endpoint": "http://demo.default.svc:8000", "observedGeneration": 3,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Serving", "message": "ok",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 3}],
        "history": [{"engineVersion": "v1", "artifactURI": "s3://b/engines/v1", "builtAt": "2026-01-01T00:00:00Z"}],
    }
    status = LLMEngineStatus.model_validate(raw)
    assert status.phase == Phase.READY == "Ready" and status.conditions[0].status == "True"
    assert status.to_k8s() == raw
    history = raw["history"]
    for i in range(2, 16):
        history = add_to_history(history, {"engineVersion": f"v{i}", "artifactURI": f"u{i}"})
    assert [e.engine_version for e in LLMEngineStatus.model_validate({**raw, "history": history}).history] == [
        f"v{i}" for i in range(15, 5, -1)]
    with pytest.raises(ValueError):
        LLMEngineStatus.model_validate({**raw, "history": raw["history"] * 11})
    with pytest.raises(ValueError):
        LLMEngineStatus.model_validate({"conditions": [{"type": "Ready", "status": "Yes"}]})


def test_status_pool_round_trips_and_names_a_state_of_the_pool_s_list():
    raw = {"phase": "Failed", "pool": {"name": "shared", "state": "Refused", "message": "needs 9.0 GiB"}}
    status = LLMEngineStatus.model_validate(raw)
    assert status.pool is not None and status.pool.state == "Refused" and status.to_k8s()["pool"] == raw["pool"]
    assert LLMEngineStatus.model_validate({"pool": {"name": "shared"}}).pool.state is None  # no entry yet
    with pytest.raises(ValueError, match="state"):
        LLMEngineStatus.model_validate({"pool": {"name": "shared", "state": "Loaded"}})
    assert "pool" not in LLMEngineStatus.model_validate({"phase": "Ready"}).to_k8s()


def test_load_spec_names_fields_under_spec():
    raw = manifest(tensorParallel=3, maxInputLen=9000)["spec"]
    with pytest.raises(ManifestError) as info:
        load_spec(raw)
    assert str(info.value).splitlines() == ["spec.tensorParallel: must be one of 1, 2, 4, 8 (got 3)"]
    raw["tensorParallel"] = 2
    with pytest.raises(ManifestError, match=r"^spec\.maxInputLen: must be less than maxSeqLen \(9000 >= 4096\)"):
        load_spec(raw)
    with pytest.raises(ManifestError, match=r"^spec: must be a mapping \(got list\)$"):
        load_spec([])
    assert load_spec(manifest()["spec"]).gpu == "H100-80GB"


def test_status_tolerates_keys_other_writers_leave():
    status = LLMEngineStatus.model_validate({"phase": "Pending", "kopf": {"progress": {}}})
    assert status.phase == "Pending" and "kopf" not in status.to_k8s()


# (gpu, tensorParallel, pipelineParallel, gpusPerNode) -> (pods per replica, ranks (GPUs) per pod), or None: invalid.
SHAPES = [
    ("H100-80GB", 1, 1, None, (1, 1)),
    ("H100-80GB", 8, 1, None, (1, 8)),
    ("H100-80GB", 2, 2, None, (1, 4)),      # pipeline parallel inside one node: still one pod
    ("H100-80GB", 8, 2, None, (2, 8)),      # Llama 3.1 405B on 2 x 8 x H100: one stage per node
    ("H100-80GB", 4, 4, None, (2, 8)),      # two 4-GPU stages per node
    ("H100-80GB", 8, 8, None, (8, 8)),
    ("H200-141GB", 8, 2, 4, None),          # a stage of 8 cannot sit on 4-GPU nodes
    ("H100-80GB", 4, 2, 4, (2, 4)),
    ("L4", 1, 8, 1, (8, 1)),
    ("A100-40GB", 8, 2, 16, (1, 16)),       # 16-GPU nodes (a2-megagpu-16g): one pod
    ("cpu", 4, 4, None, (1, 16)),           # cpu: every rank in one pod unless gpusPerNode says otherwise
    ("cpu", 2, 2, 2, (2, 2)),
    ("cpu", 4, 1, 2, None),
]


@pytest.mark.parametrize(("gpu", "tp", "pp", "per_node", "expected"), SHAPES, ids=str)
def test_pods_per_replica_is_ranks_over_gpus_per_node_and_stages_never_split(gpu, tp, pp, per_node, expected):
    raw = {"model": {"source": "hf://org/m"}, "gpu": gpu, "tensorParallel": tp, "pipelineParallel": pp,
           **({"gpusPerNode": per_node} if per_node else {})}
    if expected is None:
        assert shape_problem(gpu, tp, pp, per_node) is not None
        with pytest.raises(ManifestError) as err:
            load_spec(raw)
        (line,) = err.value.problems
        assert line.startswith("spec.tensorParallel: ") and "gpusPerNode" in line and "pipelineParallel" in line
        with pytest.raises(ValueError, match="tensorParallel"):
            replica_shape(gpu, tp, pp, per_node)
        return
    shape = load_spec(raw).replica_shape
    assert (shape.pods, shape.ranks_per_pod) == expected
    assert shape.pods * shape.ranks_per_pod == tp * pp == shape.world_size
    assert shape.ranks_per_pod % tp == 0 or shape.pods == 1  # a pod holds whole stages
    assert shape.multi_node == (shape.pods > 1)


def test_gpus_per_node_comes_from_the_sku_table():
    assert {sku: g.gpus_per_node for sku, g in GPU_SKUS.items()} == {
        "cpu": None, "L4": 8, "L40S": 8, "A100-40GB": 8, "A100-80GB": 8, "H100-80GB": 8, "H200-141GB": 8}
    assert gpus_per_node("H100-80GB") == 8 and gpus_per_node("H100-80GB", 4) == 4 and gpus_per_node("cpu") is None
