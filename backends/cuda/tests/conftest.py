"""GPU tests (marked ``gpu``) skip with the probe's reason where no usable NVIDIA GPU is present. The ``cuda``
fixture is a backend whose activations start as NaN (so an element a kernel never writes shows), ``oracle``
the CPU backend in float64 they are checked against."""

import pytest
from leat_backend_cpu.backend import CPUBackend


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu") and "backends/cuda" in str(item.fspath)]
    if not gpu:
        return
    from leat_backend_cuda.backend import CUDABackend

    reason = CUDABackend.probe()
    if reason:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=f"cuda backend unavailable: {reason}"))


@pytest.fixture(scope="module")
def cuda():
    from leat_backend_cuda.backend import CUDABackend

    return CUDABackend(poison=True)


@pytest.fixture(scope="module")
def oracle():
    return CPUBackend("f64")


@pytest.fixture(scope="module")
def tiny_q8_0(tmp_path_factory):
    """A tiny Q8_0 llama whose head dimension (32) a q8_0 cache can hold."""
    import gguf
    from leat.testing import write_tiny_gguf
    from leat_arch_llama.llama import Llama

    path = tmp_path_factory.mktemp("q8kv") / "hd32.gguf"
    params = Llama.tiny(head_dim=32, context=512)
    return write_tiny_gguf(Llama, path, gguf.GGMLQuantizationType.Q8_0, params=params, seed=3)
