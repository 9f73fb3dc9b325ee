"""Time the host side of the tinygrad backend on the 8B file: load, prefill 512, decode steps.
Run with DEV=NULL:CUDA:sm_90 NULL_ALLOW_COPYOUT=1 locally (renders and compiles CUDA kernels with NVRTC, runs none)."""

import sys
import time

begin = time.perf_counter()
import leat
import numpy as np
from leat.batch import Batch, Row

path = sys.argv[1]
phases = sys.argv[2].split(",") if len(sys.argv) > 2 else ["prefill", "decode"]
model = leat.load(path, backend="tinygrad")
print("load", round(time.perf_counter() - begin, 1), "s", flush=True)
be, fwd = model.backend, model.architecture.forward
ids = np.arange(1000, 1512, dtype=np.int64)
if "prefill" in phases:
    kv = model.new_kv(512, dtype="f16")
    for rep in range(2):
        t = time.perf_counter()
        out = be.run(fwd, Batch([Row(0, 0, ids)]), kv)
        be.to_host(out)
        print("prefill512 call", rep, round(time.perf_counter() - t, 2), "s", flush=True)
if "decode" in phases:
    kv = model.new_kv(128, dtype="f16")
    for pos in range(6):
        t = time.perf_counter()
        out = be.run(fwd, Batch([Row(0, pos, ids[pos : pos + 1])]), kv)
        be.to_host(out)
        print("decode step", pos, round(time.perf_counter() - t, 3), "s", flush=True)
print("total", round(time.perf_counter() - begin, 1), "s")
