// Products of 9-64 tokens on Hopper's warpgroup tensor cores (sm_90a only; wgmma.py routes to them): Y = X W^T
// (+ bias), X as x_to_f16's f16 rows (`xscale` undoes their scaling), W quantized and read once.
//
// gemm_wg decodes each weight once, straight into the A registers of wgmma.m64nNk16 (unit_fragments, as gemm_rows
// does for mma.sync: a lane (g, t) decodes unit 4s + t of rows g and g + 8 of its warp's 16, k-step j taking the
// unit's values 4j..4j+3 at columns 2t, 2t + 1, 2t + 8, 2t + 9). That order of K is a permutation, which B (x) must
// follow: wg_order_x writes x once per product in it, as the 8 x 8 core matrices the descriptor reads, so that a
// block copies each chunk of WG_KC values of K whole (cp.async, 16 bytes a thread), two chunks in flight.
#include "quants.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

#define WG_KC 256  // values of K a chunk: K must be a multiple

// x's k-step of 8 NT tokens as the B operand's descriptor: K-major core matrices without swizzle, the step's
// columns 8-15 128 bytes after 0-7 (the leading byte offset), the next 8 tokens 256 bytes on (the stride byte
// offset; PTX ISA, "Matrix Descriptor Format": start address, leading and stride byte offsets in 16-byte units).
__device__ __forceinline__ u64 wg_desc(u32 address) {
    return (u64)((address & 0x3FFFF) >> 4) | (u64)(128 >> 4) << 16 | (u64)(256 >> 4) << 32;
}

// A unit of rows g and g + 8 as the A fragments of its UV / 4 k-steps (gemm_wg's decode): unit_fragments's, or for
// Q4_K and Q6_K the same values decoded in f16x2 arithmetic, two at a time: each integer q put in an f16 as 1024 + q
// (exact: the exponent of 1024 has a step of 1), the 1024 (and Q6_K's 32) taken off exactly, then one fused
// multiply-add by the sub-block's scale and min rounded to f16 (the float decode rounds the value to f16 once; this
// rounds the scale, the min and the value: within the products' bound against float64, about half the
// instructions a weight).
template <class T>
struct WgFragments {
    static __device__ __forceinline__ void get(const typename T::Raw& r0, const typename T::Raw& r1, int unit,
                                               u32 (&a)[T::UV / 4][4]) {
        unit_fragments<T>(r0, r1, unit, 1.0f, a);
    }
};

// The f16x2 pair of bytes b and b + 1 of `word` (b = 0 or 2, the bytes' `mask`ed bits) as 1024 + each.
__device__ __forceinline__ u32 f16_pair(u32 word, int b, u32 mask) {
    return (__byte_perm(word, 0, b ? 0x4342 : 0x4140) & mask) | 0x64006400u;
}

#define H2_MINUS_1024 0xE400E400u  // f16 -1024 twice
#define H2_MINUS_1056 0xE420E420u  // f16 -1056 twice: 1024 + q - 1056 = q - 32

// The 16 pairs (values 2i, 2i + 1) of one row's unit, in the fragments' order: [j][0] or [1] takes pair 2j, [j][2]
// or [3] pair 2j + 1.
template <class T>
__device__ __forceinline__ void f16_pairs(const typename T::Raw& r, int unit, u32 (&p)[16]);

