#!/usr/bin/env python3
"""How fast one H200 streams a quantized weight matrix in the load pattern of gemv_q's lanes, with no arithmetic:
whether the pattern alone holds the one-token products under the card's bandwidth. Each kernel reads every unit of
a buffer once, XORs what it loads into one word a thread (so the loads stay) and runs on a persistent grid of
``--blocks`` blocks a multiprocessor (gemv_q's gated unit fits 3: 166 registers); each lane keeps ``U`` units' loads
in flight (its loads for U units issued before any is used), as gemv_q's units in flight. Patterns:

- ``q4k``: TQ4_KP's loads, the native Q4_K layout: a unit is 64 values of a 144-byte block, loaded as the block's
  16-byte head and the unit's two 16-byte halves; lane i of a warp takes unit i of 32 consecutive units (eight
  blocks), so one load instruction of a warp spans about 1,152 bytes and uses half of them.
- ``q6k``: TQ6_KP's loads from its planes (low bits 128 bytes a block, high bits 64, scales 16, d 2): two 16-byte
  loads of low bits, one of high bits, 8 bytes of scales and the 2-byte d a unit.
- ``q4k_staged``: q4k's bytes copied into shared memory by coalesced cp.async (16 consecutive bytes a lane), the
  next step's while the lanes read the current step's units there in q4k's pattern.
- ``flat``: three 16-byte loads a unit, each load instruction of a warp reading 512 consecutive bytes.

GB/s is the buffer's bytes over the device time of one pass (the median of ``--reps``), for buffers of each
``--mbytes`` (16: within L2; 66: the gated unit's two matrices of the 8B file; 528: its output matrix).

    python scripts/load_patterns.py [--mbytes 16 66 528] [--units 1 2 4] [--blocks 3 6] [--reps 20]

With ``--chain MB...`` it times instead a decode step's chain of products: kernels of those sizes (a layer's: q, k
and v 14.2, o 9.4, gate and up 66, down 33) over ``--layers`` layers, each its own slice of one buffer, as one
launch over all of it, as the chain of launches, as that chain replayed from a graph, and as the graph with
programmatic dependent launch (each kernel letting the next start at its top and waiting for the previous one at
its top, or after its first step's loads), and as one persistent launch of all the passes with a barrier of the
whole grid between them, without and with each block prefetching into L2 the bytes of its first step of the next
pass before it waits there (q4k, q4k_staged, flat: units in order): what the kernel boundaries of a step cost a
stream of loads, and what a step run as one kernel would get back.

    python scripts/load_patterns.py --chain 14.2 9.4 66 33 --layers 8 --units 1 2 --blocks 3 6

Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numpy as np
from leat_backend_cuda import compiler, driver
from leat_backend_cuda.backend import CUDABackend

SOURCE = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;

__device__ __forceinline__ void mix(uint4& acc, const uint4& v) { acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w; }

// Each pattern's pass over `units` units at w, by a persistent grid: warp-steps of 32 * U units, lane i taking units
// step * 32 * U + 32 * s + i (s < U). With `early` the warp waits for the previous kernel (programmatic dependent
// launch) after its first step's loads (AFTER_FIRST_LOADS), as a product whose input the previous kernel writes could.
#define AFTER_FIRST_LOADS if (early && step == warp) asm volatile("griddepcontrol.wait;" ::: "memory")
#define STEPS                                                                                          \
    const int lane = threadIdx.x & 31;                                                                 \
    const i64 warp = blockIdx.x * 4 + (threadIdx.x >> 5), warps = (i64)gridDim.x * 4;                 \
    for (i64 step = warp; step * 32 * U < units; step += warps)

template <int U>
struct Q4K {
    static __device__ void pass(const u8* __restrict__ w, i64 units, uint4& acc, int early) {
        STEPS {
            uint4 h[U], lo[U], hi[U];
#pragma unroll
            for (int s = 0; s < U; ++s) {
                const i64 u = min(step * 32 * U + 32 * s + lane, units - 1);
                const uint4* b = (const uint4*)(w + (u >> 2) * 144);
                const int j = (int)(u & 3);
                h[s] = __ldg(b);
                lo[s] = __ldg(b + 1 + 2 * j);
                hi[s] = __ldg(b + 2 + 2 * j);
            }
            AFTER_FIRST_LOADS;
#pragma unroll
            for (int s = 0; s < U; ++s) { mix(acc, h[s]); mix(acc, lo[s]); mix(acc, hi[s]); }
        }
    }
};

template <int U>
struct Q6K {
    static __device__ void pass(const u8* __restrict__ w, i64 units, uint4& acc, int early) {
        const i64 nb = units / 4;
        STEPS {
            uint4 la[U], lb[U], hh[U], sc[U];
#pragma unroll
            for (int s = 0; s < U; ++s) {
                const i64 u = min(step * 32 * U + 32 * s + lane, units - 1), blk = u >> 2;
                const int n = (int)((u & 3) >> 1), l0 = 16 * (int)(u & 1);
                const u8* ql = w + blk * 128 + 64 * n + l0;
                la[s] = __ldg((const uint4*)ql);
                lb[s] = __ldg((const uint4*)(ql + 32));
                hh[s] = __ldg((const uint4*)(w + 128 * nb + blk * 64 + 32 * n + l0));
                const uint2 scales = __ldg((const uint2*)(w + 192 * nb + blk * 16 + 8 * n));
                sc[s] = {scales.x, scales.y, (unsigned)__ldg((const u16*)(w + 208 * nb) + blk), 0u};
            }
            AFTER_FIRST_LOADS;
#pragma unroll
            for (int s = 0; s < U; ++s) { mix(acc, la[s]); mix(acc, lb[s]); mix(acc, hh[s]); mix(acc, sc[s]); }
        }
    }
};

// q4k's units staged through shared memory: each warp copies the 1,152 bytes of a step's 32 units (eight blocks)
// with cp.async, 16 consecutive bytes a lane (coalesced), the next step's while it reads the current one's units
// from shared memory in q4k's pattern (two buffers of U steps a warp).
template <int U>
struct Q4KStaged {
    static __device__ void pass(const u8* __restrict__ w, i64 units, uint4& acc, int early) {
        __shared__ __align__(16) u8 stage[4][2][U][1152];
        const int wi = threadIdx.x >> 5;
        int buffer = 0;
        auto issue = [&](i64 step) {  // the warp's U chunks of step `step` into stage[wi][buffer]
#pragma unroll
            for (int s = 0; s < U; ++s) {
                const i64 u0 = min(step * 32 * U + 32 * s, units - 32);
                const u8* src = w + (u0 >> 2) * 144;
                for (int at = 16 * (threadIdx.x & 31); at < 1152; at += 512) {
                    const unsigned dst = (unsigned)__cvta_generic_to_shared(&stage[wi][buffer][s][at]);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src + at) : "memory");
                }
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
        STEPS {
            if (step == warp) issue(step);  // the first step's chunks
            const i64 next = step + warps;
            buffer ^= 1;
            if (next * 32 * U < units) issue(next);  // into the other buffer
            else asm volatile("cp.async.commit_group;" ::: "memory");
            AFTER_FIRST_LOADS;
            asm volatile("cp.async.wait_group 1;" ::: "memory");
            __syncwarp();
#pragma unroll
            for (int s = 0; s < U; ++s) {
                const u8* b = &stage[wi][buffer ^ 1][s][(lane >> 2) * 144];
                const int j = lane & 3;
                mix(acc, *(const uint4*)b);
                mix(acc, *(const uint4*)(b + 16 + 32 * j));
                mix(acc, *(const uint4*)(b + 32 + 32 * j));
            }
            __syncwarp();
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");  // none in flight into stage past the pass
    }
};

template <int U>
struct Flat {
    static __device__ void pass(const u8* __restrict__ w, i64 units, uint4& acc, int early) {
        STEPS {
            uint4 v[U][3];
#pragma unroll
            for (int s = 0; s < U; ++s) {
                const i64 u0 = min(step * 32 * U + 32 * s, units - 32);  // the warp's 32 units: 1,536 bytes
                const uint4* b = (const uint4*)(w + u0 * 48) + lane;
#pragma unroll
                for (int k = 0; k < 3; ++k) v[s][k] = __ldg(b + 32 * k);
            }
            AFTER_FIRST_LOADS;
#pragma unroll
            for (int s = 0; s < U; ++s) { mix(acc, v[s][0]); mix(acc, v[s][1]); mix(acc, v[s][2]); }
        }
    }
};

// One kernel a pass. It lets the next kernel launch at once (programmatic dependent launch; without that launch
// attribute both griddepcontrol instructions are no-ops) and waits for the previous one at its top, or with `early`
// after its first step's loads.
template <class P>
__global__ void __launch_bounds__(128) one(const u8* __restrict__ w, i64 units, uint4* __restrict__ out, int early) {
    asm volatile("griddepcontrol.launch_dependents;");
    if (!early) asm volatile("griddepcontrol.wait;" ::: "memory");
    uint4 acc = {0, 0, 0, 0};
    P::pass(w, units, acc, early);
    out[blockIdx.x * 128 + threadIdx.x] = acc;
}

// The passes of a whole chain in one launch: pass i over counts[i] units at w + starts[i], a barrier of the whole
// grid between passes (every block resident: the caller's grid fits at once). With `prefetch` each block asks L2,
// before it waits at a barrier, for the bytes its warps' first step of the next pass reads (patterns whose units lie
// in order: `bytes_unit` of them a unit), so that pass starts on L2 hits instead of a drained memory pipeline.
template <class P, int U>
__global__ void __launch_bounds__(128) phases(const u8* __restrict__ w, const i64* __restrict__ starts,
                                              const i64* __restrict__ counts, int n, uint4* __restrict__ out,
                                              unsigned* __restrict__ barrier, int prefetch, int bytes_unit) {
    uint4 acc = {0, 0, 0, 0};
    for (int i = 0; i < n; ++i) {
        P::pass(w + starts[i], counts[i], acc, 0);
        if (i + 1 == n) break;
        if (prefetch) {  // the block's warps' first steps of pass i + 1: 4 x 32U units from unit 128U * block
            const u8* next = w + starts[i + 1] + (i64)blockIdx.x * 128 * U * bytes_unit;
            const i64 end = w + starts[i + 1] + counts[i + 1] * bytes_unit - next;
            for (i64 at = 128 * threadIdx.x; at < min((i64)128 * U * bytes_unit, end); at += 128 * 128)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(next + at));
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // arrive, then wait for the grid's (i + 1)-th arrival of every block
            __threadfence();
            atomicAdd(barrier, 1u);
            const unsigned target = (unsigned)(i + 1) * gridDim.x;
            while (*(volatile unsigned*)barrier < target) {}
            __threadfence();
        }
        __syncthreads();
    }
    out[blockIdx.x * 128 + threadIdx.x] = acc;
}
"""
# bytes a unit of each pattern (DRAM: the q4k head is read by four lanes, once from memory)
UNIT_BYTES = {"q4k": 36, "q4k_staged": 36, "q6k": 52.5, "flat": 48}
STRUCTS = {"q4k": "Q4K", "q4k_staged": "Q4KStaged", "q6k": "Q6K", "flat": "Flat"}
# patterns whose units lie in order in memory (what `phases` prefetches for); q6k's planes do not


