"""What `kiln render` and the operator refuse, or name, so that every object they apply is one Kubernetes accepts
and every message counts what the pods really ask for: manifests a new user writes (docs/api.md)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from kiln.operator.render import render, render_objects
from kiln.operator.routing import endpoint_picker_name
from kiln.operator.scheduling import INSUFFICIENT_GPU, unschedulable
from kiln.operator.settings import OperatorConfig
from kiln.operator.validation import InvalidSpec, validate_spec
from kiln.operator.workloads import RENDEZVOUS_PORT

from kiln.api_base import DNS1035_LABEL
from kiln.manifest import load_manifest

CONFIG = OperatorConfig(store_uri="s3://kiln-engines/prod", builder_image="kiln:build", serving_image="kiln:serve")
MODEL = {"source": "hf://org/model", "revision": "a" * 40}
MULTI_NODE = {"model": MODEL, "gpu": "H100-80GB", "tensorParallel": 8, "pipelineParallel": 2}


def engine(name: str = "demo", namespace: str | None = None, **spec) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": meta,
            "spec": {"model": MODEL, "gpu": "L4", **spec}}


@pytest.mark.parametrize("name", ["a" * 63, "a-very-long-engine-name-that-goes-on-and-on-and-on-and-on-12345",
                                  "8b-chat", "chat"])
def test_the_default_endpoint_picker_names_a_service_that_can_exist(name):
    """<engine>-epp passed 63 characters for a name over 59, and did not start with a letter for '8b-chat'."""
    manifest = load_manifest(engine(name, serving={"routing": {"inferencePool": True}}))
    pool = next(o for o in render_objects(manifest, CONFIG) if o["kind"] == "InferencePool")
    picker = pool["spec"]["endpointPickerRef"]["name"]
    assert picker == endpoint_picker_name(manifest.spec, name)
    assert len(picker) <= 63 and re.match(DNS1035_LABEL, picker) and picker.endswith("-epp")
    if name == "chat":
        assert picker == "chat-epp"  # short names keep the documented <engine>-epp


def test_an_endpoint_picker_that_cannot_name_a_service_is_refused():
    raw = {"model": MODEL, "gpu": "L4", "serving": {"routing": {"inferencePool": True, "endpointPicker": "9-epp"}}}
    with pytest.raises(InvalidSpec, match=r"^spec\.serving\.routing\.endpointPicker: must be a DNS-1035 label, as a "
                                          r"Service's name is .* \(got '9-epp'\)$"):
        validate_spec(raw, CONFIG)


def test_the_api_port_of_a_multi_node_engine_is_not_the_rendezvous_port():
    """The leader pod would listen on 29500 twice (HTTP and the ranks' rendezvous): the group never starts."""
    with pytest.raises(InvalidSpec, match=r"^spec\.serving\.port: 29500 is the port the ranks .*pick another port"):
        validate_spec({**MULTI_NODE, "serving": {"port": RENDEZVOUS_PORT}}, CONFIG)
    assert validate_spec({**MULTI_NODE, "serving": {"port": 8080}}, CONFIG).serving.port == 8080
    # One pod: no rendezvous port is opened, so 29500 is as good as any.
    assert validate_spec({"model": MODEL, "gpu": "L4", "serving": {"port": RENDEZVOUS_PORT}}, CONFIG)


@pytest.mark.parametrize(("resources", "field"), [
    ({"limits": {"memory": "64GB"}}, "limits.memory: '64GB'"),
    ({"requests": {"cpu": "lots"}}, "requests.cpu: 'lots'"),
    ({"requests": {"cpu": "-2"}}, "requests.cpu: '-2'"),
    ({"limits": {"memory": True}}, "limits.memory: True"),
])
def test_a_resource_quantity_kubernetes_would_not_parse_is_refused(resources, field):
    raw = {"model": MODEL, "gpu": "L4", "serving": {"resources": resources}}
    with pytest.raises(InvalidSpec, match=rf"^spec\.serving\.resources\.{re.escape(field)} is not a Kubernetes "
                                          "quantity; write it as Kubernetes does"):
        validate_spec(raw, CONFIG)


def test_a_pools_resource_quantity_is_checked_as_an_engines():
    from kiln.operator.pools import validate_pool

    with pytest.raises(InvalidSpec, match=r"^spec\.resources\.requests\.cpu: 'lots' is not a Kubernetes quantity"):
        validate_pool("shared", {"resources": {"requests": {"cpu": "lots"}}}, CONFIG)  # the memory limit was read
    assert validate_pool("shared", {"resources": {"requests": {"cpu": "500m"}}}, CONFIG).resources


def test_well_formed_quantities_pass():
    good = {"requests": {"cpu": "500m", "memory": "512Mi", "ephemeral-storage": "1e3"},
            "limits": {"cpu": 8, "memory": "64Gi", "hugepages-2Mi": "0.5G", "nvidia.com/gpu": 1}}
    spec = validate_spec({"model": MODEL, "gpu": "L4", "serving": {"resources": good}}, CONFIG)
    assert spec.serving.resources == good


def test_a_file_adapter_source_is_refused_as_the_model_s_is():
    """The adapter's build Job cannot read a path on the user's machine: refused before a Job is made."""
    raw = {"model": MODEL, "gpu": "L4", "lora": {"adapters": [
        {"name": "tone", "source": "hf://org/tone"}, {"name": "local", "source": "file:///home/me/adapter"}]}}
    with pytest.raises(InvalidSpec, match=r"^spec\.lora\.adapters\[1\]\.source: file:///home/me/adapter is a path "
                                          "on one machine"):
        validate_spec(raw, CONFIG)


def test_render_refuses_a_claim_outside_the_jobs_namespace_as_the_operator_does():
    manifest = load_manifest(engine("pvc", "team-a", model={"source": "pvc://models/llama", "revision": "v1"}))
    with pytest.raises(InvalidSpec, match=r"^spec\.model\.source: pvc://models/llama names a PersistentVolumeClaim"):
        render_objects(manifest, CONFIG)
    assert render_objects(manifest, CONFIG, namespace=CONFIG.jobs_namespace)  # the jobs namespace may


def test_render_refuses_a_namespace_kubernetes_would_not_accept(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("apiVersion: serving.kiln.dev/v1alpha1\nkind: LLMEngine\nmetadata: {name: demo}\n"
                    "spec: {model: {source: hf://org/model}, gpu: L4}\n")
    for ns in ("Prod_NS", "n" * 64):
        result = CliRunner().invoke(render, ["-f", str(path), "-n", ns])
        assert result.exit_code == 2, result.output
        assert f"namespace: {ns!r} is not a namespace name" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("spec", "gpus"), [
    ({"model": MODEL, "gpu": "L4", "pipelineParallel": 8, "gpusPerNode": 2}, 2),
    ({"model": MODEL, "gpu": "A100-80GB", "tensorParallel": 2, "pipelineParallel": 2}, 4),
    (MULTI_NODE, 8),
])
def test_insufficient_gpu_counts_the_gpus_each_pod_requests(spec, gpus):
    """Each pod requests tensorParallel x pipelineParallel GPUs (at most gpusPerNode), not tensorParallel."""
    parsed = validate_spec(spec, CONFIG)
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}
    reason, message = unschedulable([pod], parsed, "v1", CONFIG, None)
    assert reason == INSUFFICIENT_GPU
    assert f"each needs {gpus} {parsed.gpu} GPU(s) (nvidia.com/gpu: {gpus} on" in message
