"""Time the host side of the tinygrad backend on the 8B file: load, prefill 512, decode steps (the first six each,
then the mean of 100 replays with their logits copied to the host), mixed steps (four
decode rows and a 100-token prompt chunk, as the engine batches a prompt that joins requests that decode; with
``chunks``, two prompts' chunks of 100 tokens).
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
    t = time.perf_counter()
    for pos in range(6, 106):  # replays, each step's logits to the host as leat bench's tg loop takes them
        be.to_host(be.run(fwd, Batch([Row(0, pos, ids[pos : pos + 1])]), kv))
    print("decode steps 6-105: %.3f ms a step" % ((time.perf_counter() - t) * 10), flush=True)
if "mixed" in phases or "chunks" in phases:
    prompts = 2 if "chunks" in phases else 1
    layouts = model.architecture.kv_layouts(model.architecture.params)
    kv = be.allocate_kv(layouts, slots=4 + prompts, context=1024, pages=(4 + prompts) * 64, page_size=16, dtype="f16")
    for slot in range(4 + prompts):
        be.set_pages(kv, slot, np.arange(64 * slot, 64 * slot + 64))
    for slot in range(4):
        be.to_host(be.run(fwd, Batch([Row(slot, 0, ids[:16])]), kv))
    ids = np.arange(1000, 1600, dtype=np.int64)
    for step in range(6):
        rows = [Row(slot, 16 + step, ids[16 + step : 17 + step]) for slot in range(4)]
        t = time.perf_counter()
        chunks = [Row(4 + p, 100 * step, ids[100 * step : 100 * step + 100]) for p in range(prompts)]
        out = be.run(fwd, Batch([*rows, *chunks]), kv)
        be.to_host(out)
        print("mixed step", step, round(time.perf_counter() - t, 3), "s", flush=True)
print("total", round(time.perf_counter() - begin, 1), "s")
