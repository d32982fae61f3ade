"""`kiln build-adapter`: a PEFT adapter made here on a toy model, checked against the base engine in the store,
cast, gated against transformers + PEFT and published signed under <base>-<name>-<hash>; mismatches exit 2
naming spec.lora.adapters[i].source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from builder_helpers import manifest_dict
from click.testing import CliRunner

from kiln.artifacts import ArtifactStore
from kiln.envelope import adapter_version, build_envelope, engine_version
from kiln.manifest import load_manifest
from kiln.signing import generate_key_pair

pytest.importorskip("peft")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapter(model_dir: Path, out: Path, r: int = 8, targets: list[str] = ATTN) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    model.save_pretrained(out)
    return out


@pytest.fixture
def setup(tmp_path: Path, toy_model):
    model = toy_model("llama-tiny")
    adapters = {"sql": make_adapter(model, tmp_path / "sql"), "wide": make_adapter(model, tmp_path / "wide", r=32)}
    spec = {"lora": {"maxLoras": 2, "maxLoraRank": 16, "adapters": [
        {"name": n, "source": f"file://{p}", "revision": "v1"} for n, p in adapters.items()]}}
    data = manifest_dict(f"file://{model}", **spec)
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    engine = load_manifest(path)
    private, _ = generate_key_pair(tmp_path / "keys")
    store_uri = f"file://{tmp_path / 'store'}"
    base = tmp_path / "base-artifact"  # the base engine as published: its config.json is what adapters check
    base.mkdir()
    shutil.copy(model / "config.json", base / "config.json")
    (base / "engine.json").write_text(json.dumps({"engine_version": engine_version(engine.spec)}))
    from kiln.signing import signer_from

    ArtifactStore.from_uri(store_uri).publish(engine_version(engine.spec), base, build_envelope(engine.spec),
                                              signer=signer_from(private))
    return path, engine, store_uri, private, tmp_path


def run(path: Path, name: str, store_uri: str, key: Path, work: Path):
    from kiln.builder.adapter.command import build_adapter_command

    return CliRunner().invoke(build_adapter_command, ["-f", str(path), "--adapter", name, "--store", store_uri,
                                                      "--signing-key", str(key), "--work-dir", str(work)])


def test_adapter_builds_into_its_own_signed_version_and_hits_the_cache(setup, monkeypatch):
    path, engine, store_uri, key, tmp = setup
    monkeypatch.setenv("KILN_TERMINATION_LOG", str(tmp / "term"))
    result = run(path, "sql", store_uri, key, tmp / "work")
    assert result.exit_code == 0, result.output
    version = adapter_version(engine_version(engine.spec), engine.spec.lora.adapters[0])
    assert version.startswith(engine_version(engine.spec) + "-sql-") and f"built: {version}" in result.output
    store = ArtifactStore.from_uri(store_uri)
    manifest, document = store.read_signed_manifest(version)
    assert manifest.envelope["kind"] == "lora-adapter" and document["signature"]
    assert {f.path for f in manifest.files} == {"adapter.json", "adapter_config.json", "adapter_model.safetensors"}
    out = store.fetch(version, tmp / "fetched")
    report = json.loads((out / "adapter.json").read_text())
    assert report["quality"]["passed"] and report["quality"]["token_agreement"] >= 0.99
    q = report["quality"]  # kiln's engine with the converted adapter agrees with transformers + PEFT
    assert q["runtime"].startswith("kiln LLM") and q["runtime_token_agreement"] >= 0.99 and report["rank"] == 8
    assert set(report["stage_seconds"]) == {"base", "fetch", "check", "convert", "fetch_base", "gate"}
    assert report["kind"] == "lora-adapter" and report["base_engine_version"] == engine_version(engine.spec)
    from peft import PeftModel  # the published files are a PEFT directory
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(engine.spec.model.source[7:]), out)
    again = run(path, "sql", store_uri, key, tmp / "work2")
    assert again.exit_code == 0 and f"cache hit: {version}" in again.output


def test_rank_above_max_lora_rank_fails_naming_the_field(setup, monkeypatch):
    path, engine, store_uri, key, tmp = setup
    monkeypatch.setenv("KILN_TERMINATION_LOG", str(tmp / "term"))
    result = run(path, "wide", store_uri, key, tmp / "work")
    assert result.exit_code == 2, result.output
    assert "spec.lora.adapters[1].source: rank 32 > maxLoraRank 16" in result.output
    assert "rank 32 > maxLoraRank 16" in (tmp / "term").read_text()


def test_modules_the_engine_lacks_and_foreign_shapes_fail(setup, toy_model, tmp_path):
    from kiln.builder.adapter.peft_files import check_adapter
    from kiln.builder.errors import InvalidSpec

    _, engine, _, _, tmp = setup
    adapter = make_adapter(toy_model("llama-tiny"), tmp / "lmhead", targets=["q_proj"])
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"],
                                                             "use_dora": True}))
    base_cfg = json.loads((Path(engine.spec.model.source[7:]) / "config.json").read_text())
    with pytest.raises(InvalidSpec) as info:
        check_adapter(adapter, base_cfg, 16, "spec.lora.adapters[0].source")
    assert "target_modules ['lm_head']: the engine has no such module" in str(info.value)
    assert "DoRA" in str(info.value) and str(info.value).startswith("spec.lora.adapters[0].source: ")
    bigger = {**base_cfg, "hidden_size": base_cfg["hidden_size"] * 2}
    with pytest.raises(InvalidSpec, match="does not fit the base"):
        check_adapter(make_adapter(toy_model("llama-tiny"), tmp / "ok"), bigger, 16, "f")


def test_no_adapter_of_that_name_is_exit_2(setup, monkeypatch):
    path, _, store_uri, key, tmp = setup
    monkeypatch.setenv("KILN_TERMINATION_LOG", str(tmp / "term"))
    result = run(path, "nope", store_uri, key, tmp / "work")
    assert result.exit_code == 2 and "--adapter: no adapter named 'nope'" in result.output
    # The store by the names every command reads (kiln.artifacts.store_from_env), as kiln build takes it.
    from kiln.builder.adapter.command import build_adapter_command

    result = CliRunner().invoke(build_adapter_command, ["-f", str(path), "--adapter", "x"],
                                env={"KILN_STORE_URI": store_uri, "KILN_STORE": f"{store_uri}-other"})
    assert result.exit_code == 2 and "name different artifact stores" in result.output