template <>
__device__ __forceinline__ void f16_pairs<TQ4_K>(const TQ4_K::Raw& r, int unit, u32 (&p)[16]) {
    const int j = unit >> 1;
    const float d = f16_to_f32((u16)(r.head.x & 0xFFFF)), dmin = f16_to_f32((u16)(r.head.x >> 16));
    float sc0, mn0, sc1, mn1;
    k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j, sc0, mn0);
    k_scale_min(r.head.y, r.head.z, r.head.w, 2 * j + 1, sc1, mn1);
    const u32 s0 = pack_f16x2(d * sc0, d * sc0), m0 = pack_f16x2(-dmin * mn0, -dmin * mn0);
    const u32 s1 = pack_f16x2(d * sc1, d * sc1), m1 = pack_f16x2(-dmin * mn1, -dmin * mn1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // values 4i..4i+3: low nibbles of word i; 16 + 4i..: its high nibbles
        const u32 w = word_of(r.q, i), h = w >> 4;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            p[2 * i + b] = h2_fma(h2_add(f16_pair(w, 2 * b, 0x000F000Fu), H2_MINUS_1024), s0, m0);
            p[8 + 2 * i + b] = h2_fma(h2_add(f16_pair(h, 2 * b, 0x000F000Fu), H2_MINUS_1024), s1, m1);
        }
    }
}

template <>
__device__ __forceinline__ void f16_pairs<TQ6_K>(const TQ6_K::Raw& r, int unit, u32 (&p)[16]) {
    const int odd = (unit & 3) >> 1;
    const float d = f16_to_f32(r.d);
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // values 8t..8t+7: run t, under one scale
        const float ds = d * (float)(signed char)byte8(r.sc, 2 * t + odd);
        const u32 s = pack_f16x2(ds, ds);
        const uint2& l = (t & 1) ? r.lb : r.la;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u32 q = q6_k_values(i ? l.y : l.x, i ? r.h.y : r.h.x, t);
#pragma unroll
            for (int b = 0; b < 2; ++b) p[4 * t + 2 * i + b] = h2_mul(h2_add(f16_pair(q, 2 * b, 0x00FF00FFu), H2_MINUS_1056), s);
        }
    }
}

template <class T>
struct WgPairs {
    static __device__ __forceinline__ void get(const typename T::Raw& r0, const typename T::Raw& r1, int unit,
                                               u32 (&a)[T::UV / 4][4]) {
        u32 p0[16], p1[16];
        f16_pairs<T>(r0, unit, p0);
        f16_pairs<T>(r1, unit, p1);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            a[j][0] = p0[2 * j];
            a[j][1] = p1[2 * j];
            a[j][2] = p0[2 * j + 1];
            a[j][3] = p1[2 * j + 1];
        }
    }
};
template <>
struct WgFragments<TQ4_K> : WgPairs<TQ4_K> {};
template <>
struct WgFragments<TQ6_K> : WgPairs<TQ6_K> {};

// x [N, K] f16 rows in gemm_wg<T, NT>'s order: for each tile of 8 NT tokens, each chunk of WG_KC values, each of its
// WG_KC / 16 k-steps (step s of the chunk's units, k-step j of the unit: index s J + j), a [NT][2][8][8] block of
// core matrices: 8 tokens by 8 columns, the columns 0-7 then 8-15 of the step. Tokens past N are zeros. One thread
// a pair of values (4 bytes).
template <class T, int NT>
__global__ void wg_order_x(const u16* __restrict__ xh, u16* __restrict__ xo, int N, int K) {
    constexpr int J = T::UV / 4, NTOK = 8 * NT;
    const i64 pairs = (i64)((N + NTOK - 1) / NTOK) * NTOK * K / 2;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += (i64)gridDim.x * blockDim.x) {
        const int t = i & 3, r = (i >> 2) & 7, h = (i >> 5) & 1, group = (i >> 6) % NT;
        const i64 step = i / (64 * NT);  // k-steps of 16 from the tile's start
        const int q = step % (WG_KC / 16), chunk = (step / (WG_KC / 16)) % (K / WG_KC);
        const int tile = step / (K / 16), token = tile * NTOK + 8 * group + r;
        const int s = q / J, j = q % J, u = 4 * s + t, unit = u % T::UNITS;
        const int at = chunk * WG_KC + (u / T::UNITS) * T::BLOCK + T::run_offset(unit, 4 * j / T::RL) + (4 * j) % T::RL;
        ((u32*)xo)[i] = token < N ? *(const u32*)(xh + (i64)token * K + at + 2 * h) : 0u;
    }
}

