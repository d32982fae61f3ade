"""Rules that once had two copies (issue 15) keep one home: each user takes the home's object, and
where the rule has behaviour, both sides behave the same. (Rope types, CUDA-graph buckets, prompt
limits, status history and the reconcile interval are pinned in their own suites.)"""

from __future__ import annotations

import importlib
import pkgutil

import pytest


@pytest.mark.parametrize("temperature", [0.0, 5e-6, 1e-5, 2e-5, 1.0])
def test_greedy_means_the_same_to_the_request_and_the_sampler(temperature):
    from kiln.engine import sampler
    from kiln.engine.sampling_params import SAMPLING_EPS, SamplingParams

    params = SamplingParams(temperature=temperature)
    assert params.is_greedy == (temperature < SAMPLING_EPS)
    assert sampler._is_greedy(params) == params.is_greedy


def test_the_files_packaged_are_the_files_fetched():
    from kiln.builder import checkpoint
    from kiln.builder.stages import package

    assert package.COPIED_FILES is checkpoint.MODEL_FILES
    assert set(checkpoint.MODEL_FILES) <= set(checkpoint.ALLOW_PATTERNS)


def test_the_build_job_sets_the_pvc_root_the_builder_reads(monkeypatch, tmp_path):
    from kiln.builder import local_source
    from kiln.operator import jobs

    from kiln import model_source

    assert jobs.PVC_ROOT_ENV is local_source.PVC_ROOT_ENV is model_source.PVC_ROOT_ENV
    monkeypatch.setenv(model_source.PVC_ROOT_ENV, str(tmp_path))
    assert local_source.pvc_root("claim") == tmp_path / "claim"


def test_every_operator_module_renders_metadata_with_naming_object_meta():
    import kiln.operator
    from kiln.operator import naming

    copies = []
    for info in pkgutil.iter_modules(kiln.operator.__path__):
        module = importlib.import_module(f"kiln.operator.{info.name}")
        for attr, value in vars(module).items():
            if callable(value) and getattr(value, "__name__", "") in {"object_meta", "_meta"} \
                    and value is not naming.object_meta:
                copies.append(f"{info.name}.{attr}")
    assert copies == []
