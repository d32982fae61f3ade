"""Models built on several threads at once, as a pool builds its engines: each gets its own quantization and dtype.

Seen in `kiln bench --pool`: a float32 engine loading beside the GGUF engine failed with "down_proj.weight is (576,
1536) torch.float32, the model expects (576, 0) torch.uint8": the linears read one module-wide "born quantized"
setting, and the GGUF build had set it. A build also set torch's process-wide default dtype for its while.
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


HF_CONFIG = {**PRESETS["llama-tiny"], "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def test_a_build_leaves_the_other_threads_default_dtype_alone(monkeypatch):
    """While a bfloat16 model is built, a step on another thread still makes float32 tensors without a dtype."""
    from kiln.engine.layers import norm

    inside, done, real = threading.Event(), threading.Event(), norm.RMSNorm.__init__

    def held_init(self, *args, **kwargs) -> None:
        real(self, *args, **kwargs)
        if not inside.is_set():  # the first norm of the build: hold the build here
            inside.set()
            done.wait(30)

    monkeypatch.setattr(norm.RMSNorm, "__init__", held_init)
    built: list = []
    build = threading.Thread(target=lambda: built.append(create_model(HF_CONFIG, 64, torch.bfloat16, "cpu")))
    build.start()
    try:
        assert inside.wait(30)
        assert torch.get_default_dtype() == torch.float32 and torch.zeros(1).dtype == torch.float32
    finally:
        done.set()
        build.join(30)
    assert built and built[0].model.norm.weight.dtype == torch.bfloat16


def test_models_of_other_quantizations_and_dtypes_built_at_once_are_each_their_own():
    hf_config = HF_CONFIG
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
