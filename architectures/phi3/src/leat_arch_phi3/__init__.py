"""leat plugin: the Phi-3 architecture (phi3)."""
