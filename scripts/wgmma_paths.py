#!/usr/bin/env python3
"""The CUDA backend's products of 9-64 tokens on one file, on Hopper: the path they take by default (cuBLAS over the
weights' f16 copies, gemm_few or gemm_rows) against gemm_wg (wgmma.py) at 1-3 blocks a multiprocessor, per weight
shape, then graph-replayed decode steps of 9-64 rows both ways.

    python scripts/wgmma_paths.py MODEL.gguf [--tokens 16,32,64] [--steps 9,16,32,64] [--blocks 1,2,3]

Each product is ``CUDABackend.matmul`` timed alone (20 launches captured in a graph, replayed, device time per
launch; x's f16 rows and gemm_wg's ordered copy of them are made once and shared, as a layer's products share
them), with the TB/s of its quantized weight and the TFLOP/s of its arithmetic. Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse

import numpy as np
from leat.batch import Batch, Row
from leat.modelfile import ModelFile
from leat_backend_cuda.backend import CUDABackend, _ready
from leat_backend_cuda.bench import architecture, matrices, step_ms, time_it

OFF = (1, 0)  # wg_tokens that no product falls in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", default="16,32,64")
    ap.add_argument("--steps", default="9,16,32,64")
    ap.add_argument("--blocks", default="1,2,3", help="gemm_wg's blocks a multiprocessor (its split over K follows)")
    args = ap.parse_args()
    tokens, steps = ([int(t) for t in s.split(",") if t] for s in (args.tokens, args.steps))
    per_sm = [int(b) for b in args.blocks.split(",")]
    file = ModelFile(args.model)
    backend = CUDABackend()
    if backend.device.arch != "sm_90":
        raise SystemExit(f"gemm_wg runs on sm_90, not {backend.device.arch}")
    arch = architecture(file, None)(file, backend)
    sms, blocks = backend.device.sm_count, backend.wg_blocks
    seen = {}
    for _, m in matrices(arch):
        seen.setdefault((m.qtype, m.rows, m.cols), m)
    rng = np.random.default_rng(0)
    print("| weight | tokens | default us | " + " | ".join(f"gemm_wg {b}/SM us (TB/s, TFLOP/s)" for b in per_sm) + " |")
    print("|---|---:|---:|" + "---:|" * len(per_sm))
    for (qtype, rows, cols), m in sorted(seen.items(), key=lambda kv: -kv[1].memory.nbytes):
        for n in tokens:
            x = backend._permanent(rng.standard_normal((n, cols)).astype(np.float32), "bench")
            backend.wg_tokens = OFF
            default = time_it(backend, lambda x=x, m=m: _ready(backend.matmul(x, m)), 20) * 1e6
            backend.wg_tokens = (1, 64)
            cells = []
            for b in per_sm:
                backend.wg_blocks = b * sms
                us = time_it(backend, lambda x=x, m=m: _ready(backend.matmul(x, m)), 20) * 1e6
                cells.append(f"{us:.1f} ({m.memory.nbytes / us / 1e6:.2f}, {2 * n * rows * cols / us / 1e6:.0f})")
            print(f"| {qtype.name} {rows}x{cols} | {n} | {default:.1f} | {' | '.join(cells)} |", flush=True)
    backend.wg_blocks = blocks
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), max(steps), 1024, dtype="f16")
    ids = rng.integers(0, arch.vocab_size, max(steps))
    print("\n| decode rows | default ms | gemm_wg ms | change |\n|---:|---:|---:|---:|")
    for n in steps:
        batch = Batch([Row(s, 300, ids[s : s + 1]) for s in range(n)])
        times = []
        for wg in (OFF, (1, 64)):
            backend.wg_tokens = wg
            times.append(step_ms(backend, arch.forward, batch, kv))
        print(f"| {n} | {times[0]:.3f} | {times[1]:.3f} | {100 * (times[1] / times[0] - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
