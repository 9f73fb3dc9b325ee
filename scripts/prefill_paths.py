#!/usr/bin/env python3
"""The CUDA backend's two prefill paths on one file: the own tensor-core GEMM and cuBLAS, in one process.

    python scripts/prefill_paths.py MODEL.gguf [--tokens 256,384,512,1024,2048] [--steps 64:128,32:224]

For each prompt size, a prompt-only forward (eager, best of three) with every product sent to the own GEMM, then
to cuBLAS (``CUDABackend.cublas_min_tokens`` moved out of the way or down to one). ``--steps D:C`` also times a
graph-replayed step of D decode rows beside a C-token prompt chunk (the server's mixed steps; C = 0: decode rows
only), ten replays, three ways: every product on the own kernels, the backend as it ships (gemm_few for 3-32
tokens, cuBLAS from its thresholds), and cuBLAS for every product of 3 tokens or more (gemm_few off).
Needs a GPU and cuBLAS (``leat-backend-cuda[cublas]``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from leat.batch import Batch, Row
from leat_backend_cuda.backend import CUBLAS_MIN_TOKENS, CUBLAS_MIN_TOKENS_F16
from leat_backend_cuda.bench import step_ms, with_cublas

OWN, CUBLAS = 1 << 30, 1
NEVER = (OWN, OWN)  # few_tokens that no product falls in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", default="256,384,512,1024,2048")
    ap.add_argument("--steps", default="64:128,32:224")
    args = ap.parse_args()
    backend, arch = with_cublas(args.model)
    default_few = backend.few_tokens
    sizes = [int(n) for n in filter(None, args.tokens.split(","))]
    steps = [tuple(int(x) for x in spec.split(":")) for spec in filter(None, args.steps.split(","))]
    slots = max([64] + [rows for rows, _ in steps]) + 1  # decode rows in slots 0.., the prompt in the last
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), slots, max(sizes, default=0) + 320, dtype="f16")
    tokens = np.random.default_rng(0).integers(0, arch.vocab_size, max(sizes + [c for _, c in steps] + [64]))
    print("| prompt tokens | own GEMM tok/s | cuBLAS tok/s |\n|---|---|---|")
    for n in sizes:
        rates = []
        for threshold in (OWN, CUBLAS):
            backend.cublas_min_tokens = backend.cublas_min_tokens_f16 = threshold
            batch = Batch([Row(slots - 1, 0, tokens[:n])])
            backend.to_host(arch.forward(batch, kv))
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                backend.to_host(arch.forward(batch, kv))
                best = min(best, time.perf_counter() - start)
            rates.append(n / best)
        print(f"| {n} | {rates[0]:,.0f} | {rates[1]:,.0f} |", flush=True)
    print("\n| graph step | own kernels ms | as shipped ms | cuBLAS from 3 tokens ms |\n|---|---|---|---|")
    shipped = (CUBLAS_MIN_TOKENS, CUBLAS_MIN_TOKENS_F16)
    for rows, chunk in steps:
        prompt = [Row(slots - 1, 0, tokens[:chunk])] if chunk else []
        batch = Batch([Row(s, 300, tokens[s : s + 1]) for s in range(rows)] + prompt)
        times = []
        for (plain, f16), few in (((OWN, OWN), default_few), (shipped, default_few), ((CUBLAS, CUBLAS), NEVER)):
            backend.cublas_min_tokens, backend.cublas_min_tokens_f16 = plain, f16
            backend.few_tokens = few
            times.append(step_ms(backend, arch.forward, batch, kv, 10))
        label = f"{rows} decode rows{f' + {chunk}-token chunk' if chunk else ''}"
        print(f"| {label} | {' | '.join(f'{t:.2f}' for t in times)} |", flush=True)


if __name__ == "__main__":
    main()
