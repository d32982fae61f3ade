"""Rules of pools and their names that had two copies keep one home, and everyone who checks them asks it: the
Kubernetes quantity (kiln.memory_budget), the endpoint picker's Service name (kiln.api_base.ServiceName), adapter
names that clash in one server (kiln.pool_api.adapter_name_clashes), the pool's own name (kiln.pool_api)."""

from __future__ import annotations

import re

import pytest
from pydantic import TypeAdapter, ValidationError

from kiln import memory_budget, pool_api
from kiln.api_base import DNS1035_LABEL
from kiln.crd import generate_crd, generate_pool_crd
from kiln.manifest import ManifestError, load_manifest, load_pool

API = "serving.kiln.dev/v1alpha1"
MODEL = {"source": "hf://org/model", "revision": "a" * 40}


def pool(name: str = "shared", **spec) -> dict:
    return {"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": name}, "spec": {"gpu": "cpu", **spec}}


def engine(name: str = "chat", **serving) -> dict:
    return {"apiVersion": API, "kind": "LLMEngine", "metadata": {"name": name},
            "spec": {"model": MODEL, "gpu": "L4", "serving": serving}}


def spec_schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


# -- the quantity ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["6Gi", "512Mi", "8G", "1000", "1.5Gi", "1e9", "1.5e3", "+1Gi", ".5Gi", "1500m",
                                  "6GB", "6 Gi", "-1Gi", "6gi", "6Gi\n", "٦Gi"])
def test_a_pools_memory_budget_is_a_quantity_by_the_one_rule(text):
    """pool_api had a pattern of its own: '1e9', '1.5e3' or '+1Gi' were quantities to the operator and the pool
    server (parse_quantity) and not to the pool's CRD; now the CRD's pattern is the rule's."""
    ruled = memory_budget.QUANTITY.match(text) is not None
    try:
        load_pool(pool(memoryBudget=text))
        taken = True
    except ManifestError:
        taken = False
    assert taken == ruled, text
    schema = spec_schema(generate_pool_crd())["memoryBudget"]
    assert schema["pattern"] == memory_budget.QUANTITY_PATTERN
    assert (re.search(schema["pattern"].replace("$", r"\Z"), text) is not None) == ruled  # Go's $: end of text
    assert getattr(pool_api, "QUANTITY_PATTERN", memory_budget.QUANTITY_PATTERN) is memory_budget.QUANTITY_PATTERN


# -- the endpoint picker's Service name ------------------------------------------------------------------------
def test_an_endpoint_picker_is_a_service_name_in_both_crds():
    from kiln.api_base import MAX_NAME

    engine_routing = spec_schema(generate_crd())["serving"]["properties"]["routing"]["properties"]
    pool_routing = spec_schema(generate_pool_crd())["routing"]["properties"]
    for picker in (engine_routing["endpointPicker"], pool_routing["endpointPicker"]):
        assert (picker["pattern"], picker["maxLength"]) == (DNS1035_LABEL, MAX_NAME)


@pytest.mark.parametrize("picker", ["9-epp", "epp.example", "a" * 64, "Epp"])
def test_an_endpoint_picker_that_cannot_name_a_service_is_refused_for_a_pool_as_for_an_engine(picker):
    """The CRDs took a DNS-1123 label ('9-epp'), the operator checked a DNS-1035 one for an engine only: a pool's
    InferencePool named a Service that cannot exist."""
    with pytest.raises(ManifestError, match=r"spec\.routing\.endpointPicker: must "):
        load_pool(pool(routing={"inferencePool": True, "endpointPicker": picker}))
    with pytest.raises(ManifestError, match=r"spec\.serving\.routing\.endpointPicker: must "):
        load_manifest(engine(routing={"inferencePool": True, "endpointPicker": picker}))


@pytest.mark.parametrize("name", ["shared", "a" * 58, "p9"])
def test_the_default_picker_and_a_given_one_are_held_to_the_same_rule(name):
    from kiln.operator.naming import picker_name, pool_workload_name

    from kiln.api_base import ServiceName

    spec = load_pool(pool(name, routing={"inferencePool": True})).spec
    default = picker_name(spec.routing, pool_workload_name(name))
    assert TypeAdapter(ServiceName).validate_python(default) == default
    given = load_pool(pool(name, routing={"inferencePool": True, "endpointPicker": "my-epp"})).spec
    assert picker_name(given.routing, pool_workload_name(name)) == "my-epp"
    with pytest.raises(ValidationError):
        TypeAdapter(ServiceName).validate_python("9-epp")


