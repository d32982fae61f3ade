"""The quality gate's reference models, streamed one unit of weights at a time.

The gate compares the converted weights with the source checkpoint run by transformers in float32.
Neither model is ever resident whole: transformers builds the architecture with its parameters on
the ``meta`` device (buffers such as the rotary frequencies are real, and small), and a forward
pre-hook on each *unit* (the embedding, each decoder layer, the final norm, the LM head) reads that
unit's tensors from the safetensors files (``safe_open(...).get_tensor``, one tensor at a time),
converts them and puts them on the device; its forward hook puts the ``meta`` placeholders back.
The forward itself is transformers' own, so the masks, rotary embeddings and attention are exactly
the ones the definition of correct uses.

- :class:`StreamedCausalLM` ``(dir, device)`` is the source: every tensor cast to float32, as
  ``from_pretrained(dtype=float32)`` does.
- ``(dir, device, dtype, quantization)`` is the converted model: each unit's tensors go through the
  builder's own :func:`~kiln.builder.convert.convert_state_dict` and are dequantized in ``dtype``
  (what ``model.to(dtype)`` plus the converted state dict gave the gate before), buffers in ``dtype``.

All prompts of a batch (up to :data:`BATCH_TOKENS` padded tokens, which the built-in calibration set
fits) run as one forward, right-padded with no attention mask: the causal mask alone keeps a real
position from seeing the padding after it, so one pass reads the checkpoint once. Peak memory, host
or device: the largest unit in float32 (plus its checkpoint-dtype and converted copies on the host),
one batch's activations and logits, and the log-probabilities kept per real position.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from kiln.builder.convert import SCALE_SUFFIX, convert_state_dict, dequantized_state_dict
from kiln.builder.errors import InvalidSpec
from kiln.builder.model_facts import read_safetensors_header
from kiln.engine.cpu_target import choose_threads
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

log = logging.getLogger("kiln.build.reference")

# Padded tokens (prompts x longest prompt) of one forward pass; each batch is one pass over the weights.
BATCH_TOKENS = 4096
PAD_ID = 0


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on ``meta`` (no memory) and keep real buffers."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":  # a tied parameter is registered as is
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_index(checkpoint_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the headers alone."""
    return {name: f for f in sorted(Path(checkpoint_dir).glob("*.safetensors"))
            for name in read_safetensors_header(f)}


