"""weights.SafetensorsFile: the engine's own safetensors reader (plain reads, no mmap)."""

from __future__ import annotations

import pytest
import torch
from kiln.engine.errors import ConfigError
from kiln.engine.weights import SafetensorsFile
from safetensors import safe_open
from safetensors.torch import save_file


def test_reads_every_tensor_as_safetensors_does(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.f32": torch.randn(7, 5, generator=g),
        "w.bf16": torch.randn(3, 64, generator=g).bfloat16(),
        "w.f16": torch.randn(4, generator=g).half(),
        "w.fp8": torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn),
        "q.i8": torch.randint(-128, 127, (6, 3), generator=g, dtype=torch.int8),
        "ids.i64": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    with SafetensorsFile(path) as f, safe_open(str(path), framework="pt") as ref:
        assert sorted(f.keys()) == sorted(ref.keys())
        for name in ref.keys():
            got, want = f.get_tensor(name), ref.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))  # same bytes


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_file_is_a_config_error_naming_it(tmp_path, damage):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100] if damage == "truncate" else b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ConfigError, match="m.safetensors"):
        with SafetensorsFile(path) as f:
            f.get_tensor("w")
