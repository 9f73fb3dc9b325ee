// GGUF block decoders, one struct per type, shared by the matmul, dequantize and embed kernels.
//
// A matrix of `nb` blocks is stored either as GGUF's raw blocks (when a block is a multiple of
// 16 bytes: F32/F16/BF16 rows, Q4_K, Q5_K) or as planes: field f of every block stored together,
// each plane starting 16-byte aligned (quants.py `PLANES` lists the fields; the bytes are GGUF's,
// only their order differs). That keeps every load aligned and coalesced.
//
// A thread decodes one *unit* of a block: UV values laid out as NR runs of RL consecutive values,
// run r starting at `run_offset(unit, r)` within the block. `load` fetches a unit's bytes (so
// loads for several units can be issued before any is decoded); `decode<EXACT>` turns them into
// floats. With EXACT the float operations round exactly as gguf-py's dequantize (no fused
// multiply-add), so the dequantize kernel equals `gguf.quants.dequantize` bit for bit; without it
// products and sums may fuse.
//
// Quantized types also have `dot`: the unit's dot product with activations given as int16, two
// per word in run order (xw), with one float scale per run (x = xq * xs[run]) and the float sum of
// x over each run (for the types with mins). The integer products run on dp2a (int16 x int8,
// int32 accumulation), about one instruction per weight instead of four for decode-then-FMA.
#pragma once
#include "common.cuh"
#include "iq_grids.cuh"

template <bool EXACT>
__device__ __forceinline__ float mul_sub(float a, float b, float c) {  // a * b - c
    return EXACT ? __fsub_rn(__fmul_rn(a, b), c) : fmaf(a, b, -c);
}
template <bool EXACT>
__device__ __forceinline__ float mul_add(float a, float b, float c) {  // a * b + c
    return EXACT ? __fadd_rn(__fmul_rn(a, b), c) : fmaf(a, b, c);
}

__device__ __forceinline__ u32 low_nibbles(u32 w) { return w & 0x0F0F0F0Fu; }
__device__ __forceinline__ u32 high_nibbles(u32 w) { return (w >> 4) & 0x0F0F0F0Fu; }
// Bits 0..3 of `bits` to bit 0 of bytes 0..3.
__device__ __forceinline__ u32 spread4(u32 bits) { return ((bits & 0xFu) * 0x00204081u) & 0x01010101u; }
__device__ __forceinline__ u32 word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Four signed bytes of q times four int16 of x (x01: values 0, 1; x23: values 2, 3), plus acc.
__device__ __forceinline__ int dot4(u32 q, u32 x01, u32 x23, int acc) {
    return __dp2a_hi((int)x23, (int)q, __dp2a_lo((int)x01, (int)q, acc));
}
// Sixteen bytes (four words of q) times sixteen int16 (eight words of x from xw).
__device__ __forceinline__ int dot16(u32 q0, u32 q1, u32 q2, u32 q3, const u32* xw) {
    int s = dot4(q0, xw[0], xw[1], 0);
    s = dot4(q1, xw[2], xw[3], s);
    s = dot4(q2, xw[4], xw[5], s);
    return dot4(q3, xw[6], xw[7], s);
}
// The same with q's bytes unsigned: a Q4 block's high nibbles left in place (each 16 times its value) cost no shift.
__device__ __forceinline__ int dot16u(u32 q0, u32 q1, u32 q2, u32 q3, const u32* xw) {
    int s = dp2a_hi_su(xw[1], q0, dp2a_lo_su(xw[0], q0, 0));
    s = dp2a_hi_su(xw[3], q1, dp2a_lo_su(xw[2], q1, s));
    s = dp2a_hi_su(xw[5], q2, dp2a_lo_su(xw[4], q2, s));
    return dp2a_hi_su(xw[7], q3, dp2a_lo_su(xw[6], q3, s));
}

// ---------------------------------------------------------------------------------------------
// Float types: a "block" is 8 consecutive values of a row (rows must be a multiple of 8 long).

