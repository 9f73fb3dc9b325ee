#!/usr/bin/env python3
"""Whether the host bounds an eagerly run prefill on the CUDA backend: a prompt of ``--tokens`` tokens into an empty
cache in one forward pass, eagerly (as `leat bench`'s ppN runs a chunk over the graphs' largest bucket), timed as
its enqueue (until ``Backend.run`` returns: every kernel launched, every cuBLAS call made) and as the whole step
(until its logits are on the host), with the host time spent inside the launches and the cuBLAS calls.

    python scripts/prefill_host.py MODEL.gguf [--tokens 512] [--reps 10] [--rounds 3] [--graph]

``--graph`` runs the same prefill through a captured graph instead (the graphs' token buckets extended to
``--tokens`` where it is past them): almost no host time; past ``TILED_GRAPH_TOKENS`` the graph attends tile-wise
(flash.cu, its tiles made on the device), below it token by token (each token a row of its own).

Where the enqueue is close to the whole step, the GPU waited for the host: the step's figure is the host's, and a
slower host (or one busy with something else) gives a lower ppN. Where it is well under, the GPU bounds it. Each
round prints the medians of ``--reps`` steps after three untimed ones. Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from leat.batch import Batch, Row
from leat_backend_cuda import backend as cuda_backend
from leat_backend_cuda import driver
from leat_backend_cuda.bench import one_token_step


class Spent:
    """Calls made through a wrapped function and the host seconds they took."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true")
    args = ap.parse_args()
    if args.graph and args.tokens > cuda_backend.TOKEN_BUCKETS[-1]:
        cuda_backend.TOKEN_BUCKETS = (*cuda_backend.TOKEN_BUCKETS, args.tokens)
    backend, arch, _, kv = one_token_step(args.model, args.tokens)
    backend.graphs = args.graph  # eager: as `leat bench` runs a chunk over the graphs' largest bucket
    launches, gemms = Spent(), Spent()
    driver.Kernel.__call__ = launches.wrap(driver.Kernel.__call__)  # type: ignore[method-assign]
    if backend.cublas is not None:
        backend.cublas.gemm_f16 = gemms.wrap(backend.cublas.gemm_f16)  # type: ignore[method-assign]
    batch = Batch([Row(0, 0, np.random.default_rng(0).integers(0, arch.vocab_size, args.tokens))])

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        out = backend.run(arch.forward, batch, kv)
        queued = time.perf_counter()
        backend.to_host(out)
        return queued - start, time.perf_counter() - start

    for _ in range(3):
        step()
    how = "a captured graph" if args.graph else "eager"
    print(f"{args.tokens}-token prefill, {how}: {'cuBLAS' if backend.cublas else 'own GEMM'} products\n")
    print("| round | enqueue ms | step ms | tok/s | launches | in launches ms | cuBLAS calls | in cuBLAS ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for index in range(1, args.rounds + 1):
        launches.reset()
        gemms.reset()
        timed = [step() for _ in range(args.reps)]
        queued, whole = (statistics.median(t[i] for t in timed) for i in (0, 1))
        n = args.reps
        print(
            f"| {index} | {1e3 * queued:.2f} | {1e3 * whole:.2f} | {args.tokens / whole:,.0f} | {launches.calls // n} "
            f"| {1e3 * launches.seconds / n:.2f} | {gemms.calls // n} | {1e3 * gemms.seconds / n:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
