"""Model families. ``SUPPORTED_ARCHITECTURES`` (config.json ``architectures`` names) imports no torch,
so the builder can check a checkpoint before loading anything; ``registry`` maps them to classes."""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "SmolLM3ForCausalLM")