struct TF32 {
    static constexpr int BLOCK = 8, UNITS = 1, UV = 8, NR = 1, RL = 8;
    struct Raw { float4 a, b; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const float4* p = (const float4*)w + blk * 2;
        return {__ldg(p), __ldg(p + 1)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        v[0] = r.a.x; v[1] = r.a.y; v[2] = r.a.z; v[3] = r.a.w;
        v[4] = r.b.x; v[5] = r.b.y; v[6] = r.b.z; v[7] = r.b.w;
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 0; }
};

struct TF16 {
    static constexpr int BLOCK = 8, UNITS = 1, UV = 8, NR = 1, RL = 8;
    struct Raw { uint4 q; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        return {__ldg((const uint4*)w + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 x = word_of(r.q, i);
            v[2 * i] = f16_to_f32((u16)(x & 0xFFFF));
            v[2 * i + 1] = f16_to_f32((u16)(x >> 16));
        }
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 0; }
};

struct TBF16 {
    static constexpr int BLOCK = 8, UNITS = 1, UV = 8, NR = 1, RL = 8;
    struct Raw { uint4 q; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        return {__ldg((const uint4*)w + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 x = word_of(r.q, i);
            v[2 * i] = __uint_as_float(x << 16);
            v[2 * i + 1] = __uint_as_float(x & 0xFFFF0000u);
        }
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 0; }
};

// ---------------------------------------------------------------------------------------------
// Q8_0: 32 values; planes d (f16), qs (32 x int8). value = qs * d. A unit is half a block.

struct TQ8_0 {
    static constexpr int BLOCK = 32, UNITS = 2, UV = 16, NR = 1, RL = 16;
    struct Raw { uint4 q; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* qs = (const uint4*)(w + align16(2 * nb));
        return {__ldg(qs + blk * 2 + unit), __ldg((const u16*)w + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const float d = f16_to_f32(r.d);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 x = word_of(r.q, i) ^ 0x80808080u;  // signed byte s -> s + 128
#pragma unroll
            for (int k = 0; k < 4; ++k) v[4 * i + k] = byte_f32(x, k, 128.0f) * d;
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        return f16_to_f32(r.d) * xs[0] * (float)dot16(r.q.x, r.q.y, r.q.z, r.q.w, xw);
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 16 * unit; }
};

// ---------------------------------------------------------------------------------------------
// Q4_0 / Q4_1 / Q5_0 / Q5_1 / MXFP4: 32 values, one unit per block. Byte j of qs holds value j
// in its low nibble and value j + 16 in its high nibble (run 0: values 0..15, run 1: 16..31).
// Q5's qh (u32) holds bit 4 of value j in its bit j.

struct TQ4_0 {  // planes d (f16), qs (16); value = d * (q - 8)
    static constexpr int BLOCK = 32, UNITS = 1, UV = 32, NR = 2, RL = 16;
    struct Raw { uint4 q; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* qs = (const uint4*)(w + align16(2 * nb));
        return {__ldg(qs + blk), __ldg((const u16*)w + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const float d = f16_to_f32(r.d);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = low_nibbles(word_of(r.q, i)), hi = high_nibbles(word_of(r.q, i));
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[4 * i + k] = d * byte_f32(lo, k, 8.0f);
                v[16 + 4 * i + k] = d * byte_f32(hi, k, 8.0f);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const u32 b = 0x08080808u;
        const int s0 = dot16(__vsub4(low_nibbles(r.q.x), b), __vsub4(low_nibbles(r.q.y), b),
                             __vsub4(low_nibbles(r.q.z), b), __vsub4(low_nibbles(r.q.w), b), xw);
        const int s1 = dot16(__vsub4(high_nibbles(r.q.x), b), __vsub4(high_nibbles(r.q.y), b),
                             __vsub4(high_nibbles(r.q.z), b), __vsub4(high_nibbles(r.q.w), b), xw + 8);
        return f16_to_f32(r.d) * (xs[0] * (float)s0 + xs[1] * (float)s1);
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 16 * run; }
};

struct TQ4_1 {  // planes (d, m) (2 x f16), qs (16); value = d * q + m
    static constexpr int BLOCK = 32, UNITS = 1, UV = 32, NR = 2, RL = 16;
    struct Raw { uint4 q; u32 dm; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* qs = (const uint4*)(w + align16(4 * nb));
        return {__ldg(qs + blk), __ldg((const u32*)w + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const float d = f16_to_f32((u16)(r.dm & 0xFFFF)), m = f16_to_f32((u16)(r.dm >> 16));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = low_nibbles(word_of(r.q, i)), hi = high_nibbles(word_of(r.q, i));
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[4 * i + k] = mul_add<EXACT>(d, byte_f32(lo, k), m);
                v[16 + 4 * i + k] = mul_add<EXACT>(d, byte_f32(hi, k), m);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const float d = f16_to_f32((u16)(r.dm & 0xFFFF)), m = f16_to_f32((u16)(r.dm >> 16));
        const int s0 = dot16(low_nibbles(r.q.x), low_nibbles(r.q.y), low_nibbles(r.q.z), low_nibbles(r.q.w), xw);
        const int s1 = dot16(high_nibbles(r.q.x), high_nibbles(r.q.y), high_nibbles(r.q.z), high_nibbles(r.q.w), xw + 8);
        return d * (xs[0] * (float)s0 + xs[1] * (float)s1) + m * (xsum[0] + xsum[1]);
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 16 * run; }
};

struct TQ5_0 {  // planes d (f16), qh (u32), qs (16); value = d * (q - 16)
    static constexpr int BLOCK = 32, UNITS = 1, UV = 32, NR = 2, RL = 16;
    struct Raw { uint4 q; u32 qh; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qh_at = align16(2 * nb), qs_at = qh_at + align16(4 * nb);
        return {__ldg((const uint4*)(w + qs_at) + blk), __ldg((const u32*)(w + qh_at) + blk), __ldg((const u16*)w + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const float d = f16_to_f32(r.d);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = low_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (4 * i)) << 4);
            const u32 hi = high_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (16 + 4 * i)) << 4);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[4 * i + k] = d * byte_f32(lo, k, 16.0f);
                v[16 + 4 * i + k] = d * byte_f32(hi, k, 16.0f);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        u32 lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = low_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (4 * i)) << 4);
            hi[i] = high_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (16 + 4 * i)) << 4);
        }
        const u32 b = 0x10101010u;
        const int s0 = dot16(__vsub4(lo[0], b), __vsub4(lo[1], b), __vsub4(lo[2], b), __vsub4(lo[3], b), xw);
        const int s1 = dot16(__vsub4(hi[0], b), __vsub4(hi[1], b), __vsub4(hi[2], b), __vsub4(hi[3], b), xw + 8);
        return f16_to_f32(r.d) * (xs[0] * (float)s0 + xs[1] * (float)s1);
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 16 * run; }
};

struct TQ5_1 {  // planes (d, m) (2 x f16), qh (u32), qs (16); value = d * q + m
    static constexpr int BLOCK = 32, UNITS = 1, UV = 32, NR = 2, RL = 16;
    struct Raw { uint4 q; u32 qh; u32 dm; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qh_at = align16(4 * nb), qs_at = qh_at + align16(4 * nb);
        return {__ldg((const uint4*)(w + qs_at) + blk), __ldg((const u32*)(w + qh_at) + blk), __ldg((const u32*)w + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const float d = f16_to_f32((u16)(r.dm & 0xFFFF)), m = f16_to_f32((u16)(r.dm >> 16));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = low_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (4 * i)) << 4);
            const u32 hi = high_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (16 + 4 * i)) << 4);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[4 * i + k] = mul_add<EXACT>(d, byte_f32(lo, k), m);
                v[16 + 4 * i + k] = mul_add<EXACT>(d, byte_f32(hi, k), m);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        u32 lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = low_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (4 * i)) << 4);
            hi[i] = high_nibbles(word_of(r.q, i)) | (spread4(r.qh >> (16 + 4 * i)) << 4);
        }
        const float d = f16_to_f32((u16)(r.dm & 0xFFFF)), m = f16_to_f32((u16)(r.dm >> 16));
        const int s0 = dot16(lo[0], lo[1], lo[2], lo[3], xw), s1 = dot16(hi[0], hi[1], hi[2], hi[3], xw + 8);
        return d * (xs[0] * (float)s0 + xs[1] * (float)s1) + m * (xsum[0] + xsum[1]);
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 16 * run; }
};

