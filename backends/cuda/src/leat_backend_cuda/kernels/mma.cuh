// Tensor-core building blocks shared by the GEMM (matmul.cu) and prefill attention (flash.cu):
// ldmatrix loads of 8x8 f16 tiles from shared memory and mma.sync m16n8k16 (f16 in, f32 accumulate).
#pragma once
#include "common.cuh"

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix_x4 with each 8x8 tile transposed: for a B operand stored with k along rows (P V's V).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const u16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// 16 bytes from global to shared memory, not through registers (cp.async, sm_80 and later); `bytes` 0 writes 16
// zeros and reads nothing. cp_async_commit closes the thread's copies issued so far into a group; cp_async_wait<N>
// waits until at most N of its groups are in flight (a barrier after it shows the copies to the whole block).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    const u32 a = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
