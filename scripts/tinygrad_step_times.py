#!/usr/bin/env python3
"""Decode steps of the tinygrad backend timed three ways, to tell a step bound on the host from one bound on the
device, and to see how a step's cost follows the cache's size and the rows' depth.

    DEV=CUDA python scripts/tinygrad_step_times.py FILE [--capacity 128] [--context 0] [--steps 128] [--rows 1]

A cache of ``--capacity`` positions a slot (``--rows`` slots); each slot filled to ``--context`` positions by one
prompt chunk; then ``--steps`` decode steps of all rows, at positions context .. context + steps - 1, run four times
(the first, untimed, captures the backend's TinyJit steps; later runs overwrite the same cache entries, as
``leat bench``'s repetitions do). The defaults are ``leat bench``'s tg128 loop. The three timed runs:

- ``synced``: each step's logits copied to the host before the next step, as ``leat bench`` and a sampler do;
- ``enqueued``: the steps issued back to back, one copy to the host at the end (the host's time to issue a step,
  ``host``, printed beside it): where this is as slow as ``device``, the device is the bound;
- ``device``: the steps again under tinygrad's ``DEBUG=2``, which times each kernel or graph launch on the device
  (a CUDA graph with the device's events) and waits for it: the device time of a step's work.

With ``--split`` the synced steps run once more, each timed in three parts: issuing it (``backend.run``), waiting for
the device (its ``synchronize``), copying the logits to the host (``to_host``); on CUDA also with the copy made into
page-locked memory allocated once and then into a new array (what a pinned ``to_host`` would cost).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--capacity", type=int, default=128, help="cache positions a slot")
    ap.add_argument("--context", type=int, default=0, help="positions filled before the steps")
    ap.add_argument("--steps", type=int, default=128, help="decode steps a run")
    ap.add_argument("--rows", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--split", action="store_true", help="time a synced step's issue, wait and copy apart")
    args = ap.parse_args()
    if args.context + args.steps > args.capacity:
        ap.error(f"--context + --steps ({args.context + args.steps}) exceeds --capacity ({args.capacity})")

    import leat
    import numpy as np
    from leat.batch import Batch, Row
    from tinygrad import Context
    from tinygrad.helpers import GlobalCounters

    model = leat.load(args.model, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    kv = model.new_kv(args.capacity, slots=args.rows, dtype="f16")
    ids = np.arange(1000, 1000 + args.capacity, dtype=np.int64) % model.architecture.vocab_size
    if args.context:
        for slot in range(args.rows):
            backend.to_host(backend.run(forward, Batch([Row(slot, 0, ids[: args.context])]), kv))
    positions = range(args.context, args.context + args.steps)

    def step(p: int):
        return backend.run(forward, Batch([Row(slot, p, ids[p : p + 1]) for slot in range(args.rows)]), kv)

    for p in positions:  # capture
        backend.to_host(step(p))
    start = time.perf_counter()
    for p in positions:
        backend.to_host(step(p))
    synced = (time.perf_counter() - start) / args.steps
    start, host = time.perf_counter(), 0.0
    for p in positions:
        issued = time.perf_counter()
        out = step(p)
        host += time.perf_counter() - issued
    backend.to_host(out)
    enqueued, host = (time.perf_counter() - start) / args.steps, host / args.steps
    GlobalCounters.reset()
    with Context(DEBUG=2), contextlib.redirect_stdout(io.StringIO()):
        for p in positions:
            backend.to_host(step(p))
    device = GlobalCounters.time_sum_s / args.steps
    parts = split(backend, step, positions) if args.split else {}
    rows = args.rows
    print(
        f"# {args.model}: {rows} row(s), cache {kv.page_size * kv.tables[0].shape[1]} positions a slot, "
        f"positions {positions.start}-{positions.stop - 1}"
    )
    print("| run | ms a step | tok/s |")
    print("|---|---:|---:|")
    for name, seconds in (("synced", synced), ("enqueued", enqueued), ("host (issuing a step)", host)):
        print(f"| {name} | {seconds * 1e3:.3f} | {rows / seconds:.1f} |")
    print(f"| device (DEBUG=2) | {device * 1e3:.3f} | {rows / device:.1f} |")
    for name, seconds in parts.items():
        print(f"| synced, {name} | {seconds * 1e3:.3f} | |")


def split(backend, step, positions) -> dict[str, float]:
    """A synced step's parts, each the mean over ``positions``: issuing, waiting for the device, copying the
    logits out (to_host), and on CUDA the copy into page-locked memory then into a new array."""
    import ctypes

    import numpy as np
    from tinygrad import Device
    from tinygrad.device import BufferSpec
    from tinygrad.uop.ops import Ops

    out = step(positions.start)
    backend.to_host(out)
    device = Device[out.device]
    base = out.uop.base
    buffer = base.realized if base.op is Ops.BUFFER else None
    pinned = None
    if buffer is not None and type(device.allocator).__name__ == "CUDAAllocator":
        pointer = device.allocator._alloc(buffer.nbytes, BufferSpec(host=True))
        pinned = memoryview((ctypes.c_char * buffer.nbytes).from_address(pointer.value)).cast("B")
    parts: dict[str, float] = {}
    for copy in ("to_host", "page-locked") if pinned is not None else ("to_host",):
        issue = wait = moved = 0.0
        for p in positions:
            began = time.perf_counter()
            out = step(p)
            issued = time.perf_counter()
            device.synchronize()
            waited = time.perf_counter()
            if copy == "to_host":
                backend.to_host(out)
            else:
                buffer = out.uop.base.realized
                buffer.allocator._copyout(pinned, buffer._buf)
                np.frombuffer(pinned, np.float32).copy()
            done = time.perf_counter()
            issue, wait, moved = issue + issued - began, wait + waited - issued, moved + done - waited
        n = len(positions)
        parts[f"issuing ({copy})"], parts[f"waiting ({copy})"] = issue / n, wait / n
        parts[f"copying logits ({copy})"] = moved / n
    return parts


if __name__ == "__main__":
    main()