// MXFP4 (OCP microscaling): planes e (u8, E8M0 scale), qs (16). value = d * kvalue[nibble], with
// kvalues the E2M1 values doubled {0,1,2,3,4,6,8,12, -0,-1,...,-12} and d = 2^(e-128) (gguf's
// e8m0_to_fp32_half, which also covers e < 2 with denormals).
struct TMXFP4 {
    static constexpr int BLOCK = 32, UNITS = 1, UV = 32, NR = 2, RL = 16;
    struct Raw { uint4 q; u8 e; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* qs = (const uint4*)(w + align16(nb));
        return {__ldg(qs + blk), __ldg(w + blk)};
    }
    static __device__ __forceinline__ float kvalue(u32 nibble) {
        const u32 magnitude = __byte_perm(0x03020100u, 0x0C080604u, nibble & 7) & 0xFF;
        const float f = small_f32(magnitude);
        return (nibble & 8) ? -f : f;
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const u32 e = r.e;
        const float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 x = word_of(r.q, i);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[4 * i + k] = d * kvalue((x >> (8 * k)) & 0xF);
                v[16 + 4 * i + k] = d * kvalue((x >> (8 * k + 4)) & 0xF);
            }
        }
    }
    // Four nibbles (one per byte, 0..15) to their kvalues as signed bytes.
    static __device__ __forceinline__ u32 kvalues4(u32 nibbles) {
        const u32 sel = (nibbles & 0x7) | ((nibbles >> 4) & 0x70) | ((nibbles >> 8) & 0x700) | ((nibbles >> 12) & 0x7000);
        const u32 pos = __byte_perm(0x03020100u, 0x0C080604u, sel), neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);
        const u32 mask = ((nibbles >> 3) & 0x01010101u) * 0xFFu;
        return (pos & ~mask) | (neg & mask);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const u32 e = r.e;
        const float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
        const int s0 = dot16(kvalues4(low_nibbles(r.q.x)), kvalues4(low_nibbles(r.q.y)), kvalues4(low_nibbles(r.q.z)),
                             kvalues4(low_nibbles(r.q.w)), xw);
        const int s1 = dot16(kvalues4(high_nibbles(r.q.x)), kvalues4(high_nibbles(r.q.y)), kvalues4(high_nibbles(r.q.z)),
                             kvalues4(high_nibbles(r.q.w)), xw + 8);
        return d * (xs[0] * (float)s0 + xs[1] * (float)s1);
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 16 * run; }
};

// ---------------------------------------------------------------------------------------------
// The IQ types: codebooks (llama.cpp's, kernels/iq_grids.cuh) indexed by the block's bits. Each unit
// is 32 values in two runs of 16, and each type gives them as `words`: eight words of signed bytes,
// values 0..31 in order, and `scales`: the float scale of each run; value = scale * byte. Codebook<T>
// decodes and dots them for every type alike. Where gguf-py computes a value as (scale * grid) * sign
// or scale * (grid + delta), the byte is the signed grid value or 8 * (grid + delta) with the 1/8 in
// the scale: the same float product, rounded once.
template <class T>
struct Codebook {
    static constexpr int BLOCK = 256, UNITS = 8, UV = 32, NR = 2, RL = 16;
    template <bool EXACT, class R>
    static __device__ __forceinline__ void decode(const R& r, int unit, float (&v)[UV]) {
        u32 q[8];
        float d[2];
        T::words(r, unit, q);
        T::scales(r, unit, d);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) v[4 * i + k] = d[i >> 2] * byte_f32(q[i] ^ 0x80808080u, k, 128.0f);  // s + 128
    }
    template <class R>
    static __device__ __forceinline__ float dot(const R& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        u32 q[8];
        float d[2];
        T::words(r, unit, q);
        T::scales(r, unit, d);
        const int s0 = dot16(q[0], q[1], q[2], q[3], xw), s1 = dot16(q[4], q[5], q[6], q[7], xw + 8);
        return d[0] * xs[0] * (float)s0 + d[1] * xs[1] * (float)s1;
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 32 * unit + 16 * run; }
};

// IQ4_NL / IQ4_XS: 4-bit indices into the non-linear codebook kvalues_iq4nl (int8), 16 bytes of qs
// per 32 values, byte j holding value j in its low nibble and value j + 16 in its high nibble (as Q4_0).

// The codebook values {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113} of
// the eight nibbles of q as signed bytes: `lo` those of the low nibbles (byte k of q -> byte k), `hi`
// those of the high nibbles (llama.cpp's get_int_from_table_16). __byte_perm indexes with bits 0-2
// of each selector nibble, so each nibble looks up entries 0-7 and 8-15, and its bit 3 picks one.
__device__ __forceinline__ void iq4nl_values8(u32 q, u32& lo, u32& hi) {
    const u32 pick = 0x32103210u | ((q & 0x88888888u) >> 1);
    u32 t[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 s = q >> (16 * i);
        const u32 low = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, s), high = __byte_perm(0x26190D01u, 0x71594535u, s);
        t[i] = __byte_perm(low, high, pick >> (16 * i));
    }
    lo = __byte_perm(t[0], t[1], 0x6420);
    hi = __byte_perm(t[0], t[1], 0x7531);
}
__device__ __forceinline__ void iq4_words(const uint4& qs, u32 (&q)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) iq4nl_values8(word_of(qs, i), q[i], q[4 + i]);
}
// IQ4_NL's decode: Codebook<T>::decode with each word of qs converted as soon as it is looked up. The same
// values, in an order after which ptxas leaves gemm_few<TIQ4_NL, ...> without spills (it spills 4-16 bytes of
// loop invariants otherwise; IQ4_XS has none either way, and its gemv_grouped spills more with this order).
__device__ __forceinline__ void iq4_decode(const uint4& qs, float d, float (&v)[32]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 lo, hi;
        iq4nl_values8(word_of(qs, i), lo, hi);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[4 * i + k] = d * byte_f32(lo ^ 0x80808080u, k, 128.0f);
            v[16 + 4 * i + k] = d * byte_f32(hi ^ 0x80808080u, k, 128.0f);
        }
    }
}

struct TIQ4_NL : Codebook<TIQ4_NL> {  // planes d (f16), qs (16); value = d * kvalue
    static constexpr int BLOCK = 32, UNITS = 1;
    struct Raw { uint4 q; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* qs = (const uint4*)(w + align16(2 * nb));
        return {__ldg(qs + blk), __ldg((const u16*)w + blk)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) { iq4_words(r.q, q); }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        d[0] = d[1] = f16_to_f32(r.d);
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        iq4_decode(r.q, f16_to_f32(r.d), v);
    }
};

// IQ4_XS: 256 values in 8 sub-blocks of 32. Planes (d (f16), scales_h (u16), scales_l (4 bytes))
// as one 8-byte head, qs (128). Sub-block ib's 6-bit scale: low 4 bits are bits 4ib.. of scales_l,
// high 2 bits bits 2ib.. of scales_h; value = (d * (scale - 32)) * kvalue. A unit is a sub-block.
struct TIQ4_XS : Codebook<TIQ4_XS> {
    struct Raw { uint4 q; uint2 head; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* qs = (const uint4*)(w + align16(8 * nb));
        return {__ldg(qs + blk * 8 + unit), __ldg((const uint2*)w + blk)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) { iq4_words(r.q, q); }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        const u32 sc = ((r.head.y >> (4 * unit)) & 0xF) | (((r.head.x >> (16 + 2 * unit)) & 3) << 4);
        d[0] = d[1] = f16_to_f32((u16)(r.head.x & 0xFFFF)) * small_f32(sc, 32.0f);
    }
};

