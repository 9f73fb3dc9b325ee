// What the attention kernels (ops.cu, mla.cu) share: the KV cache's element types, float32, f16 (u16)
// or q8_0 (i8), read as floats and written from floats; and the merge of a block's warps at the end. And what the
// kernels that rotate k before writing it share with the rest: RoPE's pair rotation; and a row's binade, for
// scaling it to f16.
#pragma once
#include "common.cuh"

// e with `mx` in [2^(e-1), 2^e), 0 where mx is 0 or not finite: scaled by 2^(15 - e), a row whose largest magnitude
// is mx has it in [2^14, 2^15), f16's top binade (x_to_f16's shift, the MLA kernels' f16 queries).
__device__ __forceinline__ int binade(float mx) {
    int e = 0;
    if (mx > 0.0f && isfinite(mx)) frexpf(mx, &e);
    return e;
}

// One RoPE pair: (xa, xb) rotated by `angle` (float64, as the oracle computes it), cos and sin times `magnitude`
// (RopeSpec.attn_factor); each product and sum rounded on its own (no fused multiply-add), so that every kernel that
// rotates (rope, rope_norm, rope_kv_write, gemv_q's ROPE epilogue) gives the same bits.
__device__ __forceinline__ void rope_pair(float xa, float xb, double angle, float magnitude, float& ya, float& yb) {
    double s, c;
    sincos(angle, &s, &c);
    s *= magnitude;
    c *= magnitude;
    const float cf = (float)c, sf = (float)s;
    ya = __fsub_rn(__fmul_rn(xa, cf), __fmul_rn(xb, sf));
    yb = __fadd_rn(__fmul_rn(xa, sf), __fmul_rn(xb, cf));
}

// Eight consecutive values (16-byte aligned) as floats.
__device__ __forceinline__ void load8(const float* p, float (&k)[8]) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    k[0] = a.x; k[1] = a.y; k[2] = a.z; k[3] = a.w; k[4] = b.x; k[5] = b.y; k[6] = b.z; k[7] = b.w;
}
__device__ __forceinline__ void load8(const u16* p, float (&k)[8]) {
    const uint4 a = *(const uint4*)p;
    const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        k[2 * i] = f16_to_f32((u16)(w[i] & 0xFFFF));
        k[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
    }
}

// Element d of cache row `row` (rows of `dim` values). q8_0 (KV = i8, GGUF's Q8_0 split in two planes):
// the int8 quants in one allocation laid out as a float cache, and one f16 scale per 32 values in
// another, [..., dim / 32]; `s` is that scale plane (unused, null, for float and f16 caches).
typedef signed char i8;
__device__ __forceinline__ float kv_load(const float* c, const u16*, i64 row, int dim, int d) { return c[row * dim + d]; }
__device__ __forceinline__ float kv_load(const u16* c, const u16*, i64 row, int dim, int d) {
    return f16_to_f32(c[row * dim + d]);
}
__device__ __forceinline__ float kv_load(const i8* c, const u16* s, i64 row, int dim, int d) {
    return (float)c[row * dim + d] * f16_to_f32(s[row * (dim >> 5) + (d >> 5)]);  // exact: 8 x 11 bits
}
// Elements d ... d + 7 of row `row` (d a multiple of 8, dim of 8 for float and f16, of 32 for q8_0).
__device__ __forceinline__ void kv_load8(const float* c, const u16*, i64 row, int dim, int d, float (&k)[8]) {
    load8(c + row * dim + d, k);
}
__device__ __forceinline__ void kv_load8(const u16* c, const u16*, i64 row, int dim, int d, float (&k)[8]) {
    load8(c + row * dim + d, k);
}
__device__ __forceinline__ void kv_load8(const i8* c, const u16* s, i64 row, int dim, int d, float (&k)[8]) {
    const uint2 w = *(const uint2*)(c + row * dim + d);  // 8-byte aligned: rows are 32-byte multiples
    const float scale = f16_to_f32(s[row * (dim >> 5) + (d >> 5)]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // int8 -> float exactly: flip the sign bit, read as unsigned, less 128
        k[i] = byte_f32(w.x ^ 0x80808080u, i, 128.0f) * scale;
        k[4 + i] = byte_f32(w.y ^ 0x80808080u, i, 128.0f) * scale;
    }
}
// Values d ... d + 7 of cache row `row` (rows of D values) as eight f16 (16 bytes), for the tensor-core kernels
// (flash.cu, mla.cu): an f16 cache's as stored, a q8_0 cache's decoded.
template <int D> __device__ __forceinline__ uint4 kv_f16x8(const u16* c, const u16*, i64 row, int d) {
    return *(const uint4*)(c + row * D + d);
}
template <int D> __device__ __forceinline__ uint4 kv_f16x8(const i8* c, const u16* s, i64 row, int d) {
    float v[8];
    kv_load8(c, s, row, D, d, v);
    return make_uint4(pack_f16x2(v[0], v[1]), pack_f16x2(v[2], v[3]), pack_f16x2(v[4], v[5]), pack_f16x2(v[6], v[7]));
}