// Y = X W^T (+ bias) for 8 NT tokens a block column (blockIdx.z), 128 weight rows a block (two warpgroups of 64),
// xo from wg_order_x<T, NT>. Split K: block y covers K from y * kchunk (a multiple of WG_KC) and writes its partial
// sums to y + blockIdx.y * N * M (bias in part 0 only) for splitk_sum. Dynamic shared memory: two chunks of x,
// 2 * WG_KC * 8 NT f16 (wg_smem in wgmma.py).
template <class T, int NT>
__global__ void __launch_bounds__(256, 2) gemm_wg(const u8* __restrict__ w, i64 nb, const u16* __restrict__ xo,
                                                  const float* __restrict__ xscale, float* __restrict__ y,
                                                  const float* __restrict__ bias, int M, int N, int K, int kchunk) {
    constexpr int J = T::UV / 4, STEPS = WG_KC / T::UV / 4, NTOK = 8 * NT, CHUNK = WG_KC * NTOK;
    static_assert(WG_KC % (4 * T::UV) == 0, "a chunk of K holds whole quad steps");
    extern __shared__ __align__(128) u16 xs[];  // [2][CHUNK]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * 128 + 16 * warp, tile = blockIdx.z;
    const int bpr = K / T::BLOCK, kbegin = blockIdx.y * kchunk, chunks = (min(K, kbegin + kchunk) - kbegin) / WG_KC;
    if (blockIdx.y > 0) {
        y += (i64)blockIdx.y * N * M;
        bias = nullptr;
    }
    i64 first[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) first[h] = (i64)min(m0 + g + 8 * h, M - 1) * bpr + kbegin / T::BLOCK;
    const u16* src = xo + ((i64)tile * (K / WG_KC) + kbegin / WG_KC) * CHUNK;
    float acc[4 * NT];
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) acc[i] = 0.0f;
    auto stage = [&](int c) {  // chunk c of x into buffer c & 1
        const uint4* from = (const uint4*)(src + (i64)c * CHUNK);
        u16* to = xs + (c & 1) * CHUNK;
        for (int i = threadIdx.x; i < CHUNK / 8; i += 256) cp_async16(to + 8 * i, from + i, 16);
        cp_async_commit();
    };
    stage(0);
    for (int c = 0; c < chunks; ++c) {
        typename T::Raw raw[STEPS][2];  // the chunk's weights asked for before waiting for its x
#pragma unroll
        for (int s = 0; s < STEPS; ++s)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int u = 4 * s + t;
                raw[s][h] = T::load(w, nb, first[h] + c * (WG_KC / T::BLOCK) + u / T::UNITS, u % T::UNITS);
            }
        if (c + 1 < chunks) {
            stage(c + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        proxy_fence();
        __syncthreads();  // chunk c is in buffer c & 1 for every warp
        const u32 buffer = shared_address(xs + (c & 1) * CHUNK);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            u32 a[J][4];
            WgFragments<T>::get(raw[s][0], raw[s][1], (4 * s + t) % T::UNITS, a);
            wg_fence();
#pragma unroll
            for (int j = 0; j < J; ++j) WG<NT>::mma(acc, a[j], wg_desc(buffer + (s * J + j) * NTOK * 32));
            wg_commit();
        }
        wg_wait<0>();
        __syncthreads();  // every warpgroup is done with buffer c & 1 before chunk c + 2 is copied into it
    }
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) {
        keep_reg(acc[i]);
        const int row = m0 + g + 8 * ((i >> 1) & 1), token = tile * NTOK + 8 * (i >> 2) + 2 * t + (i & 1);
        if (row < M && token < N) y[(i64)token * M + row] = acc[i] * xscale[token] + (bias ? bias[row] : 0.0f);
    }
}