// The grid types' signs: ksigns_iq2xs[i] (7 stored bits, bit 7 their parity) and the grid bytes of g
// negated where bits 0-3 of `signs` are set.
__device__ __forceinline__ u32 ksigns(u32 i) { return i | ((__popc(i) & 1) << 7); }
__device__ __forceinline__ u32 with_signs(u32 g, u32 signs) {
    const u32 m = spread4(signs) * 0xFFu;
    return __vsub4(g ^ m, m);
}
// Eight grid bytes (a u64 entry) with the 8 sign bits of `signs`, as two words.
__device__ __forceinline__ void signed8(u64 g, u32 signs, u32* q) {
    q[0] = with_signs((u32)g, signs);
    q[1] = with_signs((u32)(g >> 32), signs >> 4);
}
// (d * (0.5 + s)) * 0.25: the IQ2 types' scale of a 4-bit s (IQ3_XXS: * 0.5).
__device__ __forceinline__ float iq2_scale(float d, u32 s, float f = 0.25f) { return d * (small_f32(s) + 0.5f) * f; }

// IQ2_XXS: planes d (f16), qs (64 = 8 x 8 bytes, one unit each). A unit's 8 bytes: 4 grid indices
// (byte l: values 8l..8l+7 from iq2xxs_grid) and a u32 whose bits 7l..7l+6 index the signs of group
// l and whose bits 28-31 are s; value = (d * (0.5 + s) * 0.25) * grid * sign.
struct TIQ2_XXS : Codebook<TIQ2_XXS> {
    struct Raw { uint2 q; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint2* qs = (const uint2*)(w + align16(2 * nb));
        return {__ldg(qs + blk * 8 + unit), __ldg((const u16*)w + blk)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) {
#pragma unroll
        for (int l = 0; l < 4; ++l)
            signed8(__ldg(iq2xxs_grid + ((r.q.x >> (8 * l)) & 0xFF)), ksigns((r.q.y >> (7 * l)) & 127), q + 2 * l);
    }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        d[0] = d[1] = iq2_scale(f16_to_f32(r.d), r.q.y >> 28);
    }
};

// IQ2_XS: planes d (f16), qs (32 x u16), scales (8). A unit's 4 u16: group l's grid index (bits 0-8,
// iq2xs_grid) and sign index (bits 9-15); scales[unit]: s of run 0 in the low nibble, of run 1 in
// the high; value = (d * (0.5 + s) * 0.25) * grid * sign.
struct TIQ2_XS : Codebook<TIQ2_XS> {
    struct Raw { uint2 q; u16 d; u8 sc; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qs_at = align16(2 * nb), sc_at = qs_at + align16(64 * nb);
        return {__ldg((const uint2*)(w + qs_at) + blk * 8 + unit), __ldg((const u16*)w + blk),
                __ldg(w + sc_at + blk * 8 + unit)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) {
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 v = ((l < 2 ? r.q.x : r.q.y) >> (16 * (l & 1))) & 0xFFFF;
            signed8(__ldg(iq2xs_grid + (v & 511)), ksigns(v >> 9), q + 2 * l);
        }
    }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        const float dd = f16_to_f32(r.d);
        d[0] = iq2_scale(dd, r.sc & 0xF);
        d[1] = iq2_scale(dd, r.sc >> 4);
    }
};

// IQ2_S: planes d (f16), qs (32), signs (32), qh (8), scales (8). Group l of a unit: grid index
// qs[4 unit + l] | bits 2l, 2l+1 of qh[unit] << 8 (iq2s_grid), sign bits signs[4 unit + l]; scales as
// IQ2_XS.
struct TIQ2_S : Codebook<TIQ2_S> {
    struct Raw { u32 qs, signs; u16 d; u8 qh, sc; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qs_at = align16(2 * nb), signs_at = qs_at + align16(32 * nb), qh_at = signs_at + align16(32 * nb);
        const i64 sc_at = qh_at + align16(8 * nb);
        return {__ldg((const u32*)(w + qs_at) + blk * 8 + unit), __ldg((const u32*)(w + signs_at) + blk * 8 + unit),
                __ldg((const u16*)w + blk), __ldg(w + qh_at + blk * 8 + unit), __ldg(w + sc_at + blk * 8 + unit)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) {
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 index = ((r.qs >> (8 * l)) & 0xFF) | ((((u32)r.qh >> (2 * l)) & 3) << 8);
            signed8(__ldg(iq2s_grid + index), r.signs >> (8 * l), q + 2 * l);
        }
    }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        const float dd = f16_to_f32(r.d);
        d[0] = iq2_scale(dd, r.sc & 0xF);
        d[1] = iq2_scale(dd, r.sc >> 4);
    }
};

// IQ3_XXS: planes d (f16), qs (64), scales_and_signs (8 x u32). A unit: qs[8 unit + k] indexes
// iq3xxs_grid for values 4k..4k+3; its u32 holds the sign indices of groups of 8 (bits 7l..7l+6) and
// s (bits 28-31); value = (d * (0.5 + s) * 0.5) * grid * sign.
struct TIQ3_XXS : Codebook<TIQ3_XXS> {
    struct Raw { uint2 q; u32 aux; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qs_at = align16(2 * nb), aux_at = qs_at + align16(64 * nb);
        return {__ldg((const uint2*)(w + qs_at) + blk * 8 + unit), __ldg((const u32*)(w + aux_at) + blk * 8 + unit),
                __ldg((const u16*)w + blk)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32 g = __ldg(iq3xxs_grid + (((k < 4 ? r.q.x : r.q.y) >> (8 * (k & 3))) & 0xFF));
            q[k] = with_signs(g, ksigns((r.aux >> (7 * (k >> 1))) & 127) >> (4 * (k & 1)));
        }
    }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        d[0] = d[1] = iq2_scale(f16_to_f32(r.d), r.aux >> 28, 0.5f);
    }
};

