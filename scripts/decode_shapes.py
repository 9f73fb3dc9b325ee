#!/usr/bin/env python3
"""The CUDA backend's one-token decode step under other gemv_q shapes: for each kind of product a step launches
(its mode, rows and row length), every (rows a warp, units in flight, variant: plain, pipelined or split over K)
tried while the others keep ``quants.gemv_q_shape``'s choice, then the best of each together.

    python scripts/decode_shapes.py MODEL.gguf [--position 128] [--context N] [--reps 50] [--rounds 2] [--pipelined]
        [--split] [--rows N...]

A kind is (mode, rows, cols) as ``_gemv_q`` passes them to the shape rule: mode 1 has the RMS norm inside, 2 the
gated unit (3: both); rows is the sum over the launch's segments (q, k and v together). A step is graph-replayed
and timed on the device (``bench.step_ms``) at ``--position``; each figure is the median of ``--rounds`` timings.
The shapes not in ``quants.GEMV_Q_VARIANTS`` are compiled beside the backend's own (the gated unit's only up to 4
rows-and-units: it holds twice the weights), with the ROPE twins of the shapes q, k and v can take (rows a warp even,
not pipelined: a one-token step rotates and writes the cache in their epilogue; a shape without a twin falls back to
rope_kv_write). The split shapes (GEMV_Q_SPLIT: 8 warps a block, two a group of rows) have ROPE twins where their
rows a warp are even. ``--pipelined`` tries only the pipelined shapes, ``--split`` only the split ones; ``--rows``
only the kinds of those row counts (e.g. the q/k/v launches: 6144 5120 1024 on Llama-3-8B, 4096 its output matrix).
The rule's own choice follows LEAT_CUDA_GEMV_SPLIT. Needs a GPU.
"""

from __future__ import annotations

import statistics

from leat_backend_cuda import quants
from leat_backend_cuda.bench import one_token_step, step_arguments, step_ms

SHAPES = [
    (r, u, 0) for r, u in ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2))
]
# the pipelined loop holds the next step's weights too: the shapes whose loads fit twice
SHAPES += [(r, u, quants.GEMV_Q_PIPE) for r, u in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2))]
# split over K: a warp takes every other step of its rows' units
SHAPES += [(r, u, quants.GEMV_Q_SPLIT) for r, u in ((8, 2), (8, 1), (4, 2), (4, 1), (2, 2), (2, 1), (1, 2))]


def main() -> None:
    ap = step_arguments(__doc__, rounds=2)
    ap.add_argument("--pipelined", action="store_true", help="try only the pipelined shapes")
    ap.add_argument("--split", action="store_true", help="try only the shapes split over K")
    ap.add_argument("--rows", type=int, nargs="*", help="try only the kinds of these row counts")
    args = ap.parse_args()
    pipe, glu, split_bit = quants.GEMV_Q_PIPE, quants.GEMV_Q_GLU, quants.GEMV_Q_SPLIT
    shapes = [s for s in SHAPES if (not args.pipelined or s[2] & pipe) and (not args.split or s[2] & split_bit)]
    modes = range(2) if args.rows else range(4)  # q, k and v's launches have no gated unit: fewer to compile
    products = [(1, r, u, m | v) for r, u, v in shapes for m in modes]
    rope = [(1, r, u, m | v | quants.GEMV_Q_ROPE) for r, u, v in shapes if r % 2 == 0 and not v & pipe for m in (0, 1)]
    quants.GEMV_Q_VARIANTS = tuple(dict.fromkeys([*quants.GEMV_Q_VARIANTS, *products, *rope]))
    default_rule = quants.gemv_q_shape
    chosen: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    seen: dict[tuple[int, int, int], tuple[int, int, int]] = {}

    def rule(tokens: int, mode: int, rows: int, cols: int, split: bool = False) -> tuple[int, int, int]:
        if tokens != 1:
            return default_rule(tokens, mode, rows, cols, split)
        key = (mode, rows, cols)
        seen.setdefault(key, default_rule(tokens, mode, rows, cols, split))
        return chosen.get(key, seen[key])

    quants.gemv_q_shape = rule
    backend, arch, batch, kv = one_token_step(args.model, args.position, args.context)

    def step() -> float:
        return statistics.median(step_ms(backend, arch.forward, batch, kv, args.reps) for _ in range(args.rounds))

    base = step()
    print(f"default rule: {base:.4f} ms a step ({1e3 / base:.1f} tok/s)\n")
    print("| kind (mode, rows, cols) | default | shape | ms | against default |\n|---|---|---|---:|---:|")
    best: dict[tuple[int, int, int], tuple[tuple[int, int, int], float]] = {}
    for key, default in list(seen.items()):
        if args.rows and key[1] not in args.rows:
            continue
        best[key] = (default, base)
        for shape in shapes:
            loads = shape[0] * shape[1] * (2 if shape[2] & pipe else 1)  # rows x units a lane holds
            if shape == default or loads > (4 if key[0] & glu else 16):
                continue
            chosen[key] = shape
            ms = step()
            print(f"| {key} | {default} | {shape} | {ms:.4f} | {100 * (ms / base - 1):+.2f}% |", flush=True)
            if ms < best[key][1]:
                best[key] = (shape, ms)
        chosen.pop(key)
    for key, (shape, _) in best.items():
        chosen[key] = shape
    together = step()
    again = (chosen.clear(), step())[1]
    print(f"\nbest of each together: {together:.4f} ms ({1e3 / together:.1f} tok/s); default again: {again:.4f} ms")
    for key, (shape, ms) in best.items():
        print(f"  {key}: {shape} (alone {ms:.4f} ms)")


if __name__ == "__main__":
    main()
