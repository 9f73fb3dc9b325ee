#!/usr/bin/env python3
"""The CUDA backend's products of a few tokens on one file: gemm_few's instantiations against the matrix-vector
kernel and the GEMM, per weight shape, then graph-replayed decode steps of 1-64 rows without gemm_few, with it, and with gate and up in one launch.

    python scripts/small_batch_paths.py MODEL.gguf [--tokens 1,4,8,16,24,32,48,64] [--rows 1,2,4,8,16,32,64]

Each product is timed alone (20 launches captured in a graph, replayed, device time per launch), x already in
f16 (x_to_f16 runs once per input and is shared by the products that read it). ``old`` is the path without
gemm_few (gemv_q up to 4 tokens where its shared memory fits, else the tensor-core GEMM); ``few (NT, RT)`` is
gemm_few with NT 8-token tiles and RT 16-row tiles a block. The steps table shows what quants.gemm_few_shape
chooses. Needs a GPU.
"""

from __future__ import annotations

import argparse

import numpy as np
from leat.batch import Batch, Row
from leat.modelfile import ModelFile
from leat_backend_cuda import compiler, driver, quants
from leat_backend_cuda.backend import CUDABackend, _ready
from leat_backend_cuda.bench import architecture, matrices, step_ms, time_it

NEVER = (1 << 30, 1 << 30)  # few_tokens that no product falls in
SHAPES = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", default="1,4,8,16,24,32,48,64")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = ap.parse_args()
    file = ModelFile(args.model)
    backend = CUDABackend()
    arch = architecture(file, None)(file, backend)
    default = backend.few_tokens
    seen = {}
    for _, m in matrices(arch):
        seen.setdefault((m.qtype, m.rows, m.cols), m)
    modules = {}
    for qtype in {q for q, _, _ in seen}:
        names = [quants.gemm_few_name(qtype, s) for s in SHAPES]
        built = compiler.compile_program("matmul.cu", names, backend.device.arch)
        smem = {quants.gemm_few_name(qtype, s): quants.gemm_few_smem(s) for s in SHAPES}
        modules[qtype] = driver.Module(backend.device, built.cubin, built.names, built.params, smem)
    rng = np.random.default_rng(0)
    print("| weight | tokens | path | us | GB/s |\n|---|---|---|---|---|")
    for (qtype, rows, cols), m in sorted(seen.items(), key=lambda kv: -kv[1].memory.nbytes):
        for n in (int(t) for t in args.tokens.split(",")):
            x = backend._permanent(rng.standard_normal((n, cols)).astype(np.float32), "bench")
            xh, xscale = backend._f16_rows(x, n, cols)
            out = backend._empty((n, rows))
            backend.few_tokens = NEVER
            timings = [("old", time_it(backend, lambda x=x, m=m: _ready(backend.matmul(x, m)), 20))]
            tiles = 1 << max(0, (n - 1).bit_length() - 3)  # the fewest 8-token tiles that hold n
            for shape in (s for s in SHAPES if s[0] == tiles):
                kernel = modules[qtype][quants.gemm_few_name(qtype, shape)]
                grid = (-(-rows // (16 * shape[1])),)
                params = (m.ptr, 0, m.blocks, xh, xscale, out, None, rows, n, cols)
                smem = quants.gemm_few_smem(shape)
                call = lambda k=kernel, g=grid, p=params, s=smem: k(g, 256, *p, smem=s)
                timings.append((f"few {shape}", time_it(backend, call, 20)))
            for label, seconds in timings:
                rate = m.memory.nbytes / seconds / 1e9
                print(f"| {qtype.name} {rows}x{cols} | {n} | {label} | {seconds * 1e6:.1f} | {rate:,.0f} |", flush=True)
    print(
        "\n| decode rows | step ms, without gemm_few | gemm_few, gate and up apart | gemm_few_shape's, gated | tok/s |"
    )
    print("|---|---|---|---|---|")
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), 64, 1024, dtype="f16")
    tokens = rng.integers(0, arch.vocab_size, 64)
    for n in (int(r) for r in args.rows.split(",")):
        batch = Batch([Row(s, 300, tokens[s : s + 1]) for s in range(n)])
        steps = []
        for few, gated in ((NEVER, False), (default, False), (default, True)):
            backend.few_tokens, backend.few_gated = few, gated
            steps.append(step_ms(backend, arch.forward, batch, kv))
        print(f"| {n} | {steps[0]:.2f} | {steps[1]:.2f} | {steps[2]:.2f} | {n / steps[2] * 1e3:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