// IQ3_S: planes d (f16), qs (64), qh (8), signs (32), scales (4). A unit: iq3s_grid index k (values
// 4k..4k+3) is qs[8 unit + k] | bit k of qh[unit] << 8; signs[4 unit + l] are the sign bits of values
// 8l..8l+7; s is bits 4 unit.. of scales (a u32); value = (d * (1 + 2s)) * grid * sign.
struct TIQ3_S : Codebook<TIQ3_S> {
    struct Raw { uint2 q; u32 signs, sc; u16 d; u8 qh; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qs_at = align16(2 * nb), qh_at = qs_at + align16(64 * nb), signs_at = qh_at + align16(8 * nb);
        const i64 sc_at = signs_at + align16(32 * nb);
        return {__ldg((const uint2*)(w + qs_at) + blk * 8 + unit), __ldg((const u32*)(w + signs_at) + blk * 8 + unit),
                __ldg((const u32*)(w + sc_at) + blk), __ldg((const u16*)w + blk), __ldg(w + qh_at + blk * 8 + unit)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32 index = (((k < 4 ? r.q.x : r.q.y) >> (8 * (k & 3))) & 0xFF) | ((((u32)r.qh >> k) & 1) << 8);
            q[k] = with_signs(__ldg(iq3s_grid + index), r.signs >> (4 * k));
        }
    }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        d[0] = d[1] = f16_to_f32(r.d) * small_f32(1 + 2 * ((r.sc >> (4 * unit)) & 0xF));
    }
};

// IQ1_S / IQ1_M: codewords of -1, 0, 1 (iq1s_grid, stored + 1 as nibbles) shifted by delta = +-1/8 per
// group; the bytes are 8 * (grid + delta) = 8 * nibble - 8 +- 1 and the scales carry the 1/8.
__device__ __forceinline__ void iq1_words(u32 g, bool negative, u32* q) {
    const u32 offset = negative ? 0x09090909u : 0x07070707u;
    q[0] = __vsub4(low_nibbles(g) << 3, offset);
    q[1] = __vsub4(high_nibbles(g) << 3, offset);
}

// IQ1_S: planes d (f16), qs (32), qh (8 x u16). A unit: grid index l is qs[4 unit + l] | bits 3l..3l+2
// of qh[unit] << 8; qh's bits 12-14 are s, bit 15 the sign of delta; value = (d * (2s + 1)) * (grid + delta).
struct TIQ1_S : Codebook<TIQ1_S> {
    struct Raw { u32 qs; u16 qh, d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qs_at = align16(2 * nb), qh_at = qs_at + align16(32 * nb);
        return {__ldg((const u32*)(w + qs_at) + blk * 8 + unit), __ldg((const u16*)(w + qh_at) + blk * 8 + unit),
                __ldg((const u16*)w + blk)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) {
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 index = ((r.qs >> (8 * l)) & 0xFF) | ((((u32)r.qh >> (3 * l)) & 7) << 8);
            iq1_words(__ldg(iq1s_grid + index), r.qh & 0x8000, q + 2 * l);
        }
    }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        d[0] = d[1] = f16_to_f32(r.d) * small_f32(2 * ((r.qh >> 12) & 7) + 1) * 0.125f;
    }
};

// IQ1_M: planes qs (32), qh (16), scales (4 x u16). A unit: grid index l is qs[4 unit + l] | bits 0-2
// of nibble l of its u16 of qh << 8, whose bit 3 is the sign of delta; s of run h is bits 6 (unit % 2)
// + 3h.. of scale word unit / 2; d (f16) is the top nibbles of the four scale words, first word lowest.
// value = (d * (2s + 1)) * (grid + delta).
struct TIQ1_M : Codebook<TIQ1_M> {
    struct Raw { uint2 sc; u32 qs; u16 qh; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const i64 qh_at = align16(32 * nb), sc_at = qh_at + align16(16 * nb);
        return {__ldg((const uint2*)(w + sc_at) + blk), __ldg((const u32*)w + blk * 8 + unit),
                __ldg((const u16*)(w + qh_at) + blk * 8 + unit)};
    }
    static __device__ __forceinline__ void words(const Raw& r, int unit, u32 (&q)[8]) {
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 h = ((u32)r.qh >> (4 * l)) & 0xF;
            iq1_words(__ldg(iq1s_grid + (((r.qs >> (8 * l)) & 0xFF) | ((h & 7) << 8))), h & 8, q + 2 * l);
        }
    }
    static __device__ __forceinline__ void scales(const Raw& r, int unit, float (&d)[2]) {
        const u32 bits = ((r.sc.x >> 12) & 0xF) | ((r.sc.x >> 24) & 0xF0) | ((r.sc.y >> 4) & 0xF00) | ((r.sc.y >> 16) & 0xF000);
        const float dd = f16_to_f32((u16)bits);
        const u32 word = (unit < 4 ? r.sc.x : r.sc.y) >> (16 * ((unit >> 1) & 1) + 6 * (unit & 1));
#pragma unroll
        for (int h = 0; h < 2; ++h) d[h] = dd * small_f32(2 * ((word >> (3 * h)) & 7) + 1) * 0.125f;
    }
};

// ---------------------------------------------------------------------------------------------
// Q4_K / Q5_K: 256 values in 8 sub-blocks of 32, each with a 6-bit scale and min packed in 12
// bytes; value = (d * scale) * q - dmin * min. Raw blocks: d, dmin (f16), scales[12], [qh[32]],
// qs[128]. Byte l of qs chunk j (32 bytes) holds value 64j + l in its low nibble (sub-block 2j)
// and value 64j + 32 + l in its high nibble (sub-block 2j + 1). A unit is 16 bytes of qs: chunk
// j = unit / 2, bytes 16 * (unit % 2) onwards.

// Scale and min of sub-block `is` from the scale words (bytes 0-3, 4-7, 8-11 of scales[12]).
__device__ __forceinline__ void k_scale_min(u32 s0, u32 s1, u32 s2, int is, float& sc, float& mn) {
    u32 a, b;
    if (is < 4) {
        a = (s0 >> (8 * is)) & 63;
        b = (s1 >> (8 * is)) & 63;
    } else {
        const int k = 8 * (is - 4);
        a = ((s2 >> k) & 0xF) | (((s0 >> (k + 6)) & 3) << 4);
        b = ((s2 >> (k + 4)) & 0xF) | (((s1 >> (k + 6)) & 3) << 4);
    }
    sc = small_f32(a);
    mn = small_f32(b);
}

