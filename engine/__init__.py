"""The kiln runtime: paged KV cache, in-flight batching, Llama-family models."""
