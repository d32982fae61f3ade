"""kiln.engine.lora: multi-LoRA adapters served in mixed batches (docs/lora.md).

``request`` names an adapter (vLLM's ``LoRARequest``), ``adapter`` reads and checks a PEFT adapter
directory against the base model, ``store`` keeps loaded adapters in host memory (an LRU of
``max_cpu_loras``), ``slots`` is the scheduler's policy over the ``max_loras`` device slots, and
``layers`` holds each linear's stacked slot weights and runs the grouped shrink/expand matmul.
"""

from kiln.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
