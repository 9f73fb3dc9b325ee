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
