#!/usr/bin/env python3
"""What the GPU would run for the tinygrad backend's decode products (gemv.py), without a GPU: each product is built
on tinygrad's NULL device, its kernel source as tinygrad renders it for CUDA is compiled by NVRTC to a cubin and read
back with ``cuobjdump``: registers, the instructions of the main loop (the shortest backward branch holding a global
load), of the whole kernel, the lanes' sum (``lanesum.py``: its shuffles, local loads and barriers; where it is a
loop, the loop of local loads), and warp instructions a weight (each loop counted as often as it runs).

    NVRTC_PATH=.../nvidia/cu13/lib/libnvrtc.so.13 DEV=NULL:CUDA:sm_90 NULL_ALLOW_COPYOUT=1 \\
        python scripts/tinygrad_sass.py [--only gated ...] [--shape 64,1,2] [--rows 1] [--integer] [--cuobjdump PATH]

The products are the Llama-3-8B file's (``tinygrad_gemv_shapes.py``'s list); ``--shape`` is a ``gemv.Shape`` as
``lanes,groups,per_thread`` (default: the backend's choice for each product); ``--integer`` gives the Q4_K and Q6_K products x
as 16-bit integers (``intx.py``'s integer dot products). ``cuobjdump`` comes as
``scripts/kernel_sass.py`` says. Compare with the CUDA backend's gemv_q (``kernel_sass.py``): 0.062 warp
instructions a weight for its gated unit's loop. ``LEAT_TINYGRAD_LANE_SUM=group`` counts tinygrad's GROUP_REDUCE in
place of the default butterfly of shuffles.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from kernel_sass import INSTRUCTION, cuobjdump, innermost_loop
from tinygrad_gemv_shapes import MATRICES, blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=[], help="products whose names start with one of these")
    parser.add_argument("--shape", help="lanes,groups,per_thread (default: gemv.Shape.for_product's)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--integer", action="store_true", help="Q4_K and Q6_K products of 16-bit integer x (intx.py)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = parser.parse_args()
    from leat_backend_tinygrad.gemv import LAYOUTS, Shape, as_words, gemv
    from tinygrad import Device, Tensor
    from tinygrad.helpers import CCACHE, PARALLEL
    from tinygrad.runtime.support import compiler_cuda

    PARALLEL.value = 0  # compile in this process (a schedule of several kernels compiles in worker processes)
    CCACHE.value = 0  # compile every kernel (from tinygrad's disk cache the compiler would not see it); before the
    # device opens, which gives its compiler the cache key

    sources: list[str] = []
    compile_ = compiler_cuda.NVRTCCompiler.compile

    def recording(self, src: str) -> bytes:
        sources.append(src)
        return compile_(self, src)

    compiler_cuda.NVRTCCompiler.compile = recording  # type: ignore[method-assign]
    to_cubin = compiler_cuda.NVRTCCompiler(args.arch, ptx=False, cache_key="leat_sass")
    tool = Path(args.cuobjdump)
    rng = np.random.default_rng(0)
    print(f"# {Device.DEFAULT}, {args.rows} row(s) of x\n")
    from leat_backend_tinygrad import lanesum

    mode = lanesum.mode(Device.DEFAULT)
    print(f"lanes summed by: {mode}\n")
    print(
        "| product | shape | registers | loop instructions | runs | lanes' sum: SHFL, LDS, BAR, loop x runs "
        "| kernel instructions | warp instructions a weight |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for name, qtype, n, k in MATRICES:
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        gated = name == "gated unit"
        words = Tensor(as_words(blocks(qtype, n, k, rng), qtype))
        x = Tensor(rng.standard_normal((args.rows, k)).astype(np.float32))
        asked = Shape(*map(int, args.shape.split(","))) if args.shape else None
        shape = (asked or Shape.for_product(n, gated=gated, qtype=qtype)).fitting(n, True)
        sources.clear()
        from leat_backend_tinygrad import intx

        if args.integer and qtype in intx.DOTS:
            x = intx.quantize(x)
        gemv(x, words, qtype, asked, up=words if gated else None).realize()
        source = next(s for s in sources if "gemv_" in s)
        with tempfile.TemporaryDirectory() as folder:
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(to_cubin.compile(source))
            usage, sass = cuobjdump(tool, cubin, "-res-usage"), cuobjdump(tool, cubin, "-sass")
        registers = int(re.search(r"REG:(\d+)", usage).group(1))
        loop, code = innermost_loop(sass, "LDG"), INSTRUCTION.findall(sass)
        # the loop runs once a step: the row's blocks over the blocks its lanes read at once (gemv._kernel's steps)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        per_step = math.gcd(max(shape.lanes // math.prod(LAYOUTS[qtype].units), 1), k // block)
        runs = k // block // per_step
        # the lanes' sum as a loop of local loads (tinygrad's group reduce): every thread loads each lane's (or, after
        # the butterfly, each warp's) partial sum of each of its sums once
        ops = [op for _, op in code]
        sums = args.rows * shape.per_thread * (2 if gated else 1)
        total = per_step * math.prod(LAYOUTS[qtype].units)  # a result's lanes
        reads = sums * (total if mode == "group" else max(total // lanesum.WARP, 1))
        reduce = innermost_loop(sass, "LDS")
        in_loop = sum(op.startswith("LDS") for op in reduce)
        reduce_runs = reads // in_loop if in_loop else 1
        dynamic = len(code) + len(loop) * (runs - 1) + len(reduce) * (reduce_runs - 1)
        shuffles, local_loads, barriers = (sum(op.startswith(p) for op in ops) for p in ("SHFL", "LDS", "BAR"))
        summed = f"{shuffles}, {local_loads}, {barriers}, " + (f"{len(reduce)} x {reduce_runs}" if reduce else "-")
        warps = n // shape.per_thread * shape.lanes / 32
        weights = n * k * (2 if gated else 1)
        label = f"{shape.lanes},{shape.groups},{shape.per_thread}"
        print(
            f"| {name} {qtype.name} {n}x{k} | {label} | {registers} | {len(loop)} | {runs} | {summed} | {len(code)} | "
            f"{dynamic * warps / weights:.3f} |"
        )
        counts = Counter(op.split(".")[0] for op in loop)
        print("|  | loop: " + ", ".join(f"{op} {c}" for op, c in counts.most_common(8)) + " | | | | | | |", flush=True)


if __name__ == "__main__":
    main()
