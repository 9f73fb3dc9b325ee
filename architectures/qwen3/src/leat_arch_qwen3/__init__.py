"""leat plugin: the Qwen architectures qwen3, qwen3moe and qwen2."""
