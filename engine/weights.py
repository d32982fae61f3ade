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

from pathlib import Path

import torch
from kiln.engine.errors import ConfigError
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn


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
        with safe_open(str(path), framework="pt") as f:
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
    """Fill ``model`` from one rank's engine state dict (artifact ``weights/rank-r-of-n.safetensors``)."""
    state = load_file(str(path))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ConfigError(f"{path.name} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            tensor = state[name]
            # A bf16/fp16 artifact on a CPU without native bf16/fp16 matmuls runs in float32 (cpu_target):
            # its floating weights are upcast here, once.
            upcast = (param.dtype == torch.float32 and tensor.dtype in (torch.bfloat16, torch.float16))
            if tensor.shape != param.shape or (tensor.dtype != param.dtype and not upcast):
                raise ConfigError(f"{path.name}: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"the model expects {tuple(param.shape)} {param.dtype}")
            param.data.copy_(tensor)
