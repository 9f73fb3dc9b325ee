#!/usr/bin/env python3
"""What each kind of kernel costs inside the tinygrad backend's replayed one-token decode step: the step timed as it
is, then with every kernel of one kind left out of its TinyJit, then with only the products (``gemv_*``) left in.

    DEV=CUDA python scripts/tinygrad_step_parts.py FILE [--capacity 640] [--context 512] [--steps 50] [--rounds 3]

The backend captures its decode step once (a cache of ``--capacity`` positions filled to ``--context`` by a prompt);
each variant then replaces the TinyJit's captured kernels with a copy that lacks a kind (re-batched into graphs as
tinygrad batches them) and times ``--steps`` steps issued back to back at one position, the device's pace (the host
enqueues a step in a fraction of its device time; ``scripts/tinygrad_step_times.py``). A kind is a kernel's name up
to its sizes (``gemv_q4_k``, ``rms_norm``, ``attn_scores``; tinygrad's own kernels ``E`` and ``r``). The step's values
are wrong once a kernel is left out, so this is for dense files only; what it measures is the time the rest of the
step takes, launch gaps included: what removing or fusing that kind could save at most (the CUDA backend's
``scripts/decode_parts.py`` does the same for its graph). Each figure is the median of ``--rounds`` timings. On the
NULL device (``DEV=NULL:CUDA:sm_90``, no GPU) the kernels and their kinds are real and every time is meaningless.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import Counter

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PRODUCTS = "gemv_"


def kind(name: str) -> str:
    """A kernel's kind: its name (tinygrad's colours taken out) up to the first of its sizes."""
    return re.sub(r"(_\d+).*$", "", ANSI.sub("", name))


def _program(call):
    from tinygrad.uop.ops import Ops

    return call.src[0] if call.op is Ops.CALL and call.src[0].op is Ops.PROGRAM else None


def kinds(linear) -> Counter[str]:
    """Launches of each kind of kernel in a captured linear (graph batches opened)."""
    from tinygrad.uop.ops import Ops

    counted: Counter[str] = Counter()
    for call in linear.src:
        if call.op is Ops.CALL and call.src[0].op is Ops.CUSTOM_FUNCTION:  # a graph: its batch's calls
            counted += kinds(call.src[0].src[0])
        elif (program := _program(call)) is not None:
            counted[kind(program.arg.name)] += 1
    return counted


def without(linear, leave_out):
    """The captured linear with the kernels whose kind ``leave_out`` accepts taken out of it and out of its graphs'
    batches (each batch re-made from what remains, as tinygrad makes one)."""
    from tinygrad.engine.jit import create_graph_call
    from tinygrad.uop.ops import Ops

    kept = []
    for call in linear.src:
        if call.op is Ops.CALL and call.src[0].op is Ops.CUSTOM_FUNCTION:
            batch = [c for c in call.src[0].src[0].src if (p := _program(c)) is None or not leave_out(kind(p.arg.name))]
            kept += batch if len(batch) <= 1 else [create_graph_call(batch)]
        elif (program := _program(call)) is None or not leave_out(kind(program.arg.name)):
            kept.append(call)
    return linear.replace(src=tuple(kept))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--capacity", type=int, default=640, help="cache positions (leat bench's pp512 + tg128)")
    ap.add_argument("--context", type=int, default=512, help="positions filled before the step")
    ap.add_argument("--steps", type=int, default=50, help="steps a timing")
    ap.add_argument("--rounds", type=int, default=3, help="timings a variant (their median is shown)")
    args = ap.parse_args()
    if not 0 < args.context < args.capacity:
        ap.error("--context must be at least 1 and under --capacity")

    import leat
    import numpy as np
    from leat.batch import Batch, Row
    from tinygrad import Device
    from tinygrad.engine.jit import CapturedJit

    model = leat.load(args.model, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    kv = model.new_kv(args.capacity, slots=1, dtype="f16")
    ids = np.arange(1000, 1000 + args.capacity, dtype=np.int64) % model.architecture.vocab_size
    backend.to_host(backend.run(forward, Batch([Row(0, 0, ids[: args.context])]), kv))
    p = args.context
    batch = Batch([Row(0, p, ids[p : p + 1])])
    for _ in range(3):  # the capture, then replays
        backend.to_host(backend.run(forward, batch, kv))
    jit = next((j for key, j in backend._jits.items() if key[1:] == (id(kv), 1)), None)
    if jit is None or jit.captured is None:
        raise SystemExit("the decode step did not run under TinyJit (a forward that runs eagerly?)")
    captured = jit.captured
    device = Device[backend.device]

    def timed(linear) -> float:
        jit.captured = CapturedJit(captured.ret, linear, captured.expected_names, captured.expected_input_info)
        backend.run(forward, batch, kv)  # a warm-up of this variant (its graphs made)
        device.synchronize()
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                backend.run(forward, batch, kv)
            device.synchronize()
            times.append((time.perf_counter() - start) / args.steps * 1e3)
        return statistics.median(times)

    counted = kinds(captured._linear)
    print(f"# {args.model}: a one-token step at position {p}, {sum(counted.values())} kernels")
    print(f"# DEV={backend.device}, {args.steps} steps back to back a timing, median of {args.rounds}")
    full = timed(captured._linear)
    rows = [("whole step", sum(counted.values()), full)]
    for name in sorted(counted, key=lambda k: -counted[k]):
        rows.append(
            (
                f"without {name}",
                sum(counted.values()) - counted[name],
                timed(without(captured._linear, {name}.__contains__)),
            )
        )
    products = sum(n for k, n in counted.items() if k.startswith(PRODUCTS))
    rows.append(("products only", products, timed(without(captured._linear, lambda k: not k.startswith(PRODUCTS)))))
    jit.captured = captured
    print("| variant | kernels | ms a step | the rest of the step without it |")
    print("|---|---:|---:|---:|")
    for label, n, ms in rows:
        saved = "" if label == "whole step" else f"{full - ms:.4f}"
        print(f"| {label} | {n} | {ms:.4f} | {saved} |")


if __name__ == "__main__":
    main()