def read_tensors(index: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors in their checkpoint dtype; each file is opened only for its own tensors."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted({index[n] for n in names}):
        with safe_open(str(path), framework="pt") as f:
            for n in names:
                if index[n] == path:
                    out[n] = f.get_tensor(n)
    return out


def choose_cpu_threads() -> None:
    """Same rule as serving (cgroup quota, else measured): on a shared 2-core host two threads can be
    5x slower than one (SmolLM2-135M teacher-forced gate: 20 s vs 4 s)."""
    threads, why = choose_threads()
    if threads:
        torch.set_num_threads(threads)
    log.info("reference model on CPU: %d torch thread(s) (%s)", torch.get_num_threads(), why)


class StreamedCausalLM:
    """A transformers causal LM over a checkpoint directory, its weights streamed unit by unit."""

    def __init__(self, checkpoint_dir: Path, device: str = "cpu", dtype: str | None = None,
                 quantization: str = "none") -> None:
        hf_logging.disable_progress_bar()
        self.device = torch.device(device)
        self.dtype, self.quantization = dtype, quantization
        self.index = checkpoint_index(checkpoint_dir)
        config = AutoConfig.from_pretrained(str(checkpoint_dir), trust_remote_code=False)
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        buffer_dtype = getattr(torch, dtype) if dtype else torch.float32
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device=self.device,
                                                   dtype=buffer_dtype if buf.is_floating_point() else buf.dtype)
        self.model = model.eval()
        self.convert_summary: dict[str, Any] = {"dtype": dtype, "quantization": quantization, "num_tensors": 0,
                                                "num_quantized_tensors": 0, "converted_bytes": 0}
        self._converted_names: set[str] = set()
        self._attach(config.num_hidden_layers)

    def _attach(self, num_layers: int) -> None:
        """Hooks on each unit; the first checkpoint name of a (tied) parameter is the one it loads."""
        source_of: dict[int, str] = {}
        model_name: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            model_name.setdefault(id(p), name)
            if name in self.index:
                source_of.setdefault(id(p), name)
        layers = next((m for m in self.model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers),
                      None)
        if layers is None:
            raise InvalidSpec(f"the quality gate cannot find the {num_layers} decoder layers config.json declares "
                              f"(num_hidden_layers) in {type(self.model).__name__}: check config.json against "
                              f"the checkpoint")
        in_layers = {id(m) for m in layers.modules()}
        # A decoder layer loads everything under it; any other module (embedding, norm, head) its own.
        units = [(layer, list(layer.modules())) for layer in layers]
        units += [(m, [m]) for m in self.model.modules() if m._parameters and id(m) not in in_layers]
        for unit, owners in units:
            slots = []
            for owner in owners:
                for leaf, p in owner._parameters.items():
                    if p is None:
                        continue
                    if id(p) not in source_of:
                        raise InvalidSpec(f"the checkpoint has no tensor {model_name[id(p)]!r} that config.json "
                                          f"implies: check that every safetensors file is there and that "
                                          f"config.json matches them (e.g. tie_word_embeddings)")
                    slots.append((owner, leaf, p, source_of[id(p)]))
            unit.register_forward_pre_hook(self._loader(slots))
            unit.register_forward_hook(self._unloader(slots))

    def _loader(self, slots) -> Callable:
        def load(module, args):
            tensors = self._unit_tensors(sorted({name for *_, name in slots}))
            for owner, leaf, _, name in slots:
                owner._parameters[leaf] = nn.Parameter(tensors[name].to(self.device), requires_grad=False)
        return load

    @staticmethod
    def _unloader(slots) -> Callable:
        def unload(module, args, output):
            for owner, leaf, placeholder, _ in slots:
                owner._parameters[leaf] = placeholder
        return unload

    def _unit_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        raw = read_tensors(self.index, names)
        if self.dtype is None:
            return {n: t.to(torch.float32) for n, t in raw.items()}
        convert_log = logging.getLogger("kiln.build.convert")
        level = convert_log.level
        convert_log.setLevel(logging.WARNING)  # one line per unit otherwise; the pass logs its own
        try:
            converted, _ = convert_state_dict(raw, self.dtype, self.quantization)
        finally:
            convert_log.setLevel(level)
        for n in names:
            if n not in self._converted_names:  # a tied tensor is loaded twice, counted once
                self._converted_names.add(n)
                s = self.convert_summary
                s["num_tensors"] += 1
                s["num_quantized_tensors"] += int(n + SCALE_SUFFIX in converted)
                s["converted_bytes"] += sum(t.numel() * t.element_size() for k, t in converted.items()
                                            if k in (n, n + SCALE_SUFFIX))
        return dequantized_state_dict(converted, self.dtype)

    @torch.inference_mode()
    def _each_row(self, token_lists: list[list[int]], reduce: Callable[[torch.Tensor], torch.Tensor]
                  ) -> list[torch.Tensor]:
        """``reduce(logits of one prompt's real positions, float32)`` per prompt, on the CPU."""
        out: list[torch.Tensor] = []
        for batch in batches(token_lists, BATCH_TOKENS):
            width = max(len(ids) for ids in batch)
            ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
            for i, row in enumerate(batch):
                ids[i, : len(row)] = torch.tensor(row)
            logits = self.model(ids.to(self.device), use_cache=False).logits
            out.extend(reduce(logits[i, : len(row)].float()).cpu() for i, row in enumerate(batch))
            del logits
        return out

    def log_probs(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        """Next-token log-probabilities ``[len, vocab]`` (float32) at every position of every prompt."""
        return self._each_row(token_lists, lambda logits: torch.log_softmax(logits, dim=-1))

    def argmax(self, token_lists: list[list[int]]) -> list[list[int]]:
        """The greedy next token at every position of every prompt."""
        return [t.tolist() for t in self._each_row(token_lists, lambda logits: logits.argmax(-1))]


def batches(token_lists: list[list[int]], max_tokens: int) -> Iterator[list[list[int]]]:
    """Consecutive prompts, as many per batch as keep (prompts x longest) within ``max_tokens``."""
    batch: list[list[int]] = []
    for ids in token_lists:
        if batch and (len(batch) + 1) * max(len(ids), *(len(b) for b in batch)) > max_tokens:
            yield batch
            batch = []
        batch.append(ids)
    if batch:
        yield batch
