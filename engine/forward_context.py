"""One context per forward pass (vLLM v1's ``vllm/forward_context.py``): what a layer needs of this batch.

The runner builds it once per step and sets it around the model call (``set_forward_context``); layers read
it (``get_forward_context()``), and nobody sets module attributes for a step. It carries the step's attention
metadata and its LoRA work (None: no adapter token this step, so the linears do no LoRA work and the model
keeps its fused paths); whatever else a step needs goes here as one more field.

The context is per thread: each engine's step loop runs in its own thread, and a server holding several
engines (an engine pool) steps them at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from kiln.engine.layers.attention_metadata import AttentionMetadata
from kiln.engine.lora.step import LoRAStep


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionMetadata
    lora: LoRAStep | None = None  # the step's adapter runs (kiln.engine.lora.step)

    @property
    def has_lora(self) -> bool:
        """Adapter tokens in this step: LoRA groups index the whole step, so the model runs module by module."""
        return self.lora is not None


_local = threading.local()  # .context: this thread's step, None between steps


def _current() -> ForwardContext | None:
    return getattr(_local, "context", None)


def step_has_lora() -> bool:
    """Adapter tokens in the step being run (False outside a step: a layer timed alone by the tactics)."""
    context = _current()
    return context is not None and context.has_lora


def get_forward_context() -> ForwardContext:
    """The step being run's context; a model called outside a runner's step has none."""
    context = _current()
    if context is None:
        raise RuntimeError("the model was called outside a step (no forward context: ModelRunner.execute sets it)")
    return context


@contextlib.contextmanager
def set_forward_context(attention: AttentionMetadata, lora: LoRAStep | None = None) -> Iterator[ForwardContext]:
    """The step's context while the model runs; the one before it (None between steps) after."""
    before = _current()
    _local.context = context = ForwardContext(attention, lora)
    try:
        yield context
    finally:
        _local.context = before
