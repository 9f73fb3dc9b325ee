"""leat plugin: the Qwen3.5 architecture (qwen35)."""