// Stores x(0) ... x(n - 1) at elements at ... at + n - 1 of a cache; all threads of the block take part.
template <typename F> __device__ __forceinline__ void kv_put(float* c, u16*, i64 at, int n, F x) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) c[at + i] = x(i);
}
template <typename F> __device__ __forceinline__ void kv_put(u16* c, u16*, i64 at, int n, F x) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) c[at + i] = f32_to_f16(x(i));
}
// q8_0 (at and n multiples of 32): one warp per block of 32, rounded as the CPU backend's _q8_0 does:
// d = max|x| / 127 in float32, q = x / d (a true division, not x * (1 / d)), then floor(|q| + 0.5)
// with q's sign (ggml's roundf but for |q| = 0.5 - 2^-25, which this rounds up as numpy does); the
// scale is d rounded to f16 (q uses the unrounded d, as ggml's quantize_row_q8_0).
template <typename F> __device__ __forceinline__ void kv_put(i8* c, u16* s, i64 at, int n, F x) {
    const int lane = threadIdx.x & 31;
    for (int b = threadIdx.x >> 5; b < n >> 5; b += blockDim.x >> 5) {  // warp-uniform: full-warp shuffles
        const float v = x(32 * b + lane), d = warp_max(fabsf(v)) / 127.0f;
        const float q = d > 0.0f ? v / d : 0.0f;
        c[at + 32 * b + lane] = (i8)copysignf(floorf(fabsf(q) + 0.5f), q);
        if (lane == 0) s[(at >> 5) + b] = f32_to_f16(d);
    }
}

// An attention sink (gpt-oss): the head's learned logit s joins the softmax denominator and adds no
// value. Rescales the running (max mx, sum, weighted values a) to max(mx, s) and adds exp(s - max).
__device__ __forceinline__ void sink_join(float s, float mx, float& sum, float& a) {
    const float top = fmaxf(mx, s), f = expf(mx - top);
    sum = sum * f + expf(s - top);
    a *= f;
}

// A decode attention block's token t (blockIdx.x): its positions [begin, end), split z (blockIdx.z) of gridDim.z over
// the token's own range [lo, pos] (lo = pos - window + 1 with a window, else 0), in equal parts rounded up to a
// multiple of `keys` (empty where the token has no slot), and its slot's row of the page table. The launch's split
// count is sized for the batch's deepest token or a graph's whole cache; cutting the token's range keeps a short one
// spread.
__device__ __forceinline__ const int* token_range(const int* tok_slot, const int* tok_pos, const int* page_table,
                                                  int pages_per_slot, int window, int keys, int& begin, int& end) {
    const int slot = tok_slot[blockIdx.x], pos = tok_pos[blockIdx.x];
    const int lo = window > 0 ? max(0, pos - window + 1) : 0, nsplit = gridDim.z;
    const int split = ((pos + 1 - lo + nsplit - 1) / nsplit + keys - 1) / keys * keys;
    begin = lo + (int)blockIdx.z * split;
    end = slot < 0 ? 0 : min(pos + 1, begin + split);
    return page_table + (i64)max(slot, 0) * pages_per_slot;
}

// Eight floats (16-byte aligned) times `scale` as eight f16, for an mma operand's row.
__device__ __forceinline__ uint4 f16x8_scaled(const float* p, float scale) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    return make_uint4(pack_f16x2(a.x * scale, a.y * scale), pack_f16x2(a.z * scale, a.w * scale),
                      pack_f16x2(b.x * scale, b.y * scale), pack_f16x2(b.z * scale, b.w * scale));
}

// Where a block's 4 warps each ran an online softmax over their share of the keys: for one head row th and value dim
// d, the warps' maxima m(w), sums l(w) and unnormalized values a(w) merged, then written. One split: the normalized
// output (with `sinks`, a logit per head th % heads, or null); several: this split z's (max, sum) and unnormalized
// sums for attention_combine.
template <typename M, typename L, typename A>
__device__ __forceinline__ void merge_warps(M m, L l, A a, i64 th, int d, int heads, int dv, int z, int nsplit,
                                            const float* __restrict__ sinks, float* __restrict__ out,
                                            float* __restrict__ part_ml, float* __restrict__ part_acc) {
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, m(w));
    float sum = 0.0f, v = 0.0f;
    if (mx != NEG_INF) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float f = expf(m(w) - mx);
            sum += l(w) * f;
            v += a(w) * f;
        }
    }
    if (nsplit == 1) {
        if (sinks) sink_join(sinks[th % heads], mx, sum, v);
        out[th * dv + d] = sum > 0.0f ? v / sum : 0.0f;
    } else {
        part_acc[(th * nsplit + z) * dv + d] = v;
        if (d == 0) {
            part_ml[2 * (th * nsplit + z)] = mx;
            part_ml[2 * (th * nsplit + z) + 1] = sum;
        }
    }
}

// The end of an attention block whose 4 warps each ran an online softmax over their share of the keys
// for GB query heads (m, l: running max and sum; acc: the lane's DL value dims, lane + 32 i): merges
// the warps' states per head and writes, for the block's first `live` heads, rows th0 + g, g < live, of
// [tokens * heads, dv]. One split: the normalized output (with `sinks`, a logit per head th % heads, or
// null); several: this split z's (max, sum) and unnormalized sums for attention_combine.
template <int GB, int DL>
__device__ __forceinline__ void attention_store(const float (&m)[GB], const float (&l)[GB], const float (&acc)[GB][DL],
                                                int live, i64 th0, int heads, int dv, int z, int nsplit,
                                                const float* __restrict__ sinks, float* __restrict__ out,
                                                float* __restrict__ part_ml, float* __restrict__ part_acc) {
    __shared__ float sm_m[4][GB], sm_l[4][GB], sm_acc[4][GB][DL * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        if (lane == 0) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < DL; ++i) sm_acc[warp][g][lane + 32 * i] = acc[g][i];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < GB * dv; idx += blockDim.x) {
        const int g = idx / dv, d = idx % dv;
        if (g >= live) continue;
        merge_warps([&](int w) { return sm_m[w][g]; }, [&](int w) { return sm_l[w][g]; },
                    [&](int w) { return sm_acc[w][g][d]; }, th0 + g, d, heads, dv, z, nsplit, sinks, out, part_ml,
                    part_acc);
    }
}
