#!/usr/bin/env python3
"""Where one decode step's and one prefill step's device time goes on the CUDA backend, kernel by kernel, against
the hardware's limits: each kernel's time, the DRAM bytes it moved (Nsight Compute's counters) and so its TB/s, and
for the weight products the TFLOP/s their shapes imply.

    python scripts/kernel_profile.py FILE --step decode --context 128 [--rows 64]
    python scripts/kernel_profile.py FILE --step prefill --tokens 512

It runs itself under ``ncu`` (``--ncu PATH``; Nsight Compute, found on the PATH or in /usr/local/cuda/bin), which
replays each kernel of the one step it marks (cuProfilerStart/Stop) to read ``gpu__time_duration``,
``dram__bytes_read`` and ``dram__bytes_write``, at the clocks the GPU runs at (``--clock-control none``; ncu's own
default locks them to the base clock); the step runs eagerly (a graph replays the same kernels). Rows are
kernels grouped by name (template arguments kept, so each weight type is its own row). The products' FLOPs are
2 x tokens x rows x columns of every weight matrix (the output matrix's at the rows whose logits are asked for),
summed over the time of every product kernel (a type's weights spread over several kernels, so no figure a row).
Serialized replay removes the overlap of consecutive kernels, so the sum can exceed the step's time in a graph
(printed beside it for comparison).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

PRODUCT = re.compile(r"gemv|gemm|nvjet|cutlass|sm90_xmma", re.IGNORECASE)  # kernels that multiply by weights
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")


def inner(args: argparse.Namespace) -> None:
    """The profiled process: load, warm up, then one step between cuProfilerStart and cuProfilerStop."""
    import numpy as np
    from leat.batch import Batch, Row
    from leat.modelfile import ModelFile
    from leat_backend_cuda import driver
    from leat_backend_cuda.backend import CUDABackend, _ready
    from leat_backend_cuda.bench import architecture, matrices

    file = ModelFile(args.model)
    backend = CUDABackend(graphs=False)
    arch = architecture(file, None)(file, backend)
    context = args.context + args.tokens + 1
    rows = args.rows if args.step == "decode" else 1
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), rows, context, dtype=args.kv)
    ids = np.random.default_rng(0).integers(0, arch.vocab_size, context, dtype=np.int64)
    if args.step == "decode":
        for slot in range(rows if args.context else 0):
            _ready(arch.forward(Batch([Row(slot, 0, ids[: args.context])]), kv))
        batch = Batch([Row(slot, args.context, ids[args.context : args.context + 1]) for slot in range(rows)])
    else:
        batch = Batch([Row(0, 0, ids[: args.tokens])])
    for _ in range(2):  # compiled, allocated and warm
        _ready(arch.forward(batch, kv))
    backend.device.synchronize()
    cu = driver._cu()
    driver.check(cu.cuProfilerStart(), "cuProfilerStart")
    _ready(arch.forward(batch, kv))
    backend.device.synchronize()
    driver.check(cu.cuProfilerStop(), "cuProfilerStop")
    tokens = len(batch)
    by_type: dict[str, float] = defaultdict(float)
    for _, weight in matrices(arch):
        # the output matrix multiplies only the rows whose logits are asked for (a prompt's last token)
        rows = len(batch.rows) if weight.rows == arch.vocab_size else tokens
        by_type[weight.qtype.name] += 2.0 * rows * weight.rows * weight.cols
    print(f"\nSTEP {tokens}", *(f"{k}={v}" for k, v in by_type.items()), flush=True)


def report(text: str, step_line: str) -> str:
    _, tokens, *pairs = step_line.split()
    types = {k: float(v) for k, v in (p.split("=") for p in pairs)}
    rows = [r for r in csv.reader(io.StringIO(text[text.index('"ID"') :]))]
    header, body = rows[0], [r for r in rows[1:] if r and r[0].isdigit()]
    col = {name: header.index(name) for name in ("Kernel Name", *METRICS)}
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for r in body:
        name = r[col["Kernel Name"]]
        k = kernels[name]
        k[0] += 1
        for i, metric in enumerate(METRICS, start=1):
            k[i] += float(r[col[metric]].replace(",", ""))
    total_ns = sum(k[1] for k in kernels.values())
    lines = [
        f"# {tokens} tokens: {len(body)} kernels, {total_ns / 1e6:.3f} ms summed (each replayed alone by ncu)",
        "| kernel | launches | time us | share | DRAM read MB | write MB | TB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    # no TFLOP/s a row: a type's weights are spread over several kernels (a decode step's q/k/v, o, gated unit and
    # down products; a prefill's cuBLAS kernels, whose names name no type), so only the products' sum is known
    for name, (n, ns, read, write) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        short = name if len(name) <= 70 else name[:67] + "..."
        lines.append(
            f"| `{short}` | {n:.0f} | {ns / 1e3:.1f} | {100 * ns / total_ns:.1f}% | {read / 1e6:.1f} | "
            f"{write / 1e6:.1f} | {(read + write) / ns / 1e3:.2f} |"
        )
    product_ns = sum(k[1] for name, k in kernels.items() if PRODUCT.search(name) or "dequantize" in name)
    lines.append(
        f"# weight products: {sum(types.values()) / 1e12:.3f} TFLOP in {product_ns / 1e6:.3f} ms of product kernels "
        f"(and their weights' dequantizing): {sum(types.values()) / max(product_ns, 1) / 1e3:.1f} TFLOP/s"
    )
    moved = sum(k[2] + k[3] for k in kernels.values())
    lines.append(f"# all kernels: {moved / 1e9:.3f} GB moved, {moved / total_ns / 1e3:.2f} TB/s over the summed time")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--step", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--context", type=int, default=128, help="decode: positions already in the cache")
    ap.add_argument("--tokens", type=int, default=512, help="prefill: the step's tokens")
    ap.add_argument("--rows", type=int, default=1, help="decode: sequences in the step (one token each)")
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument(
        "--clock-control",
        choices=("none", "base"),
        default="none",
        help="none: the clocks the GPU runs at when serving; base: ncu's default, locked to the base clock",
    )
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step == "decode":
        args.tokens = 1
    else:
        args.context = 0
    if args.inner:
        inner(args)
        return
    command = [args.ncu, "--profile-from-start", "off", "--metrics", ",".join(METRICS), "--csv", "--page", "raw"]
    command += ["--clock-control", args.clock_control]
    command += ["--print-units", "base", sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--inner"]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    step = re.search(r"STEP [^\n]+", out.stdout)  # the profiled process's line, wherever ncu's output put it
    if out.returncode or step is None or '"ID"' not in out.stdout:
        raise SystemExit(f"ncu failed ({out.returncode}):\n{out.stdout[:3000]}\n{out.stderr[-2000:]}")
    print(report(out.stdout.replace(step.group(0), ""), step.group(0)))


if __name__ == "__main__":
    main()
