"""The CPU backend's one-token products, kernel against kernel: each decode entry point the library has for a
weight's type (``gemv_<type>``, float32; ``igemv_<type>`` and ``igemvb_<type>``, int16 activations) on the same
weights and activations. Which one a decode step uses: ``QuantizedWeight.step`` (native.py).

    uv run python scripts/cpu_products.py [--model default] [--rounds 3]

Two measures, the entry points interleaved round by round: one layer's products alone, repeated, so that the
weights stay in the core's L2 (what the kernel computes at, one thread); and every layer's products one after the
other, as a decode step runs them, so that the weights stream from memory (one thread and two), and the output's
product (the embedding's where it is tied) alone. Prints a markdown
table: microseconds a product and GB/s of weight bytes, per round. What the entry points compute is checked by
``backends/cpu/tests/test_cpu_quantized.py``; this only times them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from leat.modelfile import ModelFile
from leat.pull import resolve
from leat_backend_cpu import native
from leat_backend_cpu.backend import CPUBackend


def arguments(name: str, weight, x: np.ndarray, threads: int) -> tuple:
    """The entry point's arguments (gemv_ takes no activation range)."""
    rows, k = weight.shape
    y = np.empty((len(x), rows), np.float32)
    if name.startswith("gemv_"):
        return (weight.address, rows, k, x, len(x), y, threads)
    return (weight.address, rows, k, x, len(x), y, native.activation_range(weight.qtype), threads)


def timed(name: str, weight, x: np.ndarray, threads: int, reps: int) -> float:
    """Seconds a call of entry point ``name`` on ``weight`` takes, the mean of ``reps`` after one to warm up."""
    entry, args = native.library().entry(name), arguments(name, weight, x, threads)
    entry(*args)
    started = time.perf_counter()
    for _ in range(reps):
        entry(*args)
    return (time.perf_counter() - started) / reps


def sweep(name: str, weights: list, inputs: dict[int, np.ndarray], threads: int, sweeps: int = 5) -> float:
    """Seconds one pass over ``weights`` takes (each product once, in order, as a decode step has them), the mean of
    ``sweeps`` passes after one: more bytes than the caches hold, so each pass reads them from memory."""
    entry = native.library().entry(name)
    calls = [arguments(name, w, inputs[w.shape[1]], threads) for w in weights]
    for call in calls:
        entry(*call)
    started = time.perf_counter()
    for _ in range(sweeps):
        for call in calls:
            entry(*call)
    return (time.perf_counter() - started) / sweeps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    file, backend, lib = ModelFile(resolve(args.model)), CPUBackend(), native.library()
    weights = {  # the layers' products and the output's (the embedding where it is tied)
        name: backend.upload(tensor)
        for name, tensor in file.tensors.items()
        if (
            name.startswith("blk.")
            or name == ("output.weight" if "output.weight" in file.tensors else "token_embd.weight")
        )
        and len(tensor.shape) == 2
        and tensor.qtype in native.KERNEL_TYPES
    }
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in {w.shape[1] for w in weights.values()}}

    def entries(qtype) -> list[str]:
        name = qtype.name.lower()
        return [e for e in (f"gemv_{name}", f"igemv_{name}", f"igemvb_{name}") if lib.has(e)]

    print("| measure | entry point | threads | round | us a product | GB/s |")
    print("|---|---|---:|---:|---:|---:|")
    first = {}  # layer 0's weights, one of each shape and type: the in-L2 measure
    for name, weight in weights.items():
        if name.startswith("blk.0."):
            first.setdefault((weight.qtype, weight.shape), (name, weight))
    for round_ in range(args.rounds):
        for name, weight in first.values():
            for entry in entries(weight.qtype):
                seconds = timed(entry, weight, inputs[weight.shape[1]], 1, 300)
                print(
                    f"| {name} {weight.shape[0]}x{weight.shape[1]} in L2 | {entry} | 1 | {round_} | "
                    f"{seconds * 1e6:.1f} | {weight.nbytes / seconds / 1e9:.2f} |"
                )
        for threads in (1, 2):
            by_kind: dict = {}
            for name, weight in weights.items():
                kind = f"every layer's {weight.qtype.name}" if name.startswith("blk.") else f"the output {name}"
                by_kind.setdefault((kind, weight.qtype), []).append(weight)
            for (kind, qtype), group in by_kind.items():
                total = sum(w.nbytes for w in group)
                for entry in entries(qtype):
                    seconds = sweep(entry, group, inputs, threads)
                    print(
                        f"| {kind} ({len(group)} products, {total / 2**20:.1f} MiB), streamed | "
                        f"{entry} | {threads} | {round_} | {seconds / len(group) * 1e6:.1f} | "
                        f"{total / seconds / 1e9:.2f} |"
                    )


if __name__ == "__main__":
    main()
