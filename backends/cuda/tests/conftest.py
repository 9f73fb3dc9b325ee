"""GPU tests (marked ``gpu``) skip with the probe's reason where no usable NVIDIA GPU is present."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu") and "backends/cuda" in str(item.fspath)]
    if not gpu:
        return
    from leat_backend_cuda.backend import CUDABackend

    reason = CUDABackend.probe()
    if reason:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=f"cuda backend unavailable: {reason}"))
