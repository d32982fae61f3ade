"""The engine's LoRA settings as one typed view (vLLM's ``LoRAConfig``), built from ``EngineConfig`` with its
defaults resolved there (``EngineConfig.lora_config``): every LoRA part (the host store, the device slots, the
runner's half) takes this, not the engine's whole config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # adapters on the device at once (slots)
    max_rank: int  # the widest adapter served (slots are this wide)
    max_cpu_loras: int  # adapters kept in host memory (LRU), resolved: max_loras unless set
    dtype: torch.dtype  # the model's compute dtype

    def stack_dtype(self, device: str | torch.device) -> torch.dtype:
        """The slots' dtype: the model's on a GPU; float32 on CPU (with kiln's kernels the packed copies are
        the model's dtype; without, torch's bf16 GEMM at LoRA's shapes measured ~5x slower than float32)."""
        return torch.float32 if torch.device(device).type == "cpu" else self.dtype

    def slot_bytes(self, device: str | torch.device, hidden: int, intermediate: int, heads: int, kv_heads: int,
                   head_dim: int, layers: int, tp: int = 1) -> int:
        """Device bytes of one rank's adapter slots over ``layers`` decoder layers (``LoRASlots``' ``A`` and
        ``Bt`` stacks of qkv, o, gate_up and down): what the runner allocates before it plans the KV pool,
        and the term the builder's KV plan takes out of the budget (``builder_job/kv_plan.py``)."""
        q_kv_out = (heads + 2 * kv_heads) * head_dim // tp
        per_rank_row = (3 * (hidden + q_kv_out) + (heads * head_dim // tp + hidden)  # qkv (3 parts), o
                        + 2 * (hidden + 2 * intermediate // tp) + (intermediate // tp + hidden))  # gate_up, down
        return self.max_loras * self.max_rank * per_rank_row * layers * self.stack_dtype(device).itemsize
