#!/usr/bin/env python3
"""What each kind of kernel costs inside the CUDA backend's graph-replayed one-token decode step: the step timed as
it is, then with every launch of one kind left out (its launcher made a no-op before the graph is captured), and
with only the products (``gemv_q``) left in.

    python scripts/decode_parts.py MODEL.gguf [--position 128] [--context N] [--reps 50] [--rounds 3]

A kind is a kernel's name up to its template arguments (``attention`` is not ``attention_combine``). The step's
values are wrong once a kernel is left out, so this is for dense files only (a MoE step's routing would read
garbage); what it measures is the time the rest of the step takes, launch gaps included, which is what removing or
fusing that kind of kernel could save at most. Each figure is the median of ``--rounds`` timings. Needs a GPU.
"""

from __future__ import annotations

import statistics
from collections import Counter

from leat_backend_cuda import driver
from leat_backend_cuda.bench import one_token_step, step_arguments, step_ms


def main() -> None:
    ap = step_arguments(__doc__, rounds=3)
    args = ap.parse_args()
    backend, arch, batch, kv = one_token_step(args.model, args.position, args.context)

    launch = driver.Kernel.__call__
    launched: Counter[str] = Counter()
    skip: set[str] = set()
    keep: set[str] | None = None

    def call(self: driver.Kernel, *a, **kw) -> None:
        kind = self.name.split("<")[0]  # the kernel's name up to its template arguments
        if backend._capturing:  # the graph's launches, once a capture
            launched[kind] += 1
        if kind in skip or (keep is not None and kind not in keep):
            return
        launch(self, *a, **kw)

    driver.Kernel.__call__ = call  # type: ignore[method-assign]

    def step() -> float:
        return statistics.median(step_ms(backend, arch.forward, batch, kv, args.reps) for _ in range(args.rounds))

    base = step()
    per_step = {name: count // args.rounds for name, count in launched.items()}
    print(f"whole step: {base:.4f} ms ({1e3 / base:.1f} tok/s), {sum(per_step.values())} launches\n")
    print("| left out | launches | ms a step | saved ms | saved |\n|---|---:|---:|---:|---:|")
    for name, count in sorted(per_step.items(), key=lambda kv: -kv[1]):
        skip = {name}
        ms = step()
        print(f"| `{name}` | {count} | {ms:.4f} | {base - ms:.4f} | {100 * (1 - ms / base):.1f}% |", flush=True)
    skip = set()
    keep = {"gemv_q"}
    ms = step()
    others = sum(c for n, c in per_step.items() if n != "gemv_q")
    print(f"| all but `gemv_q` | {others} | {ms:.4f} | {base - ms:.4f} | {100 * (1 - ms / base):.1f}% |")


if __name__ == "__main__":
    main()
