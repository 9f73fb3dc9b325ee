"""Every test process computes with one BLAS thread.

On this project's shared 2-core machines a second OpenBLAS thread spin-waits whenever another process holds a
core: SmolLM2's float32 logits over the six recorded prompts took 32 s with OpenBLAS's two threads and 4 s with
one, at load average 5 (tests/test_cpu_precision.py). The tests check values, not speed; `leat bench` and the
benchmark scripts run with the library's own thread count. Set before numpy is imported, so subprocesses that
tests start (servers, plugin environments) inherit it; OPENBLAS_NUM_THREADS=2 uv run pytest overrides it.

Where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE, as this project's sandboxes set), every
Python process the suite starts (a few hundred: servers, CLI calls, Ray's workers, pytest runs) compiled each module
it imports from source again: 0.7 s of `leat doctor`'s 2.6 s, 4 s of a bare pytest run's 6.6 s, server/tests 210 s
against 170 s. The suite then writes it under PYTHONPYCACHEPREFIX (its own folder in the user's cache, never beside
the sources), for this process and the ones it starts; a PYTHONPYCACHEPREFIX already set is kept.
"""

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
    _prefix = Path(os.environ.get("LEAT_HOME") or Path.home() / ".cache" / "leat") / "test-pycache"
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = str(_prefix)
    sys.pycache_prefix, sys.dont_write_bytecode = str(_prefix), False


# The GPU backends are extras of the workspace (`uv sync --extra cuda`, `--extra tinygrad`): without them their
# folders are not collected, and the run ends by saying so and how to include them.
ROOT = Path(__file__).parent
OPTIONAL = {"backends/cuda": ("leat_backend_cuda", "cuda"), "backends/tinygrad": ("leat_backend_tinygrad", "tinygrad")}
_not_run: dict[str, str] = {}


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    for folder, (module, extra) in OPTIONAL.items():
        if collection_path.is_relative_to(ROOT / folder) and importlib.util.find_spec(module) is None:
            _not_run[folder] = f"{folder}: not run, {module} is not installed (uv sync --extra {extra})"
            return True
    return None


def pytest_terminal_summary(terminalreporter) -> None:
    for line in _not_run.values():
        terminalreporter.write_line(line, yellow=True)


@pytest.fixture(scope="session")
def leat_home(tmp_path_factory) -> Callable[..., Path]:
    """``leat_home(path=None)`` makes ``path`` (else a fresh temporary folder) a LEAT_HOME for the processes a test
    starts: their keys, sessions, servers and models apart from the user's, but the CPU backend's compiled kernels
    shared (its ``cpu`` folder links to this process's). A server started on an empty LEAT_HOME compiles them first:
    9 CPU-s, 13 s at load 3 on a 2-core machine, in each of the suite's dozen or so such servers."""
    kernels = None
    if importlib.util.find_spec("leat_backend_cpu") is not None:
        from leat_backend_cpu.native import cache_dir

        kernels = cache_dir()
        kernels.mkdir(parents=True, exist_ok=True)

    def make(path: Path | None = None) -> Path:
        home = path if path is not None else tmp_path_factory.mktemp("leat-home")
        home.mkdir(parents=True, exist_ok=True)
        if kernels is not None:
            with pytest.MonkeyPatch.context() as env:  # where a process with this LEAT_HOME looks for them
                env.setenv("LEAT_HOME", str(home))
                cache_dir().symlink_to(kernels, target_is_directory=True)
        return home

    return make
