"""Qwen3, Qwen3-MoE and Qwen2 implement Architecture.hidden (Qwen3-Embedding is a qwen3 GGUF with last-token
pooling): the conformance kit's "embeddings" check, for each."""

from typing import ClassVar

import pytest
from leat.conformance import ArchitectureConformance
from leat_arch_qwen3.qwen import Qwen2, Qwen3, Qwen3Moe


class TestQwenEmbeddingsConformance(ArchitectureConformance):
    capabilities: ClassVar[frozenset[str]] = frozenset({"embeddings"})
    qtypes: ClassVar[tuple[str, ...]] = ()  # the storage checks are test_qwen.py's

    @pytest.fixture(params=[Qwen3, Qwen3Moe, Qwen2], ids=lambda cls: cls.names[0])
    def architecture(self, request):
        return request.param