struct TQ4_K {
    static constexpr int BLOCK = 256, UNITS = 8, UV = 32, NR = 2, RL = 16;
    struct Raw { uint4 head, q; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* b = (const uint4*)(w + blk * 144);
        return {__ldg(b), __ldg(b + 1 + unit)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const int j = unit >> 1;
        const float d = f16_to_f32((u16)(r.head.x & 0xFFFF)), dmin = f16_to_f32((u16)(r.head.x >> 16));
        float sc0, mn0, sc1, mn1;
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j, sc0, mn0);
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j + 1, sc1, mn1);
        const float d0 = d * sc0, m0 = dmin * mn0, d1 = d * sc1, m1 = dmin * mn1;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = low_nibbles(word_of(r.q, i)), hi = high_nibbles(word_of(r.q, i));
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[4 * i + k] = mul_sub<EXACT>(d0, byte_f32(lo, k), m0);
                v[16 + 4 * i + k] = mul_sub<EXACT>(d1, byte_f32(hi, k), m1);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const int j = unit >> 1;
        const float d = f16_to_f32((u16)(r.head.x & 0xFFFF)), dmin = f16_to_f32((u16)(r.head.x >> 16));
        float sc0, mn0, sc1, mn1;
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j, sc0, mn0);
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j + 1, sc1, mn1);
        const int s0 = dot16(low_nibbles(r.q.x), low_nibbles(r.q.y), low_nibbles(r.q.z), low_nibbles(r.q.w), xw);
        const int s1 = dot16(high_nibbles(r.q.x), high_nibbles(r.q.y), high_nibbles(r.q.z), high_nibbles(r.q.w), xw + 8);
        return d * sc0 * xs[0] * (float)s0 - dmin * mn0 * xsum[0] + d * sc1 * xs[1] * (float)s1 - dmin * mn1 * xsum[1];
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) {
        return 64 * (unit >> 1) + 16 * (unit & 1) + 32 * run;
    }
};

// Q4_K as gemv_q reads it: a unit is a whole 32-byte chunk j of qs (values 64j..64j+63; sub-block 2j in the low
// nibbles, 2j + 1 in the high ones), so a lane decodes the two sub-blocks' scales and mins once for 64 values where
// TQ4_K's 16-byte units decode them for 32, and without a branch (TQ4_K's k_scale_min branches on the sub-block,
// which differs between the lanes of a warp). Four runs of 16 values: x is quantized as for TQ4_K.
struct TQ4_KP {
    static constexpr int BLOCK = 256, UNITS = 4, UV = 64, NR = 4, RL = 16;
    struct Raw { uint4 head, lo, hi; };  // lo, hi: bytes 0-15 and 16-31 of the chunk
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* b = (const uint4*)(w + blk * 144);
        return {__ldg(b), __ldg(b + 1 + 2 * unit), __ldg(b + 2 + 2 * unit)};
    }
    // The 6-bit scales (sc) and mins (mn) of sub-blocks 2j and 2j + 1, as bytes 0 and 1 of each word.
    static __device__ __forceinline__ void scales(const uint4& head, int j, u32& sc, u32& mn) {
        const int shift = 16 * (j & 1);
        const u32 a = head.y >> shift, b = head.z >> shift, c = head.w >> shift;
        sc = j < 2 ? a & 0x3F3Fu : (c & 0x0F0Fu) | ((a >> 2) & 0x3030u);
        mn = j < 2 ? b & 0x3F3Fu : ((c >> 4) & 0x0F0Fu) | ((b >> 2) & 0x3030u);
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        u32 sc, mn;
        scales(r.head, unit, sc, mn);
        const float d = f16_to_f32((u16)(r.head.x & 0xFFFF)), dmin = f16_to_f32((u16)(r.head.x >> 16));
        const int s0 = dot16(low_nibbles(r.lo.x), low_nibbles(r.lo.y), low_nibbles(r.lo.z), low_nibbles(r.lo.w), xw);
        const int s1 = dot16(low_nibbles(r.hi.x), low_nibbles(r.hi.y), low_nibbles(r.hi.z), low_nibbles(r.hi.w), xw + 8);
        // the high nibbles in place, 16 times their values: s2 and s3 are 16 times their sums, and 1/16 goes into the
        // scale (powers of two, so the same float32 values bit for bit)
        const int s2 = dot16u(r.lo.x & 0xF0F0F0F0u, r.lo.y & 0xF0F0F0F0u, r.lo.z & 0xF0F0F0F0u, r.lo.w & 0xF0F0F0F0u, xw + 16);
        const int s3 = dot16u(r.hi.x & 0xF0F0F0F0u, r.hi.y & 0xF0F0F0F0u, r.hi.z & 0xF0F0F0F0u, r.hi.w & 0xF0F0F0F0u, xw + 24);
        const float low = byte_f32(sc, 0) * (xs[0] * (float)s0 + xs[1] * (float)s1);
        const float high = byte_f32(sc, 1) * 0.0625f * (xs[2] * (float)s2 + xs[3] * (float)s3);
        const float mins = byte_f32(mn, 0) * (xsum[0] + xsum[1]) + byte_f32(mn, 1) * (xsum[2] + xsum[3]);
        return d * (low + high) - dmin * mins;
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 64 * unit + 16 * run; }
};

// Q5_K adds qh[32]: bit s of qh[l] is bit 4 of value 32s + l.
struct TQ5_K {
    static constexpr int BLOCK = 256, UNITS = 8, UV = 32, NR = 2, RL = 16;
    struct Raw { uint4 head, qh, q; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const uint4* b = (const uint4*)(w + blk * 176);
        return {__ldg(b), __ldg(b + 1 + (unit & 1)), __ldg(b + 3 + unit)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const int j = unit >> 1;
        const float d = f16_to_f32((u16)(r.head.x & 0xFFFF)), dmin = f16_to_f32((u16)(r.head.x >> 16));
        float sc0, mn0, sc1, mn1;
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j, sc0, mn0);
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j + 1, sc1, mn1);
        const float d0 = d * sc0, m0 = dmin * mn0, d1 = d * sc1, m1 = dmin * mn1;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 h = word_of(r.qh, i);
            const u32 lo = low_nibbles(word_of(r.q, i)) | (((h >> (2 * j)) & 0x01010101u) << 4);
            const u32 hi = high_nibbles(word_of(r.q, i)) | (((h >> (2 * j + 1)) & 0x01010101u) << 4);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[4 * i + k] = mul_sub<EXACT>(d0, byte_f32(lo, k), m0);
                v[16 + 4 * i + k] = mul_sub<EXACT>(d1, byte_f32(hi, k), m1);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const int j = unit >> 1;
        const float d = f16_to_f32((u16)(r.head.x & 0xFFFF)), dmin = f16_to_f32((u16)(r.head.x >> 16));
        float sc0, mn0, sc1, mn1;
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j, sc0, mn0);
        k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j + 1, sc1, mn1);
        u32 lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 h = word_of(r.qh, i);
            lo[i] = low_nibbles(word_of(r.q, i)) | (((h >> (2 * j)) & 0x01010101u) << 4);
            hi[i] = high_nibbles(word_of(r.q, i)) | (((h >> (2 * j + 1)) & 0x01010101u) << 4);
        }
        const int s0 = dot16(lo[0], lo[1], lo[2], lo[3], xw), s1 = dot16(hi[0], hi[1], hi[2], hi[3], xw + 8);
        return d * sc0 * xs[0] * (float)s0 - dmin * mn0 * xsum[0] + d * sc1 * xs[1] * (float)s1 - dmin * mn1 * xsum[1];
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) {
        return 64 * (unit >> 1) + 16 * (unit & 1) + 32 * run;
    }
};

