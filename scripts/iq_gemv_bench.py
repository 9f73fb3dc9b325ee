#!/usr/bin/env python3
"""GEMV speed of the IQ types on the CUDA backend beside Q4_K and Q4_0, on Llama-3-8B's matrix shapes.

    python scripts/iq_gemv_bench.py [TYPE ...] [--tokens 1 2 8] [--shapes 4096x4096 14336x4096 4096x14336]

Random blocks with small f16 scales (gguf-py cannot quantize the IQ types), uploaded as leat uploads a model's
weights; each product is `backend.matmul` (the path a model takes: gemv_q for 1-2 tokens, gemm_few for 3-32),
timed as bench.py's --micro does: 50 calls captured in a CUDA graph, the second replay timed. GB/s is the weight
bytes on the device over the time per call.
"""

import argparse

import gguf
import numpy as np
from leat.modelfile import Tensor
from leat_backend_cuda import quants
from leat_backend_cuda.backend import CUDABackend, _ready
from leat_backend_cuda.bench import time_it

Q = gguf.GGMLQuantizationType
DEFAULT = ["Q4_K", "Q4_0", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"]


def random_blocks(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scale = rng.uniform(0.002, 0.02, len(data)).astype(np.float16).view(np.uint16)
    if qtype == Q.IQ1_M:  # d is the top nibbles of the four u16 scale words
        words = data[:, 48:56].copy().view(np.uint16)
        nibbles = (scale[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & 0xF
        data[:, 48:56] = (words & 0x0FFF | nibbles << 12).astype(np.uint16).view(np.uint8)
    else:
        offsets = {Q.Q4_K: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
        for offset in offsets.get(qtype, (0,)):
            data[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("types", nargs="*", default=DEFAULT)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 8])
    parser.add_argument("--shapes", nargs="*", default=["4096x4096", "14336x4096", "4096x14336"])
    args = parser.parse_args()
    backend = CUDABackend()
    rng = np.random.default_rng(0)
    print(f"| {'type':8s} | {'rows x cols':12s} | {'tokens':>6s} | {'us':>8s} | {'GB/s':>6s} |")
    print(f"| {'-' * 8} | {'-' * 12} | {'-' * 5}: | {'-' * 7}: | {'-' * 5}: |")
    for name in args.types:
        qtype = Q[name]
        for shape in args.shapes:
            rows, cols = (int(v) for v in shape.split("x"))
            weight = backend.upload(Tensor("w", qtype, (rows, cols), random_blocks(qtype, rows, cols, rng)))
            for n in args.tokens:
                x = backend._permanent(rng.standard_normal((n, cols)).astype(np.float32), "bench")
                seconds = time_it(backend, lambda x=x, w=weight: _ready(backend.matmul(x, w)), 50)
                gbs = weight.memory.nbytes / seconds / 1e9
                print(f"| {name:8s} | {shape:12s} | {n:6d} | {seconds * 1e6:8.1f} | {gbs:6.0f} |", flush=True)
    print(f"NVRTC types compiled: {sorted(q.name for q in quants.LAYOUTS)}")


if __name__ == "__main__":
    main()
