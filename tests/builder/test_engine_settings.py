"""The builder's one spec -> engine settings table, and the pipeline as a list of named stages."""

from __future__ import annotations

import pkgutil
from dataclasses import fields

import kiln.builder.stages
from kiln.builder.engine_settings import ENGINE_SETTINGS, engine_config, spec_value
from kiln.builder.pipeline import STAGES
from kiln.builder.stage_loop import stage_name
from kiln.engine.config import EngineConfig

from kiln.api import LLMEngineSpec


def spec(**extra) -> LLMEngineSpec:
    return LLMEngineSpec.model_validate({"model": {"source": "hf://org/m"}, "gpu": "cpu", "maxBatchSize": 4,
                                         "maxInputLen": 64, "maxSeqLen": 128, "maxNumTokens": 64, **extra})


def test_every_setting_is_a_field_of_the_engine_config():
    names = {f.name for f in fields(EngineConfig)}
    targets = [name for _, name, _ in ENGINE_SETTINGS]
    assert set(targets) <= names, set(targets) - names
    assert len(targets) == len(set(targets)), "one row per EngineConfig field"


def test_every_spec_path_names_a_field_of_the_spec():
    s, s_lora = spec(), spec(lora={"maxLoras": 2})  # optional parts (spec.lora) are read from a spec that sets them
    for path, _, _ in ENGINE_SETTINGS:
        if path is not None:
            head, *rest = path.split(".")
            assert head in type(s).model_fields, path
            if rest:
                assert rest[0] in type(getattr(s_lora, head)).model_fields, path
            assert spec_value(s_lora, path) is not None or path in ("kv_cache_dtype", "lora.max_cpu_loras"), path


def test_engine_config_reads_the_table_with_what_the_build_planned():
    cfg = engine_config(spec(quantization="none"), 7, {"enforce_eager": True})
    assert [name for _, name, _ in ENGINE_SETTINGS] == list(cfg)[:len(ENGINE_SETTINGS)]
    assert cfg["quantization"] is None and cfg["num_kv_blocks"] == 7 and cfg["cuda_graph_batch_sizes"] is None
    assert cfg["tensor_parallel_size"] == 1 and cfg["pipeline_parallel_size"] == 1 and cfg["enforce_eager"] is True
    assert engine_config(spec(quantization="int8"), 7)["quantization"] == "int8"


def test_the_pipeline_is_every_stage_module_once_in_report_order():
    modules = {info.name for info in pkgutil.iter_modules(kiln.builder.stages.__path__)}
    names = [stage_name(stage) for stage, _ in STAGES]
    assert sorted(names) == sorted(modules) and len(names) == len(set(names))
    assert names[0] == "fetch" and names[-2:] == ["package", "publish"]
    assert all(callable(stage.run) for stage, _ in STAGES)


def test_the_adapter_build_is_its_stage_modules_then_the_engines_publish_on_the_same_loop():
    import kiln.builder.adapter.stages
    from kiln.builder.adapter import pipeline as adapter_pipeline
    from kiln.builder.stages import publish

    modules = {info.name for info in pkgutil.iter_modules(kiln.builder.adapter.stages.__path__)}
    names = [stage_name(stage) for stage, _ in adapter_pipeline.STAGES]
    assert sorted(names[:-1]) == sorted(modules) and len(names) == len(set(names))
    assert names[0] == "base" and names[-2:] == ["package", "publish"] and adapter_pipeline.STAGES[-1][0] is publish
    assert adapter_pipeline.run_stages is kiln.builder.pipeline.run_stages
