"""The CPU backend and the llama architecture through leat's conformance kit, as a third-party plugin would use it."""

import pytest
from leat.conformance import ArchitectureConformance, BackendConformance
from leat_backend_cpu.backend import CPUBackend


class TestCPUBackendConformance(BackendConformance):
    capabilities = BackendConformance.capabilities | {"recurrent"}

    @pytest.fixture(params=["f32", "f32-dequantized", "f64"])  # the quantized path and the two references
    def backend(self, request):
        precision, _, weights = request.param.partition("-")
        return CPUBackend(precision, **({"weights": weights} if weights else {}))


class TestLlamaArchitectureConformance(ArchitectureConformance):
    @pytest.fixture
    def architecture(self):
        return pytest.importorskip("leat_arch_llama.llama").Llama


class _BrokenSiluBackend(CPUBackend):
    factor = 1.001

    def silu_mul(self, gate, up):
        return super().silu_mul(gate, up) * self.factor


class _VeryBrokenSiluBackend(_BrokenSiluBackend):
    factor = 3.0


def test_the_kit_fails_a_broken_backend(tmp_path):
    kit = TestCPUBackendConformance()
    with pytest.raises(AssertionError):
        kit.test_silu_mul_and_add(_BrokenSiluBackend("f32"))
    with pytest.raises(AssertionError, match="top-1|KL"):
        kit.test_tiny_llama_agrees_with_the_float64_oracle(_VeryBrokenSiluBackend("f32"), "F32", tmp_path)
