"""Load safetensors into a model, each parameter copying its own tensor-parallel shard.

Two sources:

- a Hugging Face checkpoint (``*.safetensors``, full tensors, checkpoint names):
  each tensor name is mapped through the model's ``packed_modules`` to a fused
  parameter plus shard id, and that parameter's ``weight_loader`` copies the
  slice this rank owns;
- an engine state dict (per-rank artifact file, engine names, already sharded
  and possibly quantized): copied as is.

Only safetensors are read; pickled ``.bin`` checkpoints are refused.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch
from kiln.engine.errors import ConfigError
from torch import nn

# safetensors dtype names -> torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsFile:
    """A safetensors file read one tensor at a time, never a second copy of the whole file.

    Two ways, both holding the model plus at most the one tensor being copied: ``safetensors.torch.load_file``
    (what an artifact's weights were read with) builds the whole state dict first (llama-bench bf16: 479 vs
    308 MiB peak over the process's base; for an 8B bf16 model ~16 GB).

    - ``mapped=False`` (a checkpoint, whose tensors are sliced and cast into the model's own): plain ``read``s
      into each tensor's own memory; nothing of the file stays mapped.
    - ``mapped=True`` (an artifact's rank file, whose tensors are the parameters as they are): each tensor is a
      view of a private mapping of the file (copy-on-write: a write never reaches the file), so loading copies
      nothing and the weights' pages are the page cache's, shared by every engine of that file; the mapping goes
      when the last tensor of it does. A tensor whose offset is not a multiple of its element size is read."""

    def __init__(self, path: Path, mapped: bool = False) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "rb")  # closed by close() / the context manager
        try:
            (size,) = struct.unpack("<Q", self._fh.read(8))
            header = json.loads(self._fh.read(size))
            self.metadata = header.pop("__metadata__", None) or {}
            self._tensors = {name: (info["dtype"], info["shape"], info["data_offsets"]) for name, info in header.items()}
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._fh.close()
            raise ConfigError(f"{self.path} is not a readable safetensors file ({exc}); rebuild or re-download it") from exc
        self._base = 8 + size
        self._map = _map_file(self._fh) if mapped else None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._fh.close()
        self._map = None  # the mapping lives on in the tensors viewing it, and goes with the last of them

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        dtype_name, shape, (start, end) = self._tensors[name]
        if dtype_name not in _DTYPES:
            raise ConfigError(f"{self.path}: tensor {name!r} has dtype {dtype_name}, which kiln does not load")
        tensor = torch.empty(shape, dtype=_DTYPES[dtype_name])
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != end - start:
            raise ConfigError(f"{self.path}: tensor {name!r} spans {end - start} bytes, {nbytes} expected for "
                              f"{dtype_name} {shape}; the file is corrupt: rebuild or re-download it")
        if nbytes and self._map is not None and (self._base + start) % tensor.element_size() == 0:
            if self._base + end > len(self._map):
                raise ConfigError(f"{self.path} is truncated inside tensor {name!r}: rebuild or re-download it")
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=self._base + start)
            return raw.view(tensor.dtype).view(tensor.shape)
        if nbytes:
            self._fh.seek(self._base + start)
            if self._fh.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != nbytes:
                raise ConfigError(f"{self.path} is truncated inside tensor {name!r}: rebuild or re-download it")
        return tensor


def _map_file(fh) -> mmap.mmap | None:
    """A private (copy-on-write) mapping of the whole file; None for an empty file."""
    size = os.fstat(fh.fileno()).st_size
    return mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) if size else None


def checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in Path(model_dir).glob("*.bin")] + [p.name for p in Path(model_dir).glob("*.pt")]
        hint = f" (found pickled {', '.join(pickled)}; convert them to safetensors)" if pickled else ""
        raise ConfigError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def load_checkpoint(model: nn.Module, model_dir: Path) -> None:
    """Fill ``model`` from a Hugging Face checkpoint directory."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    # Pipeline stages: tensors of other stages are skipped; a tied LM head without the embedding
    # in this stage loads the embedding's tensor (models/llama.py).
    is_foreign = getattr(model, "is_foreign", lambda name: False)
    aliases = getattr(model, "checkpoint_aliases", {})
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if tied and name == "lm_head.weight":
                    continue
                if name in aliases:
                    params[aliases[name]].weight_loader(params[aliases[name]], f.get_tensor(name))
                    loaded.add(aliases[name])
                    continue
                if is_foreign(name):
                    continue
                target, shard_id = name, None
                for ckpt_part, (fused_part, sid) in packed.items():
                    if f".{ckpt_part}." in name:
                        target, shard_id = name.replace(f".{ckpt_part}.", f".{fused_part}."), sid
                        break
                param = params.get(target)
                if param is None:
                    raise ConfigError(f"checkpoint tensor {name!r} in {path.name} has no place in the model")
                tensor = f.get_tensor(name)
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    param.data.copy_(tensor)
                elif shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
                loaded.add(target)
    expected = {n for n, _ in model.named_parameters()}
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(f"checkpoint in {model_dir} lacks weights for {', '.join(missing[:5])}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_engine_state(model: nn.Module, path: Path) -> None:
    """Fill ``model`` from one rank's engine state dict (artifact ``weights/rank-r-of-n.safetensors``): on CPU each
    parameter of the file's dtype becomes a view of the mapped file (no copy, ``SafetensorsFile``)."""
    mapped = all(p.device.type == "cpu" for p in model.parameters())
    with SafetensorsFile(path, mapped=mapped) as state, torch.no_grad():
        params = dict(model.named_parameters())
        # quantization gguf: {name: GGUF type} of the tensors kept as the file's blocks (kernels/gguf_blocks.py)
        gguf_types = json.loads(state.metadata.get("kiln_gguf_types") or "{}")
        missing = sorted(set(params) - set(state.keys()))
        unexpected = sorted(set(state.keys()) - set(params))
        if missing or unexpected:
            raise ConfigError(f"{path.name} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, param in params.items():
            tensor = state.get_tensor(name)
            if name in gguf_types:
                _load_gguf(model, name, param, tensor, gguf_types[name], path)
                continue
            # A bf16/fp16 artifact on a CPU without native bf16/fp16 matmuls runs in float32 (cpu_target):
            # its floating weights are upcast here, once.
            upcast = (param.dtype == torch.float32 and tensor.dtype in (torch.bfloat16, torch.float16))
            if tensor.shape != param.shape or (tensor.dtype != param.dtype and not upcast):
                raise ConfigError(f"{path.name}: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"the model expects {tuple(param.shape)} {param.dtype}")
            if mapped and tensor.dtype == param.dtype:
                param.data = tensor  # the file's pages: nothing copied
            else:
                param.data.copy_(tensor)


def _load_gguf(model: nn.Module, name: str, param: nn.Parameter, tensor: torch.Tensor, kind: str, path: Path) -> None:
    """A GGUF block tensor into ``param``: the blocks replace the placeholder (a linear's ``[out, 0]``, the
    embedding's float table), tagged with their type; an embedding keeps its float dtype for the rows."""
    from kiln.engine.kernels.gguf_blocks import GGUF_TYPES, in_features

    rows = param.shape[0]
    owner = model.get_submodule(name.rpartition(".")[0])
    # The features each row's blocks must hold: an embedding's row width, a linear's K (its placeholder is
    # [out, 0]); a K the layer does not have would make the kernels read past the blocks' buffer.
    k = param.shape[1] if param.dtype != torch.uint8 else getattr(owner, "input_size", None)
    if kind not in GGUF_TYPES or tensor.dtype != torch.uint8 or tensor.dim() != 2 or tensor.shape[0] != rows or (
            k is not None and in_features(tensor, kind) != k):
        raise ConfigError(f"{path.name}: {name} is GGUF {kind} {tuple(tensor.shape)} {tensor.dtype}, the model "
                          f"expects {rows} rows of {k} features ({', '.join(GGUF_TYPES)} blocks); rebuild the "
                          "engine from the GGUF file")
    if param.dtype != torch.uint8 and hasattr(owner, "dtype"):
        owner.dtype = param.dtype  # an embedding's rows come out in the engine's dtype
    param.data = tensor.to(param.device)
    param.gguf_type = kind
