"""Models built on several threads at once, as a pool builds its engines: each gets its own quantization and dtype.

Seen in `kiln bench --pool`: a float32 engine loading beside the GGUF engine failed with "down_proj.weight is (576,
1536) torch.float32, the model expects (576, 0) torch.uint8": the linears read one module-wide "born quantized"
setting, and the GGUF build had set it.
"""

from __future__ import annotations

import threading

import torch
from kiln.engine.layers import linear
from kiln.engine.models.registry import create_model
from kiln.engine.random_checkpoint import PRESETS


def test_born_quantized_is_the_building_threads_own():
    inside, built = threading.Event(), threading.Event()

    def gguf_build() -> None:
        with linear.born_quantized("gguf"):
            inside.set()
            built.wait(30)

    other = threading.Thread(target=gguf_build)
    other.start()
    try:
        assert inside.wait(30)
        plain = linear.ColumnParallelLinear(32, 16)  # built here while the other thread is inside its GGUF build
        assert tuple(plain.weight.shape) == (16, 32) and plain.weight.dtype == torch.get_default_dtype()
    finally:
        built.set()
        other.join(30)


def test_models_of_other_quantizations_and_dtypes_built_at_once_are_each_their_own():
    hf_config = {**PRESETS["llama-tiny"], "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    kinds = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "gguf"), (torch.float32, "int8")] * 4
    default, problems = torch.get_default_dtype(), []
    barrier = threading.Barrier(len(kinds))

    def build(dtype: torch.dtype, quant: str | None) -> None:
        barrier.wait(30)
        model = create_model(hf_config, 64, dtype, "cpu", quant)
        weight = model.model.layers[0].mlp.down_proj.weight
        want = {None: (dtype, hf_config["intermediate_size"]), "gguf": (torch.uint8, 0), "int8": (torch.int8, None)}
        wdtype, width = want[quant]
        norm = model.model.norm.weight.dtype
        if weight.dtype != wdtype or (width is not None and weight.shape[1] != width) or norm != dtype:
            problems.append((dtype, quant, weight.dtype, tuple(weight.shape), norm))

    threads = [threading.Thread(target=build, args=kind) for kind in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert problems == [] and torch.get_default_dtype() == default
