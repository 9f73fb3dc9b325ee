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
#include "runs.cuh"
#include "mma.cuh"

__device__ __forceinline__ float gated(float g, float u, int act, float alpha, float limit) {
    if (act == 0) return g / (1.0f + expf(-g)) * u;
    const float a = fminf(g, limit), b = fminf(fmaxf(u, -limit), limit);
    return a / (1.0f + expf(-alpha * a)) * (b + 1.0f);
}

// A warp's R rows of pair p (matrix e): its lanes' sums added, plus the bias, with GLU the gated activation of them
// and the up rows' (acc[R..]), written by lane 0 to y[p, row0 + r].
template <int R, bool GLU>
__device__ __forceinline__ void store_rows(const float (&acc)[GLU ? 2 * R : R], int lane, int row0, int M, i64 e, int p,
                                           float* __restrict__ y, const float* __restrict__ bias,
                                           const float* __restrict__ bias2, int act, float alpha, float limit) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float b = bias && row0 + r < M ? bias[e * M + row0 + r] : 0.0f;
        const float b2 = GLU && bias2 && row0 + r < M ? bias2[e * M + row0 + r] : 0.0f;
        float total = warp_sum(acc[r]) + b;
        if (GLU) total = gated(total, warp_sum(acc[r + R]) + b2, act, alpha, limit);
        if (lane == 0 && row0 + r < M) y[(i64)p * M + row0 + r] = total;
    }
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
    // float rows (8-value blocks: a router's long rows of few experts) keep four units' loads in flight
#pragma unroll(T::BLOCK == 8 ? 4 : 1)
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
    store_rows<R, GLU>(acc, lane, row0, M, e, p, y, bias, bias2, act, alpha, limit);
}

// gemv_id with matmul.cu's gemv_q's integer dot products (T a dot struct: quants.py's Layout.dot_struct), for a
// decode step's few pairs: block (p, b) rounds x's row p / x_div to int16 runs in shared memory (quantize_runs),
// then its 4 warps take R rows of matrix e at a time, row groups b, b + gridDim.y, ... of ceil(M / (4 R)), so x
// is quantized once per block, not once per 4 R rows; each lane issues the loads of U units a row before the dot
// products. GLU as gemv_id.
template <class T, int R, int U, bool GLU>
__global__ void __launch_bounds__(128) gemv_id_q(const u8* __restrict__ w, i64 nb, const int* __restrict__ ids, int mod,
                                                 const float* __restrict__ x, int x_div, float* __restrict__ y,
                                                 const float* __restrict__ bias, int M, int K, const u8* __restrict__ w2,
                                                 const float* __restrict__ bias2, int act, float alpha, float limit) {
    constexpr int RR = GLU ? 2 * R : R;
    extern __shared__ uint4 xsh[];
    const int p = blockIdx.x, lane = threadIdx.x & 31;
    const i64 e = ids ? ids[p] : p % mod;
    const int bpr = K / T::BLOCK, upr = bpr * T::UNITS, lines = (upr + 31) >> 5;
    float unused[1];
    quantize_runs<T, 1, false>(x + (i64)(p / x_div) * K, K, nullptr, xsh, unused);
    __syncthreads();
    const int groups = (M + 4 * R - 1) / (4 * R);
    for (int group = blockIdx.y; group < groups; group += gridDim.y) {
        const int row0 = (group * 4 + (threadIdx.x >> 5)) * R;
        if (row0 >= M) break;  // later groups start further on
        i64 first[R];
#pragma unroll
        for (int r = 0; r < R; ++r) first[r] = (e * M + min(row0 + r, M - 1)) * bpr;
        float acc[RR];
#pragma unroll
        for (int r = 0; r < RR; ++r) acc[r] = 0.0f;
        for (int base = lane; base < upr; base += 32 * U) {
            typename T::Raw raw[U][RR];
            load_units<T, U, RR, R>(raw, w, w2, nb, first, base, upr);
#pragma unroll
            for (int s = 0; s < U; ++s) {
                const int u = base + 32 * s;
                if (u < upr) {
                    u32 xw[T::UV / 2];
                    float xsr[T::NR], xsumr[T::NR];
                    unit_x<T, 1>(xsh, lines, u >> 5, lane, xw, xsr, xsumr);
#pragma unroll
                    for (int r = 0; r < RR; ++r) acc[r] += T::dot(raw[s][r], u % T::UNITS, xw, xsr, xsumr);
                }
            }
        }
        store_rows<R, GLU>(acc, lane, row0, M, e, p, y, bias, bias2, act, alpha, limit);
    }
}

