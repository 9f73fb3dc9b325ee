// Hopper's warpgroup products (sm_90a; wgmma.cu): a warpgroup (4 consecutive warps, 128 threads) multiplies a
// 64 x 16 A operand held in its registers by a 16 x N B operand in shared memory, read through a matrix
// descriptor, into 64 x N float32 sums held in its registers. A warp's A fragment (16 rows) and its sums are laid
// out as mma.sync m16n8k16's (mma.cuh): warp w of the group holds rows 16w..16w+15, and sum i of lane (g, t) is row
// g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2t + (i & 1). The products run asynchronously: wg_fence before the
// first of a batch, wg_commit after it, wg_wait<N> until at most N batches are in flight; the registers they
// read and write are not to be touched in between (keep_reg pins the sums' reads after the wait).
#pragma once
#include "common.cuh"

// The shared-memory address of p as the descriptor takes it.
__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Shared memory written by the threads (stores, cp.async) made visible to the products' reads (the async proxy):
// after the writes, before the barrier that precedes the products.
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The compiler may not move a read of r above this point (after wg_wait) nor a write below it.
__device__ __forceinline__ void keep_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// f16x2 arithmetic, rounded to nearest: a + b, a * b, a * b + c (each half on its own)
__device__ __forceinline__ u32 h2_add(u32 a, u32 b) {
    u32 r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// d += A B for B 16 x 8 NT: one wgmma.m64n(8 NT)k16, f16 inputs, float32 sums, A from registers, B K-major.
template <int NT>
struct WG;
template <>
struct WG<2> {
    static __device__ __forceinline__ void mma(float (&d)[8], const u32 (&a)[4], u64 desc) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %13, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
            "{%0,%1,%2,%3,%4,%5,%6,%7}, "
            "{%8,%9,%10,%11}, %12, p, 1, 1, 0;}"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
    }
};
template <>
struct WG<4> {
    static __device__ __forceinline__ void mma(float (&d)[16], const u32 (&a)[4], u64 desc) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
            "{%16,%17,%18,%19}, %20, p, 1, 1, 0;}"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
    }
};
template <>
struct WG<8> {
    static __device__ __forceinline__ void mma(float (&d)[32], const u32 (&a)[4], u64 desc) {
        asm volatile(
            "{.reg .pred p; setp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
            "{%32,%33,%34,%35}, %36, p, 1, 1, 0;}"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
    }
};