// ---------------------------------------------------------------------------------------------
// Q2_K / Q3_K / Q6_K: 256 values in two halves n of 128; byte l (0..31) of a half's 2-bit or
// 4-bit field serves values 128n + 32t + l for t = 0..3. A unit is 8 consecutive l of one half:
// half n = unit / 4, l0 = 8 * (unit % 4), runs t = 0..3 of 8 values at 128n + 32t + l0. Scales
// are per 16 values: value 128n + 32t + l uses scale 8n + 2t + l / 16.

// Four 6-bit Q6_K values of run t, one a byte (0..63): from a word of ql (low nibbles for t = 0, 1, high for 2, 3)
// and the word of qh at the same l (bits 2t, 2t + 1).
__device__ __forceinline__ u32 q6_k_values(u32 lw, u32 hw, int t) {
    return (t < 2 ? low_nibbles(lw) : high_nibbles(lw)) | (((hw >> (2 * t)) & 0x03030303u) << 4);
}

// Byte `b` (0..7) of an 8-byte word pair, as an unsigned value.
__device__ __forceinline__ u32 byte8(const uint2& w, int b) { return ((b < 4 ? w.x : w.y) >> (8 * (b & 3))) & 0xFF; }

// Q6_K planes: ql[128], qh[64], scales[16] (int8), d (f16). value = (d * scale) * (q - 32), q the
// 4 bits of ql (low nibbles of ql[64n + l] for t=0, of ql[64n + 32 + l] for t=1, their high
// nibbles for t=2, 3) and bits 2t, 2t+1 of qh[32n + l] as bits 4, 5.
struct TQ6_K {
    static constexpr int BLOCK = 256, UNITS = 8, UV = 32, NR = 4, RL = 8;
    struct Raw { uint2 la, lb, h, sc; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const int n = unit >> 2, l0 = 8 * (unit & 3);
        const u8* ql = w + blk * 128 + 64 * n + l0;
        return {__ldg((const uint2*)ql), __ldg((const uint2*)(ql + 32)),
                __ldg((const uint2*)(w + 128 * nb + blk * 64 + 32 * n + l0)),
                __ldg((const uint2*)(w + 192 * nb + blk * 16 + 8 * n)), __ldg((const u16*)(w + 208 * nb) + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const int odd = (unit & 3) >> 1;  // l0 / 16
        const float d = f16_to_f32(r.d);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const float ds = d * (float)(signed char)byte8(r.sc, 2 * t + odd);
            const uint2& l = (t & 1) ? r.lb : r.la;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 q = q6_k_values(i ? l.y : l.x, i ? r.h.y : r.h.x, t);
#pragma unroll
                for (int k = 0; k < 4; ++k) v[8 * t + 4 * i + k] = ds * byte_f32(q, k, 32.0f);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const int odd = (unit & 3) >> 1;
        const float d = f16_to_f32(r.d);
        float total = 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint2& l = (t & 1) ? r.lb : r.la;
            u32 q[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                q[i] = __vsub4(q6_k_values(i ? l.y : l.x, i ? r.h.y : r.h.x, t), 0x20202020u);
            }
            const int s = dot4(q[1], xw[4 * t + 2], xw[4 * t + 3], dot4(q[0], xw[4 * t], xw[4 * t + 1], 0));
            total += d * (float)(signed char)byte8(r.sc, 2 * t + odd) * xs[t] * (float)s;
        }
        return total;
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 128 * (unit >> 2) + 32 * run + 8 * (unit & 3); }
};

// Q6_K as gemv_q reads it: a unit is 16 consecutive l of a half (n = unit / 2, l0 = 16 * (unit % 2)), four runs t of
// 16 values at 128n + 32t + l0, each under one scale (8n + 2t + unit % 2): 64 values for the five loads (and their
// addresses) that TQ6_K's 8-l units spend on 32. The 6-bit q is summed unsigned and the 32 taken off through x's
// run sums, as the K types' mins are.
struct TQ6_KP {
    static constexpr int BLOCK = 256, UNITS = 4, UV = 64, NR = 4, RL = 16;
    struct Raw { uint4 la, lb, h; uint2 sc; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const int n = unit >> 1, l0 = 16 * (unit & 1);
        const u8* ql = w + blk * 128 + 64 * n + l0;
        return {__ldg((const uint4*)ql), __ldg((const uint4*)(ql + 32)),
                __ldg((const uint4*)(w + 128 * nb + blk * 64 + 32 * n + l0)),
                __ldg((const uint2*)(w + 192 * nb + blk * 16 + 8 * n)), __ldg((const u16*)(w + 208 * nb) + blk)};
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const int odd = unit & 1;
        const u32 sc[2] = {r.sc.x ^ 0x80808080u, r.sc.y ^ 0x80808080u};  // signed bytes, offset by 128
        float total = 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint4& l = (t & 1) ? r.lb : r.la;
            u32 q[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) q[i] = q6_k_values(word_of(l, i), word_of(r.h, i), t);
            const int s = dot16(q[0], q[1], q[2], q[3], xw + 8 * t);
            const float scale = byte_f32(sc[t >> 1], 2 * (t & 1) + odd, 128.0f);
            total += scale * (xs[t] * (float)s - 32.0f * xsum[t]);
        }
        return f16_to_f32(r.d) * total;
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) {
        return 128 * (unit >> 1) + 32 * run + 16 * (unit & 1);
    }
};

