#!/usr/bin/env python3
"""Where one decode step (or prefill chunk) of the tinygrad backend spends its device time, kernel by kernel.

    DEV=CUDA python scripts/tinygrad_kernel_times.py FILE [--context 128] [--steps 3] [--prefill 512] [--rows 1]

A child process loads FILE on the tinygrad backend, fills ``--context`` positions and runs ``--steps`` one-token
decode steps under the backend's TinyJit (the first captures, the later ones replay), with tinygrad's ``JIT=2`` (a
replay runs its kernels one by one instead of as a CUDA graph) and ``DEBUG=2`` (each kernel timed on the device as
it runs). The last step's kernels are summed by name (each shape is its own row). The times are tinygrad's
per-kernel synchronised timings, not a graph's: what each kernel costs alone, to find the ones that bound the
step. ``--rows N`` decodes N sequences together (slot r filled with ``context - 8 r`` positions first, at least
one: rows at different depths, one step of N rows). ``--prefill N`` times a chunk of N prompt tokens at position 0 instead (run ``--steps`` times: the first
captures its TinyJit, the last is reported). On the NULL device
(``DEV=NULL:CUDA:sm_90``, no GPU) the kernels and their count are real and every time is a placeholder.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict

MARK = "#step-begin"
LINE = re.compile(r"^\*\*\*\s+(\S+)\s+\d+\s+(.+?)\s+arg\s+\d+\s+mem\s+\S+\s+GB\s+tm\s+([\d.]+)(us|ms|s)\b")
UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def child(path: str, context: int, steps: int, prefill: int, rows: int = 1) -> None:
    import leat
    import numpy as np
    from leat.batch import Batch, Row

    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    kv = model.new_kv(max(context + steps, prefill) + 1, slots=rows, dtype="f16")
    ids = np.arange(1000, 1000 + max(context + steps, prefill), dtype=np.int64) % model.architecture.vocab_size
    if prefill:
        for _ in range(steps):
            print(MARK, flush=True)
            backend.to_host(backend.run(forward, Batch([Row(0, 0, ids[:prefill])]), kv))
        print(MARK, flush=True)
        return
    depths = [max(context - 8 * r, 1) if context else 0 for r in range(rows)]
    for slot, depth in enumerate(depths):
        if depth:
            backend.to_host(backend.run(forward, Batch([Row(slot, 0, ids[:depth])]), kv))
    for i in range(steps):
        print(MARK, flush=True)
        step = [Row(slot, d + i, ids[d + i : d + i + 1]) for slot, d in enumerate(depths)]
        backend.to_host(backend.run(forward, Batch(step), kv))
    print(MARK, flush=True)


def kernel_times(text: str) -> dict[str, tuple[int, float]]:
    """(launches, seconds) per kernel name over the lines between the last two step marks of DEBUG=2 output."""
    parts = text.split(MARK)
    step = parts[-2] if len(parts) >= 3 else text
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for raw in step.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", raw)
        match = LINE.match(line)
        if match is None or match.group(2).startswith("copy"):
            continue
        entry = table[match.group(2)]
        entry[0] += 1
        entry[1] += float(match.group(3)) * UNIT[match.group(4)]
    return {name: (int(n), s) for name, (n, s) in table.items()}


def report(table: dict[str, tuple[int, float]]) -> str:
    total = sum(s for _, s in table.values()) or 1e-30
    lines = [
        f"# {sum(n for n, _ in table.values())} kernels, {total * 1e3:.3f} ms summed",
        "| kernel | launches | us | share |",
        "|---|---:|---:|---:|",
    ]
    for name, (n, s) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{name}` | {n} | {s * 1e6:.1f} | {100 * s / total:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=128, help="positions in the cache before the timed steps")
    ap.add_argument("--steps", type=int, default=3, help="decode steps (the last is reported)")
    ap.add_argument("--prefill", type=int, default=0, help="time a prompt chunk of this many tokens instead")
    ap.add_argument("--rows", type=int, default=1, help="decode this many sequences together")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.context, args.steps, args.prefill, args.rows)
        return
    env = dict(os.environ, DEBUG="2", JIT="2")
    command = [sys.executable, __file__, args.model, "--context", str(args.context), "--steps", str(args.steps)]
    command += ["--prefill", str(args.prefill), "--rows", str(args.rows)]
    done = subprocess.run([*command, "--child"], check=False, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-4000:])
    print(report(kernel_times(done.stdout)))


if __name__ == "__main__":
    main()
