"""An artifact's weights are the mapped file's pages (``SafetensorsFile(mapped=True)``, ``load_engine_state``):
read as plain reads read them, nothing copied at load, a write to a parameter never reaching the file."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from kiln.engine.errors import ConfigError
from kiln.engine.weights import SafetensorsFile, load_engine_state
from safetensors.torch import save_file


def mapped_ranges(path) -> list[tuple[int, int]]:
    """This process's mappings of ``path`` (/proc/self/maps)."""
    out = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def test_mapped_reads_equal_plain_reads_misaligned_offsets_included(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.u8": torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),  # the next tensors misaligned
               "b.f32": torch.randn(7, 5, generator=g), "c.bf16": torch.randn(3, 64, generator=g).bfloat16(),
               "d.i8": torch.randint(-128, 127, (6, 3), generator=g, dtype=torch.int8), "e.empty": torch.empty(0, 4)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    with SafetensorsFile(path, mapped=True) as mapped, SafetensorsFile(path) as plain:
        for name in tensors:
            got, want = mapped.get_tensor(name), plain.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


def test_a_truncated_mapped_file_is_a_config_error_naming_it(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="m.safetensors is truncated inside tensor 'w'"):
        with SafetensorsFile(path, mapped=True) as f:
            f.get_tensor("w")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 32, bias=False)
        self.norm = torch.nn.Parameter(torch.empty(64))  # a bf16 tensor upcast at load: memory of its own
        for p in self.parameters():
            p.requires_grad_(False)


def test_a_rank_file_s_parameters_are_views_of_the_mapped_file_and_writes_stay_private(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {"proj.weight": torch.randn(32, 64, generator=g), "norm": torch.randn(64, generator=g).bfloat16()}
    path = tmp_path / "rank-0-of-1.safetensors"
    save_file(state, str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    model = Tiny()
    load_engine_state(model, path)
    assert torch.equal(model.proj.weight, state["proj.weight"]) and torch.equal(model.norm, state["norm"].float())
    (header,) = struct.unpack("<Q", path.read_bytes()[:8])
    offset = 8 + header + json.loads(path.read_bytes()[8:8 + header])["proj.weight"]["data_offsets"][0]
    ranges = mapped_ranges(path)
    ptr = model.proj.weight.data_ptr()
    assert any(lo <= ptr < hi for lo, hi in ranges), "the weight was copied, not mapped"
    assert ptr % 4096 == offset % 4096  # the file's own bytes at that tensor's offset
    assert not any(lo <= model.norm.data_ptr() < hi for lo, hi in ranges)  # upcast: its own memory
    model.proj.weight.mul_(2)  # copy-on-write: the engine's page, never the file's
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    del model
    import gc

    gc.collect()
    assert mapped_ranges(path) == []  # the mapping goes with the last tensor of it
