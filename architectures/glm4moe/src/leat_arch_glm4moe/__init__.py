"""leat plugin: the GLM-4.5 mixture-of-experts architecture (glm4moe)."""
