#!/usr/bin/env python3
"""The CUDA backend's products of 33-128 tokens on one file: the tensor-core GEMM against gemm_rows's
instantiations at 1-4 blocks per SM (the split over K follows), per weight shape, then graph-replayed decode steps
of 33-128 rows through the GEMM and through gemm_rows as the backend chooses.

    python scripts/gemm_rows_paths.py MODEL.gguf [--tokens 33,48,64,96,128]

Each product is ``CUDABackend.matmul`` timed alone (20 launches captured in a graph, replayed, device time per
launch; x's f16 rows are made once and shared, as a layer's products share them). Cells read ``NT,RT/B: us`` for
gemm_rows with NT 8-token tiles, RT 16-row tiles a warp and B blocks per SM. Needs a GPU.
"""

from __future__ import annotations

import argparse

import numpy as np
from leat.batch import Batch, Row
from leat.modelfile import ModelFile
from leat_backend_cuda import quants
from leat_backend_cuda.backend import CUDABackend, _ready
from leat_backend_cuda.bench import architecture, matrices, step_ms, time_it

OFF = (1 << 30, 1 << 30)  # rows_tokens that no product falls in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", default="33,48,64,96,128")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    file = ModelFile(args.model)
    backend = CUDABackend()
    arch = architecture(file, None)(file, backend)
    sms, default = backend.device.sm_count, (backend.rows_tokens, backend.rows_blocks)
    seen = {}
    for _, m in matrices(arch):
        seen.setdefault((m.qtype, m.rows, m.cols), m)
    rng = np.random.default_rng(0)
    print("| weight | tokens | GEMM us | gemm_rows cells |\n|---|---|---|---|")
    for (qtype, rows, cols), m in sorted(seen.items(), key=lambda kv: -kv[1].memory.nbytes):
        for n in tokens:
            x = backend._permanent(rng.standard_normal((n, cols)).astype(np.float32), "bench")
            backend.rows_tokens = OFF
            gemm = time_it(backend, lambda x=x, m=m: _ready(backend.matmul(x, m)), 20) * 1e6
            backend.rows_tokens = (1, 1 << 20)
            cells = []
            for shape in quants.GEMM_ROWS_VARIANTS:
                for per_sm in (1, 2, 3, 4):
                    backend.rows_shape, backend.rows_blocks = shape, per_sm * sms
                    us = time_it(backend, lambda x=x, m=m: _ready(backend.matmul(x, m)), 20) * 1e6
                    cells.append(f"{shape[0]},{shape[1]}/{per_sm}: {us:.1f}")
            print(f"| {qtype.name} {rows}x{cols} | {n} | {gemm:.1f} | {' | '.join(cells)} |", flush=True)
    backend.rows_shape, (_, backend.rows_blocks) = None, default
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), max(tokens), 1024, dtype="f16")
    ids = rng.integers(0, arch.vocab_size, max(tokens))
    print("\n| decode rows | GEMM ms | gemm_rows ms |\n|---|---|---|")
    for n in tokens:
        batch = Batch([Row(s, 300, ids[s : s + 1]) for s in range(n)])
        steps = []
        for rows_tokens in (OFF, default[0]):
            backend.rows_tokens = rows_tokens
            steps.append(step_ms(backend, arch.forward, batch, kv))
        print(f"| {n} | {steps[0]:.2f} | {steps[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