def one_name(pattern: str, u: int) -> str:
    return f"one<{STRUCTS[pattern]}<{u}>>"


def phases_name(pattern: str, u: int) -> str:
    return f"phases<{STRUCTS[pattern]}<{u}>, {u}>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbytes", type=int, nargs="+", default=[16, 66, 528])
    ap.add_argument("--units", type=int, nargs="+", default=[1, 2, 4], help="units in flight a lane")
    ap.add_argument("--blocks", type=int, nargs="+", default=[3, 6], help="blocks a multiprocessor")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain", type=float, nargs="+", help="MB of each kernel of a layer: time chains instead")
    ap.add_argument("--layers", type=int, default=8, help="layers of --chain")
    args = ap.parse_args()
    backend = CUDABackend()
    device = backend.device
    names = [one_name(p, u) for p in UNIT_BYTES for u in args.units]
    names += [phases_name(p, u) for p in UNIT_BYTES for u in args.units] if args.chain else []
    saved = compiler.source
    compiler.source = lambda name: SOURCE if name == "load_patterns.cu" else saved(name)
    try:
        built = compiler.compile_program("load_patterns.cu", names, device.arch, use_cache=False)
    finally:
        compiler.source = saved
    module = driver.Module(device, built.cubin, built.names, built.params)
    most = max(args.blocks) * device.sm_count
    out = driver.Memory(most * 128 * 16)
    if args.chain:
        chains(device, module, out, args)
        return
    print("| pattern | units in flight | blocks an SM | MB | GB/s |\n|---|---:|---:|---:|---:|")
    for mbytes in args.mbytes:
        for pattern, unit_bytes in UNIT_BYTES.items():
            units = int(mbytes * 1e6 / unit_bytes) // 128 * 128
            buffer = random_buffer(device, int(units * unit_bytes) + 4096)
            for u in args.units:
                kernel = module[one_name(pattern, u)]
                for blocks in args.blocks:
                    launch = launcher(kernel, blocks, device, overlap=False)
                    times = []
                    for _ in range(args.reps):
                        timer = driver.Timer(device)
                        with timer:
                            launch(buffer.ptr, units, out, 0)
                        times.append(timer.seconds)
                    gbs = units * unit_bytes / statistics.median(times) / 1e9
                    print(f"| {pattern} | {u} | {blocks} | {mbytes} | {gbs:,.0f} |", flush=True)
            del buffer


