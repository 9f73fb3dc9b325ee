"""leat plugin: the Gemma 4 architecture (gemma4)."""
