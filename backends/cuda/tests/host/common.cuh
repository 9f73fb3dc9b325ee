// Host stand-ins for the CUDA builtins kernels/quants.cuh uses, so that g++ can compile the block
// decoders and tests can check them against gguf-py on a machine without a GPU (test_decoders_on_host.py).
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32; typedef long long i64; typedef unsigned long long u64;
#define __device__
#define __forceinline__ inline
struct uint4 { u32 x, y, z, w; }; struct uint2 { u32 x, y; }; struct float4 { float x, y, z, w; };
struct float2 { float x, y; }; inline float2 make_float2(float x, float y) { return {x, y}; }
template<class T> T __ldg(const T* p) { T v; memcpy(&v, p, sizeof(T)); return v; }
inline u32 __byte_perm(u32 x, u32 y, u32 s) { u8 b[8]; memcpy(b, &x, 4); memcpy(b+4, &y, 4); u32 r = 0; for (int i = 0; i < 4; ++i) r |= (u32)b[(s >> (4*i)) & 7] << (8*i); return r; }
inline int __popc(u32 x) { return __builtin_popcount(x); }
inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float f16_to_f32(u16 h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
inline i64 align16(i64 n) { return (n + 15) & ~(i64)15; }
inline float byte_f32(u32 word, int k, float offset = 0.0f) { return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 + k)) - (8388608.0f + offset); }
inline float small_f32(u32 q, float offset = 0.0f) { return __uint_as_float(0x4B000000u | q) - (8388608.0f + offset); }
inline int __dp2a_lo(int a, int b, int c) {
    return c + (int)(short)(a & 0xFFFF) * (int)(signed char)(b & 0xFF) + (int)(short)(a >> 16) * (int)(signed char)((b >> 8) & 0xFF);
}
inline int __dp2a_hi(int a, int b, int c) {
    return c + (int)(short)(a & 0xFFFF) * (int)(signed char)((b >> 16) & 0xFF) + (int)(short)(a >> 16) * (int)(signed char)((b >> 24) & 0xFF);
}
inline int dp2a_lo_su(u32 a, u32 b, int c) {
    return c + (int)(short)(a & 0xFFFF) * (int)(b & 0xFF) + (int)(short)(a >> 16) * (int)((b >> 8) & 0xFF);
}
inline int dp2a_hi_su(u32 a, u32 b, int c) {
    return c + (int)(short)(a & 0xFFFF) * (int)((b >> 16) & 0xFF) + (int)(short)(a >> 16) * (int)(b >> 24);
}
inline u32 __vsub4(u32 a, u32 b) {
    u32 r = 0;
    for (int i = 0; i < 4; ++i) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xFF) << (8 * i);
    return r;
}
