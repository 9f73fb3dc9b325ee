"""Llama declares the "embeddings" capability (it implements Architecture.hidden): the conformance kit checks it,
beside the checks the CPU backend's kit subclass runs for llama already."""

from typing import ClassVar

import pytest
from leat.conformance import ArchitectureConformance
from leat_arch_llama.llama import Llama


class TestLlamaEmbeddingsConformance(ArchitectureConformance):
    capabilities: ClassVar[frozenset[str]] = frozenset({"embeddings"})
    qtypes: ClassVar[tuple[str, ...]] = ()  # the storage checks run in backends/cpu/tests/test_cpu_conformance.py

    @pytest.fixture
    def architecture(self):
        return Llama