def chains(device, module, out, args) -> None:
    """A layer's kernels (--chain MB each) over --layers layers, each kernel its own slice of one buffer: GB/s of
    one launch over all of it, of the chain of launches, of the chain captured as a graph and replayed, of that
    graph with programmatic dependent launch, each kernel waiting for the one before at its top or after its first
    step's loads, and of the chain as one persistent launch with a grid barrier between passes, without and with
    each block prefetching its next pass's first bytes into L2 before the barrier."""
    print(f"chain of {len(args.chain)} kernels x {args.layers} layers: {args.chain} MB")
    print(
        "| pattern | units in flight | blocks an SM | one launch | chain | graph | graph, PDL | graph, PDL, loads first"
        " | persistent | persistent, prefetch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    barrier = driver.Memory(4)
    for pattern, unit_bytes in UNIT_BYTES.items():
        slices = [int(mb * 1e6 / unit_bytes) // 128 * 128 for mb in args.chain] * args.layers
        total = sum(slices)
        buffer = random_buffer(device, int(total * unit_bytes) + 4096)
        starts = [buffer.ptr + int(start * unit_bytes) for start in np.cumsum([0, *slices[:-1]]).tolist()]
        calls = {"one": [(buffer.ptr, total)], "chain": list(zip(starts, slices, strict=True))}
        offsets = driver.Memory(16 * len(slices))  # the passes' byte offsets, then their unit counts (int64)
        device.upload(offsets.ptr, np.array([p - buffer.ptr for p in starts] + slices, np.int64))
        for u in args.units:
            kernel = module[one_name(pattern, u)]
            for blocks in args.blocks:
                rates: list[float | None] = []
                for how in ("one", "chain", "graph", "graph pdl", "graph pdl early"):
                    launch = launcher(kernel, blocks, device, overlap="pdl" in how)
                    early = int(how.endswith("early"))
                    run = functools.partial(launch_all, launch, calls["one" if how == "one" else "chain"], out, early)
                    if how.startswith("graph"):
                        run = driver.Graph(device, run).replay
                    times = []
                    for _ in range(args.reps):
                        timer = driver.Timer(device)
                        with timer:
                            run()
                        times.append(timer.seconds)
                    rates.append(total * unit_bytes / statistics.median(times) / 1e9)
                persistent = module[phases_name(pattern, u)]
                launch = launcher(persistent, blocks, device, overlap=False)
                for prefetch in (0, 1):
                    if persistent.occupancy(128, launch.smem) < blocks:  # a barrier needs every block resident
                        rates.append(None)
                        continue
                    in_order = 0 if pattern == "q6k" else int(unit_bytes)
                    args_ = (buffer.ptr, offsets, offsets.ptr + 8 * len(slices), len(slices), out, barrier)
                    times = []
                    for _ in range(args.reps):
                        device.upload(barrier.ptr, np.zeros(1, np.uint32))
                        timer = driver.Timer(device)
                        with timer:
                            launch(*args_, prefetch * bool(in_order), in_order)
                        times.append(timer.seconds)
                    rates.append(total * unit_bytes / statistics.median(times) / 1e9)
                cells = " | ".join("-" if r is None else f"{r:,.0f}" for r in rates)
                print(f"| {pattern} | {u} | {blocks} | {cells} |", flush=True)
        del buffer


def launch_all(launch, calls, out, early: int) -> None:
    for ptr, units in calls:
        launch(ptr, units, out, early)


def random_buffer(device, size: int) -> driver.Memory:
    buffer = driver.Memory(size)
    device.upload(buffer.ptr, np.random.default_rng(0).integers(0, 255, size, np.uint8))
    return buffer


def launcher(kernel, blocks: int, device, overlap: bool):
    """launch(w, units, out) on a persistent grid of `blocks` blocks a multiprocessor, each taking its share of the
    shared memory (so at most `blocks` fit); `overlap`: with programmatic stream serialization (cuLaunchKernelEx)."""
    cu = driver._cu()
    attrs = cu.CUfunction_attribute
    own = driver.check(cu.cuFuncGetAttribute(attrs.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel.function))
    smem = max(0, 200 * 1024 // blocks - own) if blocks < 8 else 0
    if own + smem > 48 * 1024:  # static and dynamic together past 48 KiB: opt in
        attr = attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.check(cu.cuFuncSetAttribute(kernel.function, attr, smem), "shared memory")
    grid = blocks * device.sm_count
    if not overlap:
        launch = functools.partial(kernel, (grid,), 128, smem=smem)
        launch.smem = smem  # type: ignore[attr-defined]
        return launch
    attribute = cu.CUlaunchAttribute()
    attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 128, 1, 1
    config.sharedMemBytes, config.hStream = smem, device.stream
    config.attrs, config.numAttrs = [attribute], 1

    def launch(*args):
        kernel._values[: len(args)] = [driver._param(a) for a in args]
        driver.check(cu.cuLaunchKernelEx(config, kernel.function, kernel._address, 0), "launch")

    return launch


if __name__ == "__main__":
    main()
