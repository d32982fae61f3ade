"""Every parameter and buffer is created on the model's device, quantized ones included.

The model is built on ``meta``: anything created without the model's device lands on the CPU
instead and shows up here, which is how an int8/fp8 artifact once failed on its first CUDA
forward (``make_quantized_`` allocated the quantized weight on the CPU after the model's
device context had closed). ``build_model`` is driven through both loading paths (an artifact
state dict; a checkpoint quantized at load) with the config's device swapped to ``meta`` after
validation (``EngineConfig`` accepts only cpu and cuda).
"""

from __future__ import annotations

import pytest
import torch
from kiln.engine import parallel
from kiln.engine.artifact import save_rank_weights, shard_checkpoint, weights_file_name
from kiln.engine.config import EngineConfig
from kiln.engine.layers.linear import LinearBase
from kiln.engine.model_runner import build_model
from kiln.engine.models.registry import create_model
from kiln.engine.weights import load_engine_state

# GQA, llama3 rope scaling, qkv bias + tied head, q/k norms, a layer without rotary
PRESETS = ["llama-tiny", "llama3-tiny", "qwen2-tiny", "qwen3-tiny", "smollm3-tiny"]
QUANTIZATIONS = [None, "int8", "fp8"]


def off_device(model: torch.nn.Module, device: str) -> list[str]:
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    return [f"{name} on {t.device}" for name, t in tensors if t.device.type != device]


def config_on_meta(model_dir, **kwargs) -> EngineConfig:
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=1, **kwargs)
    config.device = "meta"
    return config


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_create_model_puts_everything_on_the_device(toy_model, preset, quantization):
    hf_config = EngineConfig(model=str(toy_model(preset)), device="cpu", num_kv_blocks=1).hf_config
    model = create_model(hf_config, 64, torch.bfloat16, "meta", quantization)
    assert off_device(model, "meta") == []
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quantization == quantization for m in linears)
    assert any(name.endswith("cos_cache") for name, _ in model.named_buffers())


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_make_quantized_follows_the_weight_it_replaces(toy_model, quantization):
    """The old bug itself: called after the model's device context closed, the quantized weight
    must still be created where the float weight was."""
    hf_config = EngineConfig(model=str(toy_model()), device="cpu", num_kv_blocks=1).hf_config
    model = create_model(hf_config, 64, torch.float32, "meta")
    for m in model.modules():
        if isinstance(m, LinearBase):
            m.make_quantized_(quantization)
    assert off_device(model, "meta") == []


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_build_model_from_a_quantized_artifact_stays_on_the_device(toy_model, tmp_path, quantization):
    model_dir = toy_model("qwen2-tiny")
    save_rank_weights(shard_checkpoint(model_dir, 1, "float32", quantization), tmp_path)
    model = build_model(config_on_meta(model_dir, quantization=quantization, weights_dir=str(tmp_path)))
    assert off_device(model, "meta") == []
    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, LinearBase)}
    assert dtypes == {{None: torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[quantization]}


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_build_model_quantizing_a_checkpoint_at_load_stays_on_the_device(toy_model, quantization):
    model = build_model(config_on_meta(toy_model("llama3-tiny"), quantization=quantization))
    assert off_device(model, "meta") == []
    assert all(m.quantization == quantization for m in model.modules() if isinstance(m, LinearBase))


def test_sharded_ranks_stay_on_the_device(toy_model, tmp_path):
    """Tensor- and pipeline-parallel shards (each rank's own layers, head and embedding) from an int8 artifact."""
    model_dir = toy_model("llama-tiny")
    save_rank_weights(shard_checkpoint(model_dir, 2, "float32", "int8", pp_size=2), tmp_path, pp_size=2)
    for rank in range(4):
        with parallel.shard_context(rank, 2, 2):
            config = config_on_meta(model_dir, quantization="int8", weights_dir=str(tmp_path),
                                    tensor_parallel_size=2, pipeline_parallel_size=2)
            model = build_model(config)
        assert off_device(model, "meta") == [], rank


def test_artifact_state_dict_loads_into_a_meta_model(toy_model, tmp_path):
    """load_engine_state checks names, shapes and dtypes against the model built for the artifact."""
    model_dir = toy_model("llama-tiny")
    save_rank_weights(shard_checkpoint(model_dir, 1, "float32", "fp8"), tmp_path)
    hf_config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=1).hf_config
    model = create_model(hf_config, 64, torch.float32, "meta", "fp8")
    load_engine_state(model, tmp_path / weights_file_name(0, 1))
    assert off_device(model, "meta") == []
    int8_model = create_model(hf_config, 64, torch.float32, "meta", "int8")
    with pytest.raises(Exception, match="model expects"):
        load_engine_state(int8_model, tmp_path / weights_file_name(0, 1))


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_quantized_model_is_never_allocated_in_full_precision(toy_model, quantization):
    """Linears are born quantized: building float weights first and swapping them would peak at the
    unquantized size on the device (70B fp8 on one 80 GB GPU would not fit its own bf16 copy)."""
    from torch.overrides import TorchFunctionMode

    created: list[tuple[tuple[int, ...], torch.dtype]] = []

    class RecordEmpty(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.empty:
                created.append((tuple(out.shape), out.dtype))
            return out

    hf_config = EngineConfig(model=str(toy_model()), device="cpu", num_kv_blocks=1).hf_config
    with RecordEmpty():
        model = create_model(hf_config, 64, torch.bfloat16, "meta", quantization)
    linear_shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, LinearBase)}
    float_linears = [(shape, dtype) for shape, dtype in created if shape in linear_shapes and dtype.is_floating_point
                     and dtype.itemsize > 1]
    assert linear_shapes and float_linears == []
    assert all(m.quantization == quantization for m in model.modules() if isinstance(m, LinearBase))