// The matrix of chunk i (moe.cu's moe_group): the last e with chunk_start[e] <= i.
__device__ __forceinline__ int chunk_matrix(const int* __restrict__ chunk_start, int E, int i) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (chunk_start[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
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
    const i64 e = chunk_matrix(chunk_start, E, i);
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

// gemv_grouped's products on tensor cores, for prefill: block (i, y) takes chunk i of up to 8 * NT pairs of one
// matrix e (the grouping of gemv_grouped with NC = 8 * NT) and rows [64 RT y, 64 RT (y + 1)) of it. x comes as f16
// rows with a scale each (ops.cu's x_to_f16: x = xh * xscale); the chunk's pairs' rows are gathered into shared
// memory GROUPED_KC values of K at a time and shared by the 4 warps, each of which owns RT tiles of 16 rows and
// decodes their weights straight into mma.sync A fragments (matmul.cu's gemm_rows, whose weight is one matrix and
// whose tokens are consecutive): each weight of matrix e is decoded once per 8 * NT of its pairs. f16 products,
// float32 sums. With GLU, the same rows of w2 (up) too, and the gated activation of the two is written.
// STAGES 2: x is copied with cp.async into two buffers in turn, the next piece of K while this one is multiplied
// (STAGES 1: copied, then multiplied). Dynamic shared memory: STAGES * 8 NT * (GROUPED_KC + 8) * 2 bytes.
// Grid (P / (8 NT) + E, ceil(M / (64 RT))); K a multiple of T::BLOCK and of 8.
#define GROUPED_KC 256
template <class T, int NT, int RT, bool GLU, int STAGES>
__global__ void __launch_bounds__(128) gemm_grouped(
    const u8* __restrict__ w, i64 nb, const int* __restrict__ start, const int* __restrict__ chunk_start,
    const int* __restrict__ order, int E, const u16* __restrict__ xh, const float* __restrict__ xscale, int x_div,
    float* __restrict__ y, const float* __restrict__ bias, int M, int K, const u8* __restrict__ w2,
    const float* __restrict__ bias2, int act, float alpha, float limit) {
    constexpr int J = T::UV / 4, LD = GROUPED_KC + 8, RS = GLU ? 2 * RT : RT, NC = 8 * NT;
    static_assert(GROUPED_KC % T::BLOCK == 0, "a chunk of K holds whole blocks");
    extern __shared__ uint4 grouped_smem[];  // x: [STAGES][NC][LD] f16
    __shared__ int pairs[NC];                // the chunk's pairs; -1 past its end
    const int i = blockIdx.x;
    if (i >= chunk_start[E]) return;  // the whole block
    const int e = chunk_matrix(chunk_start, E, i);
    const int first = start[e] + (i - chunk_start[e]) * NC, count = min(NC, start[e + 1] - first);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = (blockIdx.y * 4 + warp) * 16 * RT, bpr = K / T::BLOCK;
    for (int c = threadIdx.x; c < NC; c += blockDim.x) pairs[c] = c < count ? order[first + c] : -1;
    i64 wrow[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wrow[rt][h] = ((i64)e * M + min(m0 + 16 * rt + g + 8 * h, M - 1)) * bpr;
    float acc[RS][NT][4];
#pragma unroll
    for (int rs = 0; rs < RS; ++rs)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[rs][nt][c] = 0.0f;
    u16* xs = (u16*)grouped_smem;
    auto stage = [&](int k0, u16* buf) {  // the pairs' x [k0, k0 + GROUPED_KC) into buf, zeros past K and count
        for (int idx = threadIdx.x; idx < NC * (GROUPED_KC / 8); idx += blockDim.x) {
            const int tok = idx / (GROUPED_KC / 8), c = idx % (GROUPED_KC / 8), p = pairs[tok];
            const bool real = p >= 0 && k0 + 8 * c < K;
            cp_async16(buf + tok * LD + 8 * c, real ? xh + (i64)(p / x_div) * K + k0 + 8 * c : xh, real ? 16 : 0);
        }
        cp_async_commit();
    };
    __syncthreads();  // `pairs` written
    if (STAGES == 2) stage(0, xs);
    for (int k0 = 0, b = 0; k0 < K; k0 += GROUPED_KC, b = STAGES == 2 ? b ^ 1 : 0) {
        if (STAGES == 1) {
            stage(k0, xs);
            cp_async_wait<0>();
        } else if (k0 + GROUPED_KC < K) {
            stage(k0 + GROUPED_KC, xs + (b ^ 1) * NC * LD);  // the buffer the last piece was multiplied from
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this piece of x is in
        const u16* xb = xs + b * NC * LD;
        const int units = min(GROUPED_KC, K - k0) / T::BLOCK * T::UNITS;
        if (m0 < M) {  // a warp past the matrix's rows still meets the block's barriers
#pragma unroll 2
            for (int s = 0; 4 * s < units; ++s) {
                const int u = 4 * s + t, uc = min(u, units - 1);  // a piece's last step may run past its units
                const int blk = k0 / T::BLOCK + uc / T::UNITS, unit = uc % T::UNITS;
                typename T::Raw raw[RS][2];
#pragma unroll
                for (int rs = 0; rs < RS; ++rs)
#pragma unroll
                    for (int h = 0; h < 2; ++h) raw[rs][h] = T::load(rs < RT ? w : w2, nb, wrow[rs % RT][h] + blk, unit);
                u32 a[RS][J][4];
#pragma unroll
                for (int rs = 0; rs < RS; ++rs) unit_fragments<T>(raw[rs][0], raw[rs][1], unit, u < units ? 1.0f : 0.0f, a[rs]);
                const int base = (uc / T::UNITS) * T::BLOCK;  // the unit's block, from the piece's start
#pragma unroll
                for (int j = 0; j < J; ++j) {
                    const int at = base + T::run_offset(unit, 4 * j / T::RL) + (4 * j) % T::RL;
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const uint2 bf = *(const uint2*)&xb[(8 * nt + g) * LD + at];
#pragma unroll
                        for (int rs = 0; rs < RS; ++rs) mma_f16(acc[rs][nt], a[rs][j], bf.x, bf.y);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with buffer b before it is filled again
    }
    if (m0 >= M) return;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = m0 + 16 * rt + g + 8 * (c >> 1), p = pairs[8 * nt + 2 * t + (c & 1)];
                if (row >= M || p < 0) continue;
                const float s = xscale[p / x_div];
                float total = acc[rt][nt][c] * s + (bias ? bias[(i64)e * M + row] : 0.0f);
                if (GLU) total = gated(total, acc[rt + RT][nt][c] * s + (bias2 ? bias2[(i64)e * M + row] : 0.0f), act, alpha, limit);
                y[(i64)p * M + row] = total;
            }
}
