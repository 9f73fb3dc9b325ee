// Shared helpers. Compiled by NVRTC with no system headers: the vector types and intrinsics used
// here are NVRTC builtins; halves are converted with PTX so cuda_fp16.h is not needed.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two floats as one f16x2 word, `lo` in the low half (the element at the lower address).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// dp2a with a's two int16 signed and b's four bytes unsigned (0..255; __dp2a_lo/__dp2a_hi take both signed or both
// unsigned): c + a.lo * b.byte0 + a.hi * b.byte1 (lo), or with bytes 2 and 3 (hi).
__device__ __forceinline__ int dp2a_lo_su(u32 a, u32 b, int c) {
    int d;
    asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp2a_hi_su(u32 a, u32 b, int c) {
    int d;
    asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Byte k of `word` as a float, exactly, without an int-to-float conversion (those run at a quarter
// of the FMA rate): the byte becomes the low mantissa bits of 2^23, which is then subtracted
// together with `offset` (a compile-time constant, folded into one FADD).
__device__ __forceinline__ float byte_f32(u32 word, int k, float offset = 0.0f) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 + k)) - (8388608.0f + offset);
}

// An integer 0 <= q < 2^23 as a float, exactly, by the same trick.
__device__ __forceinline__ float small_f32(u32 q, float offset = 0.0f) {
    return __uint_as_float(0x4B000000u | q) - (8388608.0f + offset);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over a block of up to 1024 threads (blockDim.x a multiple of 32); every thread gets the sum.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `partial` may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : NEG_INF;
    return warp_max(v);
}

__device__ __forceinline__ i64 align16(i64 n) { return (n + 15) & ~(i64)15; }
