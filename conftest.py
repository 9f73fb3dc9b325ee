"""Every test process computes with one BLAS thread.

On this project's shared 2-core machines a second OpenBLAS thread spin-waits whenever another process holds a
core: SmolLM2's float32 logits over the six recorded prompts took 32 s with OpenBLAS's two threads and 4 s with
one, at load average 5 (tests/test_cpu_precision.py). The tests check values, not speed; `leat bench` and the
benchmark scripts run with the library's own thread count. Set before numpy is imported, so subprocesses that
tests start (servers, plugin environments) inherit it; OPENBLAS_NUM_THREADS=2 uv run pytest overrides it.
"""

import os

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
