"""Nothing executable from the store unless verified (issue 38, High 1): the shipped Inductor cache (pickled
graphs, compiled .so kernels) only from a verified artifact, and engine.json's engine_config limited to the
settings a build decides, never a path the engine writes or loads code from."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from kiln.engine import ConfigError
from kiln.engine import compile as kcompile
from kiln.engine.artifact import ARTIFACT_SETTINGS, artifact_engine_config
from test_compile import ENGINE, host_record, make_artifact


def _config(art: Path, **changes) -> None:
    doc = json.loads((art / "engine.json").read_text())
    doc["engine_config"].update(changes)
    (art / "engine.json").write_text(json.dumps(doc))


def test_an_unverified_artifacts_inductor_cache_is_never_used(toy_model, tmp_path, caplog):
    art = make_artifact(toy_model(), tmp_path / "art", host_record())
    with caplog.at_level(logging.WARNING, logger="kiln.engine.compile"):
        config = artifact_engine_config(art)  # kiln serve without --verify-key
    assert config.compile == "off" and config.compile_cache is None
    assert "signature was not verified" in caplog.text and "--verify-key" in caplog.text
    trusted = artifact_engine_config(art, trust_shipped_code=True)
    assert trusted.compile == "inductor" and trusted.compile_cache == str(art / kcompile.CACHE_DIR)


def test_the_cache_path_is_the_artifacts_own_whatever_engine_json_records(toy_model, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    art = make_artifact(toy_model(), tmp_path / "art", host_record())
    doc = json.loads((art / "engine.json").read_text())
    doc["tuning"]["compile"]["cache"] = str(elsewhere)
    (art / "engine.json").write_text(json.dumps(doc))
    config = artifact_engine_config(art, trust_shipped_code=True)
    assert config.compile_cache == str(art / kcompile.CACHE_DIR)
    os.rmdir(art / kcompile.CACHE_DIR)
    os.symlink(elsewhere, art / kcompile.CACHE_DIR)  # a link out of the artifact is not the artifact's
    assert artifact_engine_config(art, trust_shipped_code=True).compile_cache is None


@pytest.mark.parametrize("field, value", [
    ("compile_cache", "/tmp/attacker-cache"), ("tactics_cache", "/etc/cron.d/kiln"), ("tactics", "/tmp/t.json"),
    ("weights_dir", "/"), ("model", "/"), ("distributed_address", "evil:29500"), ("device", "cuda"),
])
def test_engine_json_may_not_set_paths_or_places(toy_model, tmp_path, field, value):
    art = make_artifact(toy_model(), tmp_path / "art", None)
    _config(art, **{field: value})
    with pytest.raises(ConfigError, match=f"engine_config sets {field}, which an artifact may not set.*rebuild"):
        artifact_engine_config(art, trust_shipped_code=True)


def test_a_draft_model_outside_the_artifact_is_refused(toy_model, tmp_path):
    art = make_artifact(toy_model(), tmp_path / "art", None)
    _config(art, speculative_config={"method": "draft_model", "model": "../../somewhere", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative_config.model '../../somewhere' is outside the artifact"):
        artifact_engine_config(art)


def test_every_setting_a_build_writes_is_one_an_artifact_may_set():
    from kiln.builder.engine_settings import ENGINE_SETTINGS

    built = {name for _, name, _ in ENGINE_SETTINGS}
    stages = {"enforce_eager", "compile", "attention_backend", "speculative_config", "tactics_exclude",
              "lm_head_int8"}  # the stages' overrides (tune, compile, tactics, speculative, quality_runtime)
    assert built | stages <= ARTIFACT_SETTINGS
    assert set(ENGINE) <= ARTIFACT_SETTINGS
