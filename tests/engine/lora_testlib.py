"""LoRA adapters made locally with PEFT on the toy models, and transformers + PEFT's greedy output for them."""

from __future__ import annotations

from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

_REF: dict[tuple, list[int]] = {}
_MODELS: dict[tuple, object] = {}


def make_adapter(model_dir: Path, out_dir: Path, targets: list[str], seed: int, r: int = 8, alpha: int = 16,
                 damp: float = 0.3, **extra) -> Path:
    """A PEFT adapter with random A and B (``init_lora_weights=False``), B damped so the output changes
    without collapsing; saved with ``save_pretrained`` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                            init_lora_weights=False, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(damp)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], n: int) -> list[int]:
    """transformers (+ PEFT with ``adapter_dir``) ``generate(do_sample=False)`` for one prompt, cached."""
    key = (str(model_dir), str(adapter_dir), tuple(prompt), n)
    if key not in _REF:
        mkey = (str(model_dir), str(adapter_dir))
        if mkey not in _MODELS:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            if adapter_dir is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, adapter_dir)
            _MODELS[mkey] = model.eval()
        with torch.no_grad():
            out = _MODELS[mkey].generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                         pad_token_id=0)
        _REF[key] = out[0, len(prompt):].tolist()
    return _REF[key]
