"""The shard stage writes each rank's file as it is built and holds one rank at a time.

The files must hold what the old way wrote (every rank built, then all written:
``save_rank_weights(shard_checkpoint(...))``): the same header (tensor names, dtypes, shapes, offsets,
metadata) and the same data bytes. Byte for byte the files differ only in the order of the header's
``__metadata__`` keys, which safetensors writes from a randomly seeded hash map (two calls of the
old code differ the same way); and no tensor of rank r may be alive when rank r+1
is built (weak references to every tensor written, checked at each ``build_model``).
"""

from __future__ import annotations

import json
import struct
import weakref
from pathlib import Path

import pytest
from kiln.engine import artifact
from kiln.engine.artifact import save_rank_weights, shard_checkpoint, write_rank_weights


def _parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@pytest.mark.parametrize(("tp", "pp", "dtype", "quantization"), [
    (2, 1, "float32", "int8"), (2, 2, "bfloat16", None), (1, 2, "float32", "fp8")])
def test_streamed_shards_equal_the_all_at_once_files(toy_model, tmp_path, monkeypatch, tp, pp, dtype, quantization):
    model = toy_model("llama-tiny")
    reference = save_rank_weights(shard_checkpoint(model, tp, dtype, quantization, pp_size=pp), tmp_path / "old",
                                  pp_size=pp)

    written_refs: list[weakref.ref] = []
    builds = []
    from kiln.engine import model_runner

    real_build, real_save = model_runner.build_model, artifact._save_rank

    def build(config):
        builds.append([r for r in written_refs if r() is not None])  # what earlier ranks still hold
        return real_build(config)

    def save(state, out, rank, size, pp_size):
        written_refs.extend(weakref.ref(t) for t in state.values())
        return real_save(state, out, rank, size, pp_size)

    monkeypatch.setattr(model_runner, "build_model", build)
    monkeypatch.setattr(artifact, "_save_rank", save)
    streamed = write_rank_weights(model, tmp_path / "new", tp, dtype, quantization, pp_size=pp)

    assert [p.name for p, _ in streamed] == [p.name for p in reference]
    for (new, num_tensors), old in zip(streamed, reference, strict=True):
        (new_header, new_data), (old_header, old_data) = _parts(new), _parts(old)
        assert new_header == old_header and new_data == old_data, new.name
        assert new.stat().st_size == old.stat().st_size
        assert num_tensors > 0
    assert len(builds) == tp * pp and builds[0] == []
    assert all(alive == [] for alive in builds), "a rank's tensors were alive while the next rank was built"
