"""The tinygrad backend through leat's conformance kit, as a third-party plugin would use it."""

import os
from typing import ClassVar

import pytest
from leat.conformance import BackendConformance
from leat_backend_tinygrad.backend import TinygradBackend, probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)


class TestTinygradBackendConformance(BackendConformance):
    capabilities: ClassVar[frozenset[str]] = frozenset({"windows", "recurrent"})

    @pytest.fixture
    def backend(self):
        from tinygrad.helpers import NOOPT, PARALLEL

        NOOPT.value = 1  # as in test_tinygrad_backend.py: a cold run is mostly tinygrad's kernel optimizer
        if "PARALLEL" not in os.environ:  # and its kernels compiled in this process, not in a pool of processes
            PARALLEL.value = 0
        return TinygradBackend()
