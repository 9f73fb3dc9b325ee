"""leat plugin: the gpt-oss architecture."""
