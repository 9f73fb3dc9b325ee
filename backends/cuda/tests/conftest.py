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


@pytest.fixture(scope="session", autouse=True)
def shared_kernel_cache(tmp_path_factory):
    """The fake-driver tests (test_plumbing*.py) set LEAT_HOME to the session's ``leat-home``; its ``cuda`` folder is
    the kernel cache that test_compile.py and the user's runs use (``compiler.cache_dir()``: content-addressed by
    source, headers, options, names and NVRTC version), so NVRTC builds a program once on a machine, not again in
    each session after test_compile.py's build of every program has: 100-120 s of the suite on a 2-core machine."""
    from leat_backend_cuda.compiler import cache_dir

    shared = cache_dir()
    shared.mkdir(parents=True, exist_ok=True)
    home = tmp_path_factory.getbasetemp() / "leat-home"
    home.mkdir(exist_ok=True)
    if not (home / "cuda").exists():
        (home / "cuda").symlink_to(shared, target_is_directory=True)
