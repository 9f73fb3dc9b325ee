// Products with one of several stacked matrices per row of x, instantiated per GGUF type (the type
// struct T from quants.cuh): the selected experts of a mixture of experts (llama.cpp's mul_mat_id)
// and MLA's per-head products.
//
// W holds E matrices [M, K] one after another (a 3-D GGUF tensor [E, M, K]); pair p of the P pairs
// multiplies matrix e = ids[p] (or p % mod without ids) by x row p / x_div:
//   y[p] = W[e] x[p / x_div]^T (+ bias[e]),  y [P, M], bias [E, M] or null.
// Only the selected matrices are read. Decode-then-FMA in float32 as matmul.cu's gemv.
//
// With GLU, W is the experts' gate and W2 (same type and shape) their up projection, and the output
// is the gated activation of the two products (moe.cu's moe_glu): act 0 silu(g) u, act 1 gpt-oss's
// clamped SwiGLU with `alpha` and `limit`. Without it w2, bias2 and the activation are unused.
#include "quants.cuh"

__device__ __forceinline__ float gated(float g, float u, int act, float alpha, float limit) {
    if (act == 0) return g / (1.0f + expf(-g)) * u;
    const float a = fminf(g, limit), b = fminf(fmaxf(u, -limit), limit);
    return a / (1.0f + expf(-alpha * a)) * (b + 1.0f);
}

// Each warp computes R rows of one pair; grid (P, ceil(M / (4 R))).
template <class T, bool GLU>
__global__ void __launch_bounds__(128) gemv_id(const u8* __restrict__ w, i64 nb, const int* __restrict__ ids, int mod,
                                               const float* __restrict__ x, int x_div, float* __restrict__ y,
                                               const float* __restrict__ bias, int M, int K, const u8* __restrict__ w2,
                                               const float* __restrict__ bias2, int act, float alpha, float limit) {
    constexpr int R = 2, RR = GLU ? 2 * R : R;  // rows R.. are the up projection's
    const int p = blockIdx.x, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.y * 4 + (threadIdx.x >> 5)) * R;
    if (row0 >= M) return;
    const i64 e = ids ? ids[p] : p % mod;
    const int bpr = K / T::BLOCK, upr = bpr * T::UNITS;
    const float* xr = x + (i64)(p / x_div) * K;
    i64 first[R];
#pragma unroll
    for (int r = 0; r < R; ++r) first[r] = (e * M + min(row0 + r, M - 1)) * bpr;
    float acc[RR];
#pragma unroll
    for (int r = 0; r < RR; ++r) acc[r] = 0.0f;
    for (int u = lane; u < upr; u += 32) {
        typename T::Raw raw[RR];
#pragma unroll
        for (int r = 0; r < RR; ++r) raw[r] = T::load(r < R ? w : w2, nb, first[r % R] + u / T::UNITS, u % T::UNITS);
        const int unit = u % T::UNITS;
        const float* xb = xr + (i64)(u / T::UNITS) * T::BLOCK;
#pragma unroll
        for (int r = 0; r < RR; ++r) {
            float v[T::UV];
            T::template decode<false>(raw[r], unit, v);
#pragma unroll
            for (int run = 0; run < T::NR; ++run) {
                const float4* xp = (const float4*)(xb + T::run_offset(unit, run));
#pragma unroll
                for (int q = 0; q < T::RL / 4; ++q) {
                    const float4 xv = __ldg(xp + q);
                    const float* vr = v + run * T::RL + 4 * q;
                    acc[r] = fmaf(vr[0], xv.x, fmaf(vr[1], xv.y, fmaf(vr[2], xv.z, fmaf(vr[3], xv.w, acc[r]))));
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float b = bias && row0 + r < M ? bias[e * M + row0 + r] : 0.0f;
        const float b2 = GLU && bias2 && row0 + r < M ? bias2[e * M + row0 + r] : 0.0f;
        float total = warp_sum(acc[r]) + b;
        if (GLU) total = gated(total, warp_sum(acc[r + R]) + b2, act, alpha, limit);
        if (lane == 0 && row0 + r < M) y[(i64)p * M + row0 + r] = total;
    }
}

// The same products for many tokens, the pairs grouped by matrix (moe.cu's moe_group): block i of
// the first dimension takes chunk c of up to NC consecutive pairs of matrix e, where chunk_start[e]
// <= i < chunk_start[e + 1] and c = i - chunk_start[e] (blocks past chunk_start[E] return), so each
// weight is decoded once per NC pairs instead of once per pair. Pairs of e are order[start[e] ..
// start[e + 1]). Grid (P / NC + E, ceil(M / (4 R))).
template <class T, int NC, bool GLU>
__global__ void __launch_bounds__(128) gemv_grouped(const u8* __restrict__ w, i64 nb, const int* __restrict__ start,
                                                    const int* __restrict__ chunk_start, const int* __restrict__ order,
                                                    int E, const float* __restrict__ x, int x_div,
                                                    float* __restrict__ y, const float* __restrict__ bias, int M, int K,
                                                    const u8* __restrict__ w2, const float* __restrict__ bias2, int act,
                                                    float alpha, float limit) {
    constexpr int R = 2, RR = GLU ? 2 * R : R;
    const int i = blockIdx.x, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.y * 4 + (threadIdx.x >> 5)) * R;
    if (i >= chunk_start[E] || row0 >= M) return;
    int lo = 0, hi = E - 1;  // the last e with chunk_start[e] <= i
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (chunk_start[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    const i64 e = lo;
    const int first = start[e] + (i - chunk_start[e]) * NC, count = min(NC, start[e + 1] - first);
    int pair[NC];
    const float* xr[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        pair[c] = order[first + min(c, count - 1)];
        xr[c] = x + (i64)(pair[c] / x_div) * K;
    }
    const int bpr = K / T::BLOCK, upr = bpr * T::UNITS;
    i64 rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = (e * M + min(row0 + r, M - 1)) * bpr;
    float acc[RR][NC];
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
    for (int u = lane; u < upr; u += 32) {
        const int unit = u % T::UNITS;
        const i64 at = (i64)(u / T::UNITS) * T::BLOCK;
#pragma unroll
        for (int r = 0; r < RR; ++r) {  // one row decoded at a time: the x runs come again from L1
            float v[T::UV];
            T::template decode<false>(T::load(r < R ? w : w2, nb, rows[r % R] + u / T::UNITS, unit), unit, v);
#pragma unroll
            for (int run = 0; run < T::NR; ++run) {
                const int off = T::run_offset(unit, run);
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const float4* xp = (const float4*)(xr[c] + at + off);
#pragma unroll
                    for (int q = 0; q < T::RL / 4; ++q) {
                        const float4 xv = __ldg(xp + q);
                        const float* vr = v + run * T::RL + 4 * q;
                        acc[r][c] = fmaf(vr[0], xv.x, fmaf(vr[1], xv.y, fmaf(vr[2], xv.z, fmaf(vr[3], xv.w, acc[r][c]))));
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float b = bias && row0 + r < M ? bias[e * M + row0 + r] : 0.0f;
        const float b2 = GLU && bias2 && row0 + r < M ? bias2[e * M + row0 + r] : 0.0f;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            float total = warp_sum(acc[r][c]) + b;
            if (GLU) total = gated(total, warp_sum(acc[r + R][c]) + b2, act, alpha, limit);
            if (lane == 0 && c < count && row0 + r < M) y[(i64)pair[c] * M + row0 + r] = total;
        }
    }
}
