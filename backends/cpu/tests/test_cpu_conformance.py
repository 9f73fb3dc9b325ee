"""The CPU backend and the llama architecture through leat's conformance kit, as a third-party plugin would use it."""

import pytest
from leat.conformance import ArchitectureConformance, BackendConformance
from leat_backend_cpu.backend import CPUBackend


class TestCPUBackendConformance(BackendConformance):
    @pytest.fixture(params=["f32", "f64"])
    def backend(self, request):
        return CPUBackend(request.param)


class TestLlamaArchitectureConformance(ArchitectureConformance):
    @pytest.fixture
    def architecture(self):
        return pytest.importorskip("leat_arch_llama.llama").Llama