// Q2_K planes: scales[16] (low nibble scale, high nibble min), qs[64], (d, dmin) (2 x f16).
// value = (d * scale) * q - dmin * min, q = bits 2t, 2t+1 of qs[32n + l].
struct TQ2_K {
    static constexpr int BLOCK = 256, UNITS = 8, UV = 32, NR = 4, RL = 8;
    struct Raw { uint2 q, sc; u32 dm; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const int n = unit >> 2, l0 = 8 * (unit & 3);
        return {__ldg((const uint2*)(w + 16 * nb + blk * 64 + 32 * n + l0)), __ldg((const uint2*)(w + blk * 16 + 8 * n)),
                __ldg((const u32*)(w + 80 * nb) + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const int odd = (unit & 3) >> 1;
        const float d = f16_to_f32((u16)(r.dm & 0xFFFF)), dmin = f16_to_f32((u16)(r.dm >> 16));
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 s = byte8(r.sc, 2 * t + odd);
            const float dl = d * small_f32(s & 0xF), ml = dmin * small_f32(s >> 4);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 q = ((i ? r.q.y : r.q.x) >> (2 * t)) & 0x03030303u;
#pragma unroll
                for (int k = 0; k < 4; ++k) v[8 * t + 4 * i + k] = mul_sub<EXACT>(dl, byte_f32(q, k), ml);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const int odd = (unit & 3) >> 1;
        const float d = f16_to_f32((u16)(r.dm & 0xFFFF)), dmin = f16_to_f32((u16)(r.dm >> 16));
        float total = 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 sc = byte8(r.sc, 2 * t + odd);
            const int s = dot4((r.q.y >> (2 * t)) & 0x03030303u, xw[4 * t + 2], xw[4 * t + 3],
                               dot4((r.q.x >> (2 * t)) & 0x03030303u, xw[4 * t], xw[4 * t + 1], 0));
            total += d * small_f32(sc & 0xF) * xs[t] * (float)s - dmin * small_f32(sc >> 4) * xsum[t];
        }
        return total;
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 128 * (unit >> 2) + 32 * run + 8 * (unit & 3); }
};

// Q3_K planes: hmask[32], qs[64], scales[12] (16 6-bit signed scales), d (f16).
// value = (d * (scale - 32)) * (q - 4 * (1 - hbit)), q = bits 2t, 2t+1 of qs[32n + l], hbit = bit
// 4n + t of hmask[l]. Scale i: low 4 bits from nibble (i / 8) of byte i % 8, high 2 bits from
// bits 2 * (i / 4) of byte 8 + i % 4.
struct TQ3_K {
    static constexpr int BLOCK = 256, UNITS = 8, UV = 32, NR = 4, RL = 8;
    struct Raw { uint2 q, hm; u32 s0, s1, s2; u16 d; };
    static __device__ __forceinline__ Raw load(const u8* w, i64 nb, i64 blk, int unit) {
        const int n = unit >> 2, l0 = 8 * (unit & 3);
        const u32* sc = (const u32*)(w + 96 * nb) + blk * 3;
        return {__ldg((const uint2*)(w + 32 * nb + blk * 64 + 32 * n + l0)), __ldg((const uint2*)(w + blk * 32 + l0)),
                __ldg(sc), __ldg(sc + 1), __ldg(sc + 2), __ldg((const u16*)(w + align16(108 * nb)) + blk)};
    }
    template <bool EXACT>
    static __device__ __forceinline__ void decode(const Raw& r, int unit, float (&v)[UV]) {
        const int n = unit >> 2, odd = (unit & 3) >> 1;
        const float d = f16_to_f32(r.d);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int i = 8 * n + 2 * t + odd, b = i & 7;
            const u32 low = ((b < 4 ? r.s0 : r.s1) >> (8 * (b & 3) + 4 * (i >> 3))) & 0xF;
            const u32 high = (r.s2 >> (8 * (i & 3) + 2 * (i >> 2))) & 3;
            const float dl = d * small_f32(low | (high << 4), 32.0f);
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
                const u32 q = (((k2 ? r.q.y : r.q.x) >> (2 * t)) & 0x03030303u) |
                              ((((k2 ? r.hm.y : r.hm.x) >> (4 * n + t)) & 0x01010101u) << 2);
#pragma unroll
                for (int k = 0; k < 4; ++k) v[8 * t + 4 * k2 + k] = dl * byte_f32(q, k, 4.0f);
            }
        }
    }
    static __device__ __forceinline__ float dot(const Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
        const int n = unit >> 2, odd = (unit & 3) >> 1;
        const float d = f16_to_f32(r.d);
        float total = 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int i = 8 * n + 2 * t + odd, b = i & 7;
            const u32 low = ((b < 4 ? r.s0 : r.s1) >> (8 * (b & 3) + 4 * (i >> 3))) & 0xF;
            const u32 high = (r.s2 >> (8 * (i & 3) + 2 * (i >> 2))) & 3;
            u32 q[2];
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2)
                q[k2] = __vsub4((((k2 ? r.q.y : r.q.x) >> (2 * t)) & 0x03030303u) |
                                    ((((k2 ? r.hm.y : r.hm.x) >> (4 * n + t)) & 0x01010101u) << 2),
                                0x04040404u);
            const int s = dot4(q[1], xw[4 * t + 2], xw[4 * t + 3], dot4(q[0], xw[4 * t], xw[4 * t + 1], 0));
            total += d * small_f32(low | (high << 4), 32.0f) * xs[t] * (float)s;
        }
        return total;
    }
    static __device__ __forceinline__ int run_offset(int unit, int run) { return 128 * (unit >> 2) + 32 * run + 8 * (unit & 3); }
};

// A unit of rows g and g + 8 (raw0, raw1) decoded once, as the mma A fragments of its UV / 4 k-steps: k-step j
// takes the quad's values 4j..4j+3, lane t's at fragment columns 2t, 2t + 1, 2t + 8, 2t + 9 (gemm_few in
// matmul.cu says why; experts.cu's gemm_grouped takes them too); `keep` 0 blanks a unit past a row's end.
template <class T>
__device__ __forceinline__ void unit_fragments(const typename T::Raw& raw0, const typename T::Raw& raw1, int unit,
                                               float keep, u32 (&a)[T::UV / 4][4]) {
    float v0[T::UV], v1[T::UV];
    T::template decode<false>(raw0, unit, v0);
    T::template decode<false>(raw1, unit, v1);
#pragma unroll
    for (int j = 0; j < T::UV / 4; ++j) {
        a[j][0] = pack_f16x2(v0[4 * j] * keep, v0[4 * j + 1] * keep);
        a[j][1] = pack_f16x2(v1[4 * j] * keep, v1[4 * j + 1] * keep);
        a[j][2] = pack_f16x2(v0[4 * j + 2] * keep, v0[4 * j + 3] * keep);
        a[j][3] = pack_f16x2(v1[4 * j + 2] * keep, v1[4 * j + 3] * keep);
    }
}
