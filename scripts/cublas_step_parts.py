#!/usr/bin/env python3
"""Where a batched decode step's time goes around the CUDA backend's cuBLAS products, on one file.

    python scripts/cublas_step_parts.py MODEL.gguf [--rows 8,16,32,64] [--parts] [--shapes] [--thresholds]

For each row count, a graph-replayed step of that many decode rows (best of three, 20 replays each). ``--parts``
also times it with launches removed, to bound what folding them into other kernels can save: the cuBLAS epilogue
(``scale_rows_bias``), then also ``silu_mul`` and ``add`` (the answers are wrong then; only the time counts), and
counts one eager step's launches of those kernels and its cuBLAS calls. ``--shapes`` times cuBLAS alone at the
file's products (q, k and v as three calls and as one, gate and up likewise, o, down, the output), 16, 32 and 64
tokens. ``--thresholds`` times 4-24 rows as shipped and with cuBLAS taking every product of 3 tokens or more.
Needs a GPU and cuBLAS (``leat-backend-cuda[cublas]``).
"""

from __future__ import annotations

import argparse

import numpy as np
from leat.batch import Batch, Row
from leat_backend_cuda import driver
from leat_backend_cuda.backend import U16
from leat_backend_cuda.bench import step_ms, time_it, with_cublas


def best_ms(backend, arch, batch, kv) -> float:
    return min(step_ms(backend, arch.forward, batch, kv, 20) for _ in range(3))


def removed(backend, names: tuple[str, ...]):
    """The ops kernels ``names`` replaced by launches that do nothing; returns the originals to put back."""
    saved = {name: backend.ops.kernels[name] for name in names}
    for name in names:
        backend.ops.kernels[name] = lambda *args, **kwargs: None
    return saved


def parts(backend, arch, batch, kv) -> str:
    times = []
    for names in ((), ("scale_rows_bias",), ("scale_rows_bias", "silu_mul", "add")):
        saved = removed(backend, names)
        try:
            times.append(best_ms(backend, arch, batch, kv))
        finally:
            backend.ops.kernels.update(saved)
    counted = ("scale_rows_bias", "silu_mul", "add", "rms_norm_f16", "x_to_f16")
    counts = dict.fromkeys(counted, 0)
    saved = {name: backend.ops.kernels[name] for name in counted}
    for name in counted:
        backend.ops.kernels[name] = lambda *a, _n=name, _k=saved[name], **kw: (
            counts.__setitem__(_n, counts[_n] + 1),
            _k(*a, **kw),
        )
    calls, gemm = [], backend.cublas.gemm_f16
    backend.cublas.gemm_f16 = lambda *args: (calls.append(args[3:6]), gemm(*args))
    try:
        backend.to_host(arch.forward(batch, kv))
    finally:
        backend.cublas.gemm_f16 = gemm
        backend.ops.kernels.update(saved)
    return (
        f"as shipped {times[0]:.3f} ms, without the epilogue {times[1]:.3f}, without it, silu_mul and add "
        f"{times[2]:.3f}; one eager step's launches {counts}, cuBLAS calls {len(calls)}"
    )


def shapes(backend, width: int, kv_width: int, ffn: int, vocab: int) -> None:
    products = {
        "q, k, v (three calls)": [(width, width), (kv_width, width), (kv_width, width)],
        "q, k, v (one call)": [(width + 2 * kv_width, width)],
        "o": [(width, width)],
        "gate, up (two calls)": [(ffn, width)] * 2,
        "gate, up (one call)": [(2 * ffn, width)],
        "down": [(width, ffn)],
        "output": [(vocab, width)],
    }
    for n in (16, 32, 64):
        for label, mats in products.items():
            weights = [backend._empty((m, k), U16) for m, k in mats]
            for w in weights:  # f16 ones: any finite value serves a timing
                driver.check(driver._cu().cuMemsetD16Async(w.ptr, 0x3C00, w.size, backend.device.stream), "memset")
            x = backend._empty((n, mats[0][1]), U16)
            outs = [backend._empty((n, m)) for m, _ in mats]

            def call(weights=weights, x=x, outs=outs, mats=mats, n=n):
                for w, y, (m, k) in zip(weights, outs, mats):
                    backend.cublas.gemm_f16(w.ptr, x.ptr, y.ptr, m, n, k, m)

            seconds = time_it(backend, call, 20)
            nbytes = sum(2 * m * k for m, k in mats)
            print(f"| {n} | {label} | {seconds * 1e6:.1f} | {nbytes / seconds / 1e12:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", default="8,16,32,64")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--shapes", action="store_true")
    ap.add_argument("--thresholds", action="store_true")
    args = ap.parse_args()
    backend, arch = with_cublas(args.model)
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), 65, 640, dtype="f16")
    tokens = np.random.default_rng(0).integers(0, arch.vocab_size, 64)

    def decode(rows: int) -> Batch:
        return Batch([Row(s, 130, tokens[s : s + 1]) for s in range(rows)])

    for rows in (int(r) for r in args.rows.split(",")):
        line = (
            parts(backend, arch, decode(rows), kv)
            if args.parts
            else f"{best_ms(backend, arch, decode(rows), kv):.3f} ms"
        )
        print(f"{rows} decode rows: {line}", flush=True)
    if args.thresholds:
        shipped = backend.cublas_min_tokens_f16
        for rows in (4, 6, 8, 12, 16, 24):
            times = []
            for threshold in (shipped, 3):
                backend.cublas_min_tokens_f16 = threshold
                times.append(best_ms(backend, arch, decode(rows), kv))
            backend.cublas_min_tokens_f16 = shipped
            print(
                f"{rows} decode rows: as shipped {times[0]:.3f} ms, cuBLAS from 3 tokens {times[1]:.3f} ms", flush=True
            )
    if args.shapes:
        layer = arch.layers[0] if hasattr(arch, "layers") else None
        if layer is None or not hasattr(layer, "attn"):
            raise SystemExit("--shapes reads the first layer's attention and MLP: this architecture has neither")
        print("| tokens | product | us | TB/s |\n|---|---|---|---|")
        shapes(backend, layer.attn.q.cols, layer.attn.k.rows, layer.mlp[0].rows, arch.vocab_size)


if __name__ == "__main__":
    main()
