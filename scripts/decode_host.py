#!/usr/bin/env python3
"""What a `leat bench` tg token costs on the CUDA backend beside the GPU's own step: one token at ``--position``
through its captured graph, timed in parts (the enqueue until ``Backend.run`` returns, the wait for the device, the
logits' download by ``to_host``, and the same download into page-locked memory and out of it), then as
``leat bench``'s tg loop runs it (``run`` and ``to_host`` a token) and back to back without downloads (the GPU's
step alone).

    python scripts/decode_host.py MODEL.gguf [--position 128] [--context N] [--reps 200] [--rounds 3]

A token's time over the back-to-back step is the host's share: the enqueue, the download, and whatever of them
the device does not overlap. Needs a GPU.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from leat_backend_cuda import driver
from leat_backend_cuda.backend import _ready
from leat_backend_cuda.bench import one_token_step, step_arguments

PARTS = ("enqueue", "wait", "to_host", "page-locked download", "copy out of page-locked memory")


def main() -> None:
    ap = step_arguments(__doc__, rounds=3)
    ap.set_defaults(reps=200)
    args = ap.parse_args()
    backend, arch, batch, kv = one_token_step(args.model, args.position, args.context)
    cu = driver._cu()

    def run():
        return backend.run(arch.forward, batch, kv)

    def pinned_download(out, pinned: driver.Pinned, nbytes: int) -> None:
        driver.check(cu.cuMemcpyDtoHAsync(pinned.ptr, _ready(out).ptr, nbytes, backend.device.stream))
        backend.device.synchronize()

    for _ in range(5):
        backend.to_host(run())
    logits = _ready(run())
    nbytes = logits.size * logits.dtype.itemsize
    pinned = driver.Pinned(nbytes)
    timed, same = [], True
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        backend.device.synchronize()
        t2 = time.perf_counter()
        host = backend.to_host(out)
        t3 = time.perf_counter()
        pinned_download(out, pinned, nbytes)
        t4 = time.perf_counter()
        copy = pinned.array[:nbytes].view(host.dtype).reshape(host.shape).copy()
        t5 = time.perf_counter()
        same = same and np.array_equal(copy, host)
        timed.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4))
    print(f"one token at position {args.position}, {nbytes:,} bytes of logits; medians (minimums) of {args.reps}\n")
    print("| part | ms | min ms |\n|---|---:|---:|")
    for i, part in enumerate(PARTS):
        print(f"| {part} | {1e3 * statistics.median(t[i] for t in timed):.4f} | {1e3 * min(t[i] for t in timed):.4f} |")
    print(f"\nthe page-locked copy equals to_host's: {same}\n")
    print("| loop | round | ms a token | tok/s |\n|---|---:|---:|---:|")
    loops = {
        "run + to_host (leat bench's tg)": lambda out: backend.to_host(out),
        "run + page-locked download + copy": lambda out: (pinned_download(out, pinned, nbytes), pinned.array.copy()),
        "run alone, back to back": None,
    }
    for name, download in loops.items():
        for index in range(1, args.rounds + 1):
            start = time.perf_counter()
            for _ in range(128):
                out = run()
                if download is not None:
                    download(out)
            backend.device.synchronize()
            seconds = (time.perf_counter() - start) / 128
            print(f"| {name} | {index} | {1e3 * seconds:.4f} | {1 / seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
