"""spec.lora: rules (pydantic and CEL agree, root rule included), the envelope, the runtime's rank choices."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kiln.artifact_manifest import check_version
from kiln.crd import generate_crd
from kiln.envelope import adapter_version, build_envelope, engine_version
from kiln.lora_options import LORA_RANKS
from kiln.manifest import ManifestError, load_manifest

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def engine(lora=None, **spec):
    data = load_manifest(ROOT / "examples/cpu-small.yaml").to_k8s()
    data["spec"].update(spec)
    if lora is not None:
        data["spec"]["lora"] = lora
    return data


A = {"name": "sql", "source": "hf://org/sql-lora", "revision": "abc"}
B = {"name": "chat", "source": "file:///adapters/chat"}


def test_adapter_list_is_not_in_the_envelope_but_the_slots_are():
    plain = load_manifest(engine()).spec
    none = load_manifest(engine({"maxLoras": 2})).spec
    some = load_manifest(engine({"maxLoras": 2, "adapters": [A, B]})).spec
    assert "lora" not in build_envelope(plain) and engine_version(plain) != engine_version(none)
    assert engine_version(none) == engine_version(some)  # adding adapters never rebuilds the base
    assert build_envelope(some)["lora"] == {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 2}
    explicit = load_manifest(engine({"maxLoras": 2, "maxCpuLoras": 2})).spec
    assert engine_version(explicit) == engine_version(none)  # unset maxCpuLoras is maxLoras
    assert engine_version(load_manifest(engine({"maxLoras": 2, "maxLoraRank": 32})).spec) != engine_version(none)


def test_adapter_versions_name_base_and_adapter_and_follow_source_and_revision():
    spec = load_manifest(engine({"adapters": [A]})).spec
    base = engine_version(spec)
    a = spec.lora.adapters[0]
    version = adapter_version(base, a)
    assert version.startswith(f"{base}-sql-") and check_version(version) == version
    moved = a.model_copy(update={"revision": "def"})
    assert adapter_version(base, moved) != version and adapter_version("other-0123456789ab", a) != version


@pytest.mark.parametrize(("lora", "field"), [
    ({"maxLoraRank": 12}, "spec.lora.maxLoraRank"),
    ({"maxLoras": 4, "maxCpuLoras": 2}, "spec.lora.maxCpuLoras"),
    ({"maxLoras": 16, "maxLoraRank": 512}, "spec.lora.maxLoras"),
    ({"adapters": [A, {**B, "name": "sql"}]}, "spec.lora.adapters"),
    ({"adapters": [{**B, "credentialsSecret": "tok"}]}, "spec.lora.adapters"),
    ({"adapters": [{"name": "x", "source": "gs://b/x"}]}, "spec.lora.adapters[0].source"),
    ({"adapters": [{"name": "cpu-small", "source": "file:///a"}]}, "spec.lora.adapters"),
    ({"adapters": [{"name": "Bad_Name", "source": "file:///a"}]}, "spec.lora.adapters[0].name"),
])
def test_invalid_lora_names_the_field(lora, field):
    with pytest.raises(ManifestError) as info:
        load_manifest(engine(lora))
    assert any(line.startswith(f"{field}:") for line in info.value.problems), info.value.problems
    assert not any("lora.adapters: lora." in line for line in info.value.problems), info.value.problems  # once


def test_rank_choices_are_the_runtimes():
    config = pytest.importorskip("kiln.engine.config")
    assert tuple(config.LORA_RANKS) == LORA_RANKS


SAMPLES = [
    {}, {"maxLoras": 2}, {"maxLoras": 4, "maxCpuLoras": 2}, {"maxLoras": 4, "maxCpuLoras": 4},
    {"maxLoras": 8, "maxLoraRank": 512}, {"maxLoras": 9, "maxLoraRank": 512},
    {"adapters": [A, B]}, {"adapters": [A, {**B, "name": "sql"}]},
    {"adapters": [{**A, "credentialsSecret": "t"}]}, {"adapters": [{**B, "credentialsSecret": "t"}]},
    {"adapters": [{**B, "name": "cpu-small"}]},
]


@pytest.mark.parametrize("lora", SAMPLES, ids=str)
@pytest.mark.parametrize("gpu", ["cpu", "L4"])
def test_cel_rules_agree_with_pydantic_on_lora(lora, gpu):
    celpy = pytest.importorskip("celpy")
    obj = engine(copy.deepcopy(lora), gpu=gpu)
    obj["spec"]["lora"] = {"maxLoras": 1, "maxLoraRank": 16, "adapters": [], **obj["spec"]["lora"]}
    env = celpy.Environment()

    def failed(rules, this):
        act = {"self": celpy.json_to_cel(this)}
        return [r for r in rules if not bool(env.program(env.compile(r["rule"])).evaluate(act))]

    cel = failed(SCHEMA["properties"]["spec"]["x-kubernetes-validations"], obj["spec"])
    cel += failed(SCHEMA["x-kubernetes-validations"], {"metadata": obj["metadata"], "spec": obj["spec"]})
    try:
        load_manifest(obj)
        lines: list[str] = []
    except ManifestError as exc:
        lines = exc.problems
    assert sorted(("spec" + r["fieldPath"]).replace("spec.spec.", "spec.") for r in cel) == sorted(
        line.split(":")[0] for line in lines), (cel, lines)