# -- adapter names in one server -------------------------------------------------------------------------------
def test_adapter_name_clashes_is_the_one_rule_of_kiln_up_and_the_operator(monkeypatch, tmp_path):
    from kiln.operator import pool_decide

    from kiln import up

    assert pool_decide.adapter_name_clashes is pool_api.adapter_name_clashes
    calls = []

    def spy(engines, adapters):
        calls.append((set(engines), list(adapters)))
        return {}

    monkeypatch.setattr(pool_api, "adapter_name_clashes", spy)
    with_lora = engine()
    with_lora["spec"]["lora"] = {"adapters": [{"name": "sql", "source": "s3://adapters/sql"}]}
    up.check_adapter_names([load_manifest(with_lora)], ["chat.yaml"])
    assert calls and calls[0][0] == {"chat"} and calls[0][1][0][:2] == ("chat", "sql")


def test_adapter_name_clashes():
    rows = [("code", "sql", "v1-sql-a"), ("chat", "sql", "v2-sql-b"), ("chat", "code", "v2-code-c"),
            ("twin", "sql", "v1-sql-a")]  # twin: code's base under another name, the same adapter
    assert pool_api.adapter_name_clashes(["code", "chat", "twin"], rows) == {
        ("chat", "sql"): ("adapter", "code"), ("chat", "code"): ("engine", "code")}


# -- the pool's own name ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["9-pool", "a" * 59])
def test_a_pool_name_the_api_server_refuses_is_refused_by_kiln_up_too(tmp_path, name):
    """The CRD's CEL rule (a DNS-1035 label of at most 58) had its Python twin in the operator only: kiln up served a
    pool manifest that kubectl apply refuses."""
    import yaml

    from kiln.up import read_manifests

    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(pool(name, engines=["chat.yaml"])))
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(engine()))
    with pytest.raises(ManifestError, match=rf"metadata\.name: '{name}' must be a DNS-1035 label of at most 58"):
        read_manifests((path,))


# -- the autoscaler's bounds, a pool's as an engine's ------------------------------------------------------------
@pytest.mark.parametrize(("scaling", "refused"), [
    ({"minReplicas": 5, "maxReplicas": 2}, True), ({"minReplicas": 2, "maxReplicas": 2}, False),
    ({"maxReplicas": 4}, False), ({"minReplicas": 0, "maxReplicas": 1}, False),
])
def test_a_pools_autoscaler_floor_above_its_ceiling_is_refused_as_an_engines(scaling, refused):
    """An engine's minReplicas > maxReplicas was refused (CEL and its Python twin); a pool's was rendered into a
    ScaledObject of minReplicaCount 5, maxReplicaCount 2 by kiln render and the operator, and admitted by its CRD."""
    celpy = pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules")
    from kiln.operator.pools import validate_pool
    from kiln.operator.settings import OperatorConfig
    from kiln.operator.validation import InvalidSpec

    line = "spec.autoscaling.minReplicas: must be at most maxReplicas (5 > 2); lower minReplicas or raise maxReplicas"
    with pytest.raises(ManifestError) if refused else _nothing() as info:
        load_pool(pool(autoscaling=scaling))
    assert not refused or info.value.problems == [line]
    with pytest.raises(InvalidSpec) if refused else _nothing():
        validate_pool("shared", {"autoscaling": scaling}, OperatorConfig())
    env = celpy.Environment()
    full = {"metadata": {"name": "shared"}, "spec": {"autoscaling": {"minReplicas": 1, **scaling}}}  # its default
    rules = generate_pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    failed = [r["fieldPath"] for r in rules if not env.program(env.compile(r["rule"])).evaluate(
        {"self": celpy.json_to_cel(full)})]
    assert failed == ([".spec.autoscaling.minReplicas"] if refused else [])
    with pytest.raises(ManifestError, match=r"spec\.serving\.autoscaling\.minReplicas: must be at most maxReplicas") \
            if refused else _nothing():
        load_manifest(engine(autoscaling=scaling))  # the same rule, the same words, for an engine


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize(("selector", "line"), [
    ({"disk": "fast ssd"}, "spec.nodeSelector: value 'fast ssd' of disk is not a label value"),
    ({"bad key": "x"}, "spec.nodeSelector: key 'bad key' is not a Kubernetes key"),
])
def test_a_pools_node_selector_the_api_server_refuses_in_its_pods_is_refused(selector, line):
    """The pool's Deployment takes spec.nodeSelector as it is: kiln render printed one the API server refuses."""
    with pytest.raises(ManifestError) as info:
        load_pool(pool(nodeSelector=selector))
    assert info.value.problems[0].startswith(line)
    assert load_pool(pool(nodeSelector={"kubernetes.io/arch": "amd64", "pool": ""})).spec.node_selector
