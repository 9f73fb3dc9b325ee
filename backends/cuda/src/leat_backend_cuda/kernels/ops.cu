// Activation ops: norms, RoPE, the KV cache and attention, elementwise, gathers. float32
// activations; the KV cache in float32, f16 or q8_0 (KV = float, u16 or i8).
#include "kv.cuh"

// 1 / sqrt(mean(x^2) + eps) of one row, every thread of the block taking every blockDim-th value. The loads
// are unrolled so that several are in flight at once (a row is short: latency, not bandwidth, bounds it).
__device__ __forceinline__ float rms_factor(const float* __restrict__ xr, int cols, float eps) {
    float ss = 0.0f;
#pragma unroll 4
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
    return 1.0f / sqrtf(block_sum(ss) / cols + eps);
}

// A row held in registers for the norms of one block per row: thread i's values c = i + j * blockDim.x (j <
// ROW_VALUES; zero past the row), loaded at once, so the row is read from memory once, not once per pass. Rows
// longer than ROW_VALUES * blockDim.x take the loops of rms_factor instead.
#define ROW_VALUES 32
__device__ __forceinline__ bool row_fits(int cols) { return cols <= ROW_VALUES * (int)blockDim.x; }
__device__ __forceinline__ void load_row(const float* __restrict__ r, int cols, float (&v)[ROW_VALUES]) {
#pragma unroll
    for (int j = 0; j < ROW_VALUES; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        v[j] = c < cols ? r[c] : 0.0f;
    }
}
// rms_factor of a row in registers, its squares summed in rms_factor's order (the same bits)
__device__ __forceinline__ float rms_factor_of(const float (&v)[ROW_VALUES], int cols, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < ROW_VALUES; ++j)
        if (threadIdx.x + j * blockDim.x < cols) ss = fmaf(v[j], v[j], ss);
    return 1.0f / sqrtf(block_sum(ss) / cols + eps);
}

// y = x / sqrt(mean(x^2) + eps) * w over rows of `cols` (w null: no scale). One block per row.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                    int cols, float eps) {
    const float* xr = x + (i64)blockIdx.x * cols;
    float* yr = y + (i64)blockIdx.x * cols;
    if (row_fits(cols)) {
        float v[ROW_VALUES], wv[ROW_VALUES];
        load_row(xr, cols, v);
        if (w) load_row(w, cols, wv);  // in flight during the sum
        const float r = rms_factor_of(v, cols, eps);
#pragma unroll
        for (int j = 0; j < ROW_VALUES; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            if (c < cols) yr[c] = w ? v[j] * r * wv[j] : v[j] * r;
        }
        return;
    }
    const float r = rms_factor(xr, cols, eps);
#pragma unroll 4
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = w ? xr[c] * r * w[c] : xr[c] * r;
}

// The power of two a row of largest magnitude `mx` is scaled by on its way to f16: none where mx is in
// [2^-6, 2^15) (no overflow; elements below f16's normal range, 2^-14, are under 2^-8 of the largest and keep
// f16's absolute precision, 2^-25), else the one that puts mx in [2^14, 2^15). Rows left as they are (scale 1)
// need no epilogue after cuBLAS (scale_rows_bias skips them).
__device__ __forceinline__ int f16_shift(float mx) {
    const int e = binade(mx);
    return (e >= -5 && e <= 15) ? 0 : 15 - e;
}

// rms_norm's output as x_to_f16 would make it from the float32 row (the same values, scaled by the same
// power of two, f16_shift), without the float32 row: the norm of a product's input, fused into its f16 rows.
extern "C" __global__ void rms_norm_f16(const float* __restrict__ x, const float* __restrict__ w,
                                        u16* __restrict__ xh, float* __restrict__ xscale, int cols, float eps) {
    const float* xr = x + (i64)blockIdx.x * cols;
    u32* hr = (u32*)(xh + (i64)blockIdx.x * cols);
    float r, mx = 0.0f;
    if (row_fits(cols)) {  // the sum and the largest value from registers; the f16 pairs read the row again (L1)
        float v[ROW_VALUES], wv[ROW_VALUES];
        load_row(xr, cols, v);
        if (w) load_row(w, cols, wv);
        r = rms_factor_of(v, cols, eps);
#pragma unroll
        for (int j = 0; j < ROW_VALUES; ++j)
            if (threadIdx.x + j * blockDim.x < cols) mx = fmaxf(mx, fabsf(w ? v[j] * r * wv[j] : v[j] * r));
    } else {
        r = rms_factor(xr, cols, eps);
#pragma unroll 4
        for (int c = threadIdx.x; c < cols; c += blockDim.x) mx = fmaxf(mx, fabsf(w ? xr[c] * r * w[c] : xr[c] * r));
    }
    const int shift = f16_shift(block_max(mx));
    const float f = ldexpf(1.0f, shift);
#pragma unroll 4
    for (int c = threadIdx.x; c < cols / 2; c += blockDim.x) {
        const float a = w ? xr[2 * c] * r * w[2 * c] : xr[2 * c] * r;
        const float b = w ? xr[2 * c + 1] * r * w[2 * c + 1] : xr[2 * c + 1] * r;
        hr[c] = pack_f16x2(a * f, b * f);
    }
    if (threadIdx.x == 0) xscale[blockIdx.x] = ldexpf(1.0f, -shift);
}

// RoPE of one head (block), read through `in(c)`: pair i < dims/2 is (i, i + dims/2) with neox, else (2i, 2i+1),
// rotated by angle pos * inv_freq[i] (inv_freq from the host in float64, position scaling and frequency factors
// folded in), cos and sin times `magnitude` (RopeSpec.attn_factor). Angles and their sines are computed in
// float64, as the oracle does; elements past `dims` are copied.
template <typename In>
__device__ __forceinline__ void rope_head(In in, float* __restrict__ yr, double p, const double* __restrict__ inv_freq,
                                          int head_dim, int dims, int neox, float magnitude) {
    const int half = dims / 2;
    for (int i = threadIdx.x; i < head_dim / 2; i += blockDim.x) {
        if (i < half) {
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            rope_pair(in(a), in(b), p * inv_freq[i], magnitude, yr[a], yr[b]);
        } else {
            yr[2 * i] = in(2 * i);
            yr[2 * i + 1] = in(2 * i + 1);
        }
    }
    if ((head_dim & 1) && threadIdx.x == 0) yr[head_dim - 1] = in(head_dim - 1);
}

// RoPE on x [n, heads, head_dim] (rope_head); one block per (token, head).
extern "C" __global__ void rope(const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ pos,
                                const double* __restrict__ inv_freq, int heads, int head_dim, int dims, int neox,
                                float magnitude) {
    const float* xr = x + (i64)blockIdx.x * head_dim;
    rope_head([=](int c) { return xr[c]; }, y + (i64)blockIdx.x * head_dim, (double)pos[blockIdx.x / heads], inv_freq,
              head_dim, dims, neox, magnitude);
}

// rope of rms_norm(x, w) over each head (the q and k norms ahead of RoPE that Qwen3 and Gemma have): one kernel
// instead of two, with the same values as rms_norm then rope when launched with as many threads as rms_norm
// would be (its factor reduced in the same order; each normed element computed as rms_norm computes it).
extern "C" __global__ void rope_norm(const float* __restrict__ x, const float* __restrict__ w, float eps,
                                     float* __restrict__ y, const int* __restrict__ pos,
                                     const double* __restrict__ inv_freq, int heads, int head_dim, int dims, int neox,
                                     float magnitude) {
    const float* xr = x + (i64)blockIdx.x * head_dim;
    const float r = rms_factor(xr, head_dim, eps);
    rope_head([=](int c) { return w ? xr[c] * r * w[c] : xr[c] * r; }, y + (i64)blockIdx.x * head_dim,
              (double)pos[blockIdx.x / heads], inv_freq, head_dim, dims, neox, magnitude);
}

// ---------------------------------------------------------------------------------------------
// Paged KV cache: per layer K [pages, page_size, kv_heads, dk] and V [..., dv]. Position p of slot
// s lives in page page_table[s * pages_per_slot + p / page_size] at offset p % page_size. Tokens
// carry their slot and position; slot -1 marks a padding token (a replayed graph's spare rows),
// which neither writes the cache nor attends.

template <typename KV>
__global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v, KV* __restrict__ kc,
                         KV* __restrict__ vc, u16* __restrict__ ks, u16* __restrict__ vs,
                         const int* __restrict__ page_table, const int* __restrict__ tok_slot,
                         const int* __restrict__ tok_pos, int kv_heads, int dk, int dv, int pages_per_slot,
                         int page_size) {
    const int t = blockIdx.x, slot = tok_slot[t], pos = tok_pos[t];
    if (slot < 0) return;
    const int page = page_table[(i64)slot * pages_per_slot + pos / page_size];
    if (page < 0) return;
    const i64 row = ((i64)page * page_size + pos % page_size) * kv_heads;  // the token's heads are consecutive rows
    const float *kt = k + (i64)t * kv_heads * dk, *vt = v + (i64)t * kv_heads * dv;
    kv_put(kc, ks, row * dk, kv_heads * dk, [=](int i) { return kt[i]; });
    kv_put(vc, vs, row * dv, kv_heads * dv, [=](int i) { return vt[i]; });
}

// rope of q, rope of k and kv_write in one launch, with the values of the three kernels bit for bit: per token,
// blocks 0 .. heads - 1 rotate a q head into qy (rope; with NORM, rope_norm with the weights qw, eps qe), and blocks
// heads .. heads + kv_heads - 1 rotate a k head (kw, ke) into shared memory (head_dim <= 512) and store it and the
// head's v row into the token's cache row. Launched with rope_norm's threads (its factor is reduced in that order);
// rope's and kv_write's values do not depend on the block's size.
template <typename KV, bool NORM>
__global__ void rope_kv_write(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                              const float* __restrict__ qw, const float* __restrict__ kw, float qe, float ke,
                              float* __restrict__ qy, KV* __restrict__ kc, KV* __restrict__ vc, u16* __restrict__ ks,
                              u16* __restrict__ vs, const int* __restrict__ page_table,
                              const int* __restrict__ tok_slot, const int* __restrict__ tok_pos,
                              const int* __restrict__ rope_pos, const double* __restrict__ inv_freq, int heads,
                              int kv_heads, int head_dim, int dv, int dims, int neox, float magnitude,
                              int pages_per_slot, int page_size) {
    __shared__ float rotated[512];  // the k head
    const int t = blockIdx.x / (heads + kv_heads), h = blockIdx.x % (heads + kv_heads);
    const bool is_q = h < heads;
    const float* xr = is_q ? q + ((i64)t * heads + h) * head_dim : k + ((i64)t * kv_heads + h - heads) * head_dim;
    const float* w = is_q ? qw : kw;
    const float r = NORM ? rms_factor(xr, head_dim, is_q ? qe : ke) : 1.0f;
    float* yr = is_q ? qy + ((i64)t * heads + h) * head_dim : rotated;
    const double p = (double)rope_pos[t];
    if (NORM)
        rope_head([=](int c) { return w ? xr[c] * r * w[c] : xr[c] * r; }, yr, p, inv_freq, head_dim, dims, neox,
                  magnitude);
    else
        rope_head([=](int c) { return xr[c]; }, yr, p, inv_freq, head_dim, dims, neox, magnitude);
    if (is_q) return;  // block-uniform
    __syncthreads();
    const int slot = tok_slot[t], pos = tok_pos[t];
    if (slot < 0) return;
    const int page = page_table[(i64)slot * pages_per_slot + pos / page_size];
    if (page < 0) return;
    const int kvh = h - heads;
    const i64 row = ((i64)page * page_size + pos % page_size) * kv_heads + kvh;
    const float* vt = v + ((i64)t * kv_heads + kvh) * dv;
    kv_put(kc, ks, row * head_dim, head_dim, [=](int i) { return rotated[i]; });
    kv_put(vc, vs, row * dv, dv, [=](int i) { return vt[i]; });
}

// Causal (optionally windowed, soft-capped) attention of each token's query heads over its slot's
// cached positions, grouped-query: a block serves one token, one KV head and up to GB of the query
// heads that share it, over split z of the token's own range (grid.z = splits; kv.cuh's token_range:
// equal parts, rounded up to a multiple of `keys`).
// Its 4 warps take turns over runs of 8 positions; a lane holds dims lane, lane + 32, ... (DL of them) of q,
// k, v and the output; online softmax per head in float32. With one split the normalized output
// is written; with several, (max, sum) and the unnormalized sums go to `part_*` for
// attention_combine.
template <typename KV, int DL, int GB>
__global__ void __launch_bounds__(128) attention(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc, const u16* __restrict__ ks,
    const u16* __restrict__ vs, const int* __restrict__ page_table,
    const int* __restrict__ tok_slot, const int* __restrict__ tok_pos, float* __restrict__ out,
    float* __restrict__ part_ml, float* __restrict__ part_acc, int heads, int kv_heads, int dk, int dv,
    int pages_per_slot, int page_size, int window, int keys, float scale, float softcap,
    const float* __restrict__ sinks) {
    const int t = blockIdx.x, kvh = blockIdx.y % kv_heads, g0 = (blockIdx.y / kv_heads) * GB;
    const int z = blockIdx.z, nsplit = gridDim.z, group = heads / kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int begin, end;
    const int* table = token_range(tok_slot, tok_pos, page_table, pages_per_slot, window, keys, begin, end);

    float qv[GB][DL], m[GB], l[GB], acc[GB][DL];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        const i64 h = (i64)kvh * group + g0 + g;
#pragma unroll
        for (int i = 0; i < DL; ++i) {
            const int d = lane + 32 * i;
            qv[g][i] = (g0 + g < group && d < dk) ? q[((i64)t * heads + h) * dk + d] * scale : 0.0f;
            acc[g][i] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    // Each warp takes KB consecutive keys per step (positions begin + 4 * KB * step + KB * warp + j),
    // loading all of them before any arithmetic so their latencies overlap.
    constexpr int KB = 8;
    for (int p0 = begin + KB * warp; p0 < end; p0 += 4 * KB) {
        float kd[KB][DL], vd[KB][DL];
#pragma unroll
        for (int j = 0; j < KB; ++j) {
            const int p = min(p0 + j, end - 1);
            const i64 row = ((i64)table[p / page_size] * page_size + p % page_size) * kv_heads + kvh;
#pragma unroll
            for (int i = 0; i < DL; ++i) {
                const int d = lane + 32 * i;
                kd[j][i] = d < dk ? kv_load(kc, ks, row, dk, d) : 0.0f;
                vd[j][i] = d < dv ? kv_load(vc, vs, row, dv, d) : 0.0f;
            }
        }
        // the KB x GB scores' warp sums are independent: one butterfly for all of them, then one online-softmax
        // update a head for the KB keys (not KB updates one after another)
        float s[KB][GB];
#pragma unroll
        for (int j = 0; j < KB; ++j) {
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                s[j][g] = 0.0f;
#pragma unroll
                for (int i = 0; i < DL; ++i) s[j][g] = fmaf(qv[g][i], kd[j][i], s[j][g]);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int j = 0; j < KB; ++j) {
#pragma unroll
                for (int g = 0; g < GB; ++g) s[j][g] += __shfl_xor_sync(FULL_MASK, s[j][g], o);
            }
        }
#pragma unroll
        for (int g = 0; g < GB; ++g) {
            float mn = m[g];
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                if (softcap > 0.0f) s[j][g] = softcap * tanhf(s[j][g] / softcap);
                if (p0 + j < end) mn = fmaxf(mn, s[j][g]);
            }
            const float corr = expf(m[g] - mn);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                s[j][g] = p0 + j < end ? expf(s[j][g] - mn) : 0.0f;
                sum += s[j][g];
            }
            l[g] = l[g] * corr + sum;
#pragma unroll
            for (int i = 0; i < DL; ++i) {
                float a = acc[g][i] * corr;
#pragma unroll
                for (int j = 0; j < KB; ++j) a = fmaf(s[j][g], vd[j][i], a);
                acc[g][i] = a;
            }
            m[g] = mn;
        }
    }
    attention_store<GB, DL>(m, l, acc, min(GB, group - g0), (i64)t * heads + (i64)kvh * group + g0, heads, dv, z,
                            nsplit, sinks, out, part_ml, part_acc);
}


// The same attention with one key per lane: each warp takes 32 consecutive keys at a time, every
// lane computing its key's full dot products with the GB query heads (q in shared memory), then a
// warp-wide online-softmax update, then the weighted sum of the 32 value rows with each lane
// holding dims lane, lane + 32, ... of the output. No reduction per key: many independent loads and
// FMAs in flight (the per-key warp reductions of `attention` leave it waiting on latency when the
// keys are many, as in a prefill).
template <typename KV, int DL, int GB>
__global__ void __launch_bounds__(128) attention_wide(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc, const u16* __restrict__ ks,
    const u16* __restrict__ vs, const int* __restrict__ page_table,
    const int* __restrict__ tok_slot, const int* __restrict__ tok_pos, float* __restrict__ out,
    float* __restrict__ part_ml, float* __restrict__ part_acc, int heads, int kv_heads, int dk, int dv,
    int pages_per_slot, int page_size, int window, int split, float scale, float softcap,
    const float* __restrict__ sinks) {
    __shared__ __align__(16) float sq[GB][DL * 32];
    const int t = blockIdx.x, kvh = blockIdx.y % kv_heads, g0 = (blockIdx.y / kv_heads) * GB;
    const int z = blockIdx.z, nsplit = gridDim.z, group = heads / kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slot = tok_slot[t], pos = tok_pos[t];
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int begin = max(lo, z * split), end = slot < 0 ? 0 : min(pos + 1, (z + 1) * split);
    for (int idx = threadIdx.x; idx < GB * DL * 32; idx += blockDim.x) {
        const int g = idx / (DL * 32), d = idx % (DL * 32);
        sq[g][d] = (g0 + g < group && d < dk) ? q[((i64)t * heads + (i64)kvh * group + g0 + g) * dk + d] * scale : 0.0f;
    }
    __syncthreads();
    float m[GB], l[GB], acc[GB][DL];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < DL; ++i) acc[g][i] = 0.0f;
    }
    const int* table = page_table + (i64)max(slot, 0) * pages_per_slot;
    for (int p0 = begin + 32 * warp; p0 < end; p0 += 128) {
        const int p = min(p0 + lane, end - 1);
        const i64 row = ((i64)table[p / page_size] * page_size + p % page_size) * kv_heads + kvh;
        float s[GB];
#pragma unroll
        for (int g = 0; g < GB; ++g) s[g] = 0.0f;
        for (int d = 0; d < dk; d += 8) {  // dk is a multiple of 8 (of 32 for q8_0)
            float k8[8];
            kv_load8(kc, ks, row, dk, d, k8);
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                const float4 qa = *(const float4*)&sq[g][d], qb = *(const float4*)&sq[g][d + 4];
                s[g] = fmaf(qa.x, k8[0], fmaf(qa.y, k8[1], fmaf(qa.z, k8[2], fmaf(qa.w, k8[3], s[g]))));
                s[g] = fmaf(qb.x, k8[4], fmaf(qb.y, k8[5], fmaf(qb.z, k8[6], fmaf(qb.w, k8[7], s[g]))));
            }
        }
        const bool valid = p0 + lane < end;
#pragma unroll
        for (int g = 0; g < GB; ++g) {
            if (softcap > 0.0f) s[g] = softcap * tanhf(s[g] / softcap);
            const float mn = fmaxf(m[g], warp_max(valid ? s[g] : NEG_INF)), corr = expf(m[g] - mn);
            s[g] = valid ? expf(s[g] - mn) : 0.0f;
            l[g] = l[g] * corr + warp_sum(s[g]);
            m[g] = mn;
#pragma unroll
            for (int i = 0; i < DL; ++i) acc[g][i] *= corr;
        }
        const int count = min(32, end - p0);
        for (int j = 0; j < count; ++j) {
            const i64 rj = ((i64)__shfl_sync(FULL_MASK, (int)(row >> 32), j) << 32) | (u32)__shfl_sync(FULL_MASK, (int)row, j);
            float vd[DL];
#pragma unroll
            for (int i = 0; i < DL; ++i) {
                const int d = lane + 32 * i;
                vd[i] = d < dv ? kv_load(vc, vs, rj, dv, d) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                const float pj = __shfl_sync(FULL_MASK, s[g], j);
#pragma unroll
                for (int i = 0; i < DL; ++i) acc[g][i] = fmaf(pj, vd[i], acc[g][i]);
            }
        }
    }
    attention_store<GB, DL>(m, l, acc, min(GB, group - g0), (i64)t * heads + (i64)kvh * group + g0, heads, dv, z,
                            nsplit, sinks, out, part_ml, part_acc);
}

// Merges the splits of attention: block (th, c) serves (token, head) th and its value dims from c * blockDim.x, on by
// gridDim.y * blockDim.x; `sinks` (or null) as in attention. The splits' largest max and weights exp(m_z - max) are
// worked out once a block, a thread a split, into shared memory; then each thread's sums over the splits, in order,
// with COMBINE_AHEAD of its loads in flight at a time (one split after another, a long cache's merge was a chain of
// nsplit load latencies: 60 us a layer at 64 splits). The values are the one-split-at-a-time merge's.
#define COMBINE_MAX_SPLITS 1024
#define COMBINE_AHEAD 16
extern "C" __global__ void __launch_bounds__(256) attention_combine(const float* __restrict__ part_ml,
                                                                    const float* __restrict__ part_acc,
                                                                    float* __restrict__ out, int nsplit, int dv,
                                                                    const float* __restrict__ sinks, int heads) {
    __shared__ float weight[COMBINE_MAX_SPLITS], total[COMBINE_MAX_SPLITS];
    const i64 th = blockIdx.x;
    const float* ml = part_ml + th * nsplit * 2;
    float top = NEG_INF;
    for (int z = threadIdx.x; z < nsplit; z += blockDim.x) top = fmaxf(top, ml[2 * z]);
    const float mx = block_max(top);
    for (int z = threadIdx.x; z < nsplit; z += blockDim.x) {
        total[z] = ml[2 * z + 1];  // a split with no keys has sum 0 and takes no part
        weight[z] = total[z] > 0.0f ? expf(ml[2 * z] - mx) : 0.0f;
    }
    __syncthreads();
    const float* acc = part_acc + th * nsplit * dv;
    for (int d = blockIdx.y * blockDim.x + threadIdx.x; d < dv; d += gridDim.y * blockDim.x) {
        float sum = 0.0f, a = 0.0f;
        for (int z0 = 0; z0 < nsplit; z0 += COMBINE_AHEAD) {
            float v[COMBINE_AHEAD];
#pragma unroll
            for (int j = 0; j < COMBINE_AHEAD; ++j) v[j] = z0 + j < nsplit ? acc[(i64)(z0 + j) * dv + d] : 0.0f;
#pragma unroll
            for (int j = 0; j < COMBINE_AHEAD; ++j) {
                if (z0 + j < nsplit && total[z0 + j] > 0.0f) {
                    sum += total[z0 + j] * weight[z0 + j];
                    a += v[j] * weight[z0 + j];
                }
            }
        }
        if (sinks) sink_join(sinks[th % heads], mx, sum, a);
        out[th * dv + d] = sum > 0.0f ? a / sum : 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// Elementwise, over n values.

#define ELEMENTWISE(name, params, expr)                                                           \
    extern "C" __global__ void name params {                                                      \
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) \
            y[i] = expr;                                                                          \
    }

ELEMENTWISE(silu_mul, (const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y, i64 n),
            g[i] / (1.0f + expf(-g[i])) * u[i])
ELEMENTWISE(add, (const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y, i64 n), a[i] + b[i])
ELEMENTWISE(scale, (const float* __restrict__ x, float f, float* __restrict__ y, i64 n), x[i] * f)
ELEMENTWISE(softcap, (const float* __restrict__ x, float cap, float* __restrict__ y, i64 n), cap * tanhf(x[i] / cap))
// ggml's tanh approximation of gelu, times up.
ELEMENTWISE(gelu_mul, (const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y, i64 n),
            0.5f * g[i] * (1.0f + tanhf(0.7978845608028654f * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i])

// y = the sum of S partial results part[z] (split-K GEMMs).
// The index of each row's largest value, the first of equals (numpy's argmax): one block per row, up to 1,024
// threads. A row is a vocabulary (128k floats for Llama 3) read by one multiprocessor, so each warp keeps several
// loads in flight (the loop unrolled; a load does not wait for the comparison before it).
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int* __restrict__ out, int cols) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* xr = x + (i64)blockIdx.x * cols;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float v = NEG_INF;
    int at = cols;
#pragma unroll 8
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float y = xr[c];
        if (y > v) v = y, at = c;
    }
    auto reduce = [&]() {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, v, o);
            const int oi = __shfl_xor_sync(FULL_MASK, at, o);
            if (ov > v || (ov == v && oi < at)) v = ov, at = oi;
        }
    };
    reduce();
    if (lane == 0) best_v[warp] = v, best_i[warp] = at;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? best_v[lane] : NEG_INF;
        at = lane < (int)(blockDim.x >> 5) ? best_i[lane] : cols;
        reduce();
        if (lane == 0) out[blockIdx.x] = at < cols ? at : 0;
    }
}

// Order of top_k_rows: a larger value first, of equal values the lower index (numpy's stable argsort of -x).
// NaN is never better than anything, so it is never chosen.
__device__ __forceinline__ bool topk_better(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}

// The k (<= 64) largest values of each row of x [rows, cols] and their indices, best first (ties: lower
// index first; -inf entries rank by index like any other value): one block of 1024 threads per row.
// Each pass over the row, every thread keeps its own TOPK_T best entries that come after the last one
// chosen (in registers, sorted), then the block draws the next TOPK_T of the row from those lists, one
// block-wide arg-best at a time: any of the row's next TOPK_T is among its thread's TOPK_T. So k needs
// ceil(k / TOPK_T) passes over the row.
#define TOPK_T 8
extern "C" __global__ void __launch_bounds__(1024) top_k_rows(const float* __restrict__ x, float* __restrict__ values,
                                                              int* __restrict__ ids, int cols, int k) {
    __shared__ float warp_v[32];
    __shared__ int warp_i[32];
    __shared__ float chosen_v;
    __shared__ int chosen_i;
    const float* xr = x + (i64)blockIdx.x * cols;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float last_v = __int_as_float(0x7f800000u);  // +inf at index -1: everything comes after it
    int last_i = -1;
    for (int done = 0; done < k;) {
        float lv[TOPK_T];
        int li[TOPK_T];
#pragma unroll
        for (int j = 0; j < TOPK_T; ++j) lv[j] = NEG_INF, li[j] = cols;  // empty: after every real entry
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = xr[c];
            if (topk_better(last_v, last_i, v, c) && topk_better(v, c, lv[TOPK_T - 1], li[TOPK_T - 1])) {
                lv[TOPK_T - 1] = v, li[TOPK_T - 1] = c;
#pragma unroll
                for (int j = TOPK_T - 1; j > 0; --j) {
                    if (topk_better(lv[j], li[j], lv[j - 1], li[j - 1])) {
                        const float tv = lv[j];
                        const int ti = li[j];
                        lv[j] = lv[j - 1], li[j] = li[j - 1], lv[j - 1] = tv, li[j - 1] = ti;
                    }
                }
            }
        }
        for (int r = 0; r < TOPK_T && done < k; ++r, ++done) {
            float v = lv[0];
            int at = li[0];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL_MASK, v, o);
                const int oi = __shfl_xor_sync(FULL_MASK, at, o);
                if (topk_better(ov, oi, v, at)) v = ov, at = oi;
            }
            if (lane == 0) warp_v[warp] = v, warp_i[warp] = at;
            __syncthreads();
            if (warp == 0) {
                v = lane < warps ? warp_v[lane] : NEG_INF;
                at = lane < warps ? warp_i[lane] : cols;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const float ov = __shfl_xor_sync(FULL_MASK, v, o);
                    const int oi = __shfl_xor_sync(FULL_MASK, at, o);
                    if (topk_better(ov, oi, v, at)) v = ov, at = oi;
                }
                if (lane == 0) {
                    chosen_v = v, chosen_i = at;
                    values[(i64)blockIdx.x * k + done] = v;
                    ids[(i64)blockIdx.x * k + done] = at;
                }
            }
            __syncthreads();
            if (li[0] == chosen_i && chosen_i < cols) {  // this thread's head was chosen: drop it
#pragma unroll
                for (int j = 0; j < TOPK_T - 1; ++j) lv[j] = lv[j + 1], li[j] = li[j + 1];
                lv[TOPK_T - 1] = NEG_INF, li[TOPK_T - 1] = cols;
            }
            last_v = chosen_v, last_i = chosen_i;
            __syncthreads();  // chosen_* are written again next round
        }
    }
}

extern "C" __global__ void splitk_sum(const float* __restrict__ part, float* __restrict__ y, i64 n, int S) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float s = part[i];
        for (int z = 1; z < S; ++z) s += part[z * n + i];
        y[i] = s;
    }
}

// y[r] = x[index[r]] for rows of `cols` values; one block per output row.
extern "C" __global__ void take_rows(const float* __restrict__ x, const int* __restrict__ index, float* __restrict__ y,
                                     int cols) {
    const float* src = x + (i64)index[blockIdx.x] * cols;
    float* dst = y + (i64)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

// Rows of x [n, cols] as f16 for the tensor-core GEMM, each scaled by a power of two (f16_shift): no f16
// overflow, and small rows keep their precision. `xscale` gets the inverse factor. One block per row.
extern "C" __global__ void x_to_f16(const float* __restrict__ x, u16* __restrict__ xh, float* __restrict__ xscale,
                                    int cols) {
    // rows of a GEMM's input (cols a multiple of 8): 16-byte loads, 8-byte stores; a row of up to
    // 16 * blockDim.x quads is held in registers (read once), a longer one read again from L1/L2
    constexpr int QUADS = 16;
    const float4* xr = (const float4*)(x + (i64)blockIdx.x * cols);
    uint2* hr = (uint2*)(xh + (i64)blockIdx.x * cols);
    const int quads = cols / 4;
    const bool fits = quads <= QUADS * (int)blockDim.x;
    float4 v[QUADS];
    float mx = 0.0f;
    if (fits) {
#pragma unroll
        for (int j = 0; j < QUADS; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            v[j] = c < quads ? xr[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < QUADS; ++j)
            mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v[j].x), fabsf(v[j].y)), fmaxf(fabsf(v[j].z), fabsf(v[j].w))));
    } else {
#pragma unroll 4
        for (int c = threadIdx.x; c < quads; c += blockDim.x) {
            const float4 q = xr[c];
            mx = fmaxf(mx, fmaxf(fmaxf(fabsf(q.x), fabsf(q.y)), fmaxf(fabsf(q.z), fabsf(q.w))));
        }
    }
    const int shift = f16_shift(block_max(mx));
    const float f = ldexpf(1.0f, shift);
    if (fits) {
#pragma unroll
        for (int j = 0; j < QUADS; ++j) {
            const int c = threadIdx.x + j * blockDim.x;
            if (c < quads) hr[c] = make_uint2(pack_f16x2(v[j].x * f, v[j].y * f), pack_f16x2(v[j].z * f, v[j].w * f));
        }
    } else {
#pragma unroll 4
        for (int c = threadIdx.x; c < quads; c += blockDim.x) {
            const float4 q = xr[c];
            hr[c] = make_uint2(pack_f16x2(q.x * f, q.y * f), pack_f16x2(q.z * f, q.w * f));
        }
    }
    if (threadIdx.x == 0) xscale[blockIdx.x] = ldexpf(1.0f, -shift);
}

// One plane of a quantized tensor's device layout (quants.device_bytes): bytes [offset, offset + size)
// of each of the `blocks` GGUF blocks of `src` (block_bytes each), one block after another in `dst`.
// The file's bytes go to the device as they are and are rearranged here, not on the host.
extern "C" __global__ void split_plane(const u8* __restrict__ src, u8* __restrict__ dst, i64 blocks, int block_bytes,
                                       int offset, int size) {
    const i64 total = blocks * size;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 b = i / size;
        dst[i] = src[b * block_bytes + offset + (i - b * size)];
    }
}

// flash.cu's tiles of a step's tokens, made on the device (a captured graph's prefill: the eager path makes them on
// the host, backend._flash_tiles). A run is consecutive tokens of one slot at consecutive positions (a batch row; a
// padding token, slot -1, is in none); a tile is up to `tile` tokens of a run, cut from the run's first token on.
// tiles[2i] is tile i's first token and tiles[2i + 1] its count, in token order; the entries past the last tile up to
// `capacity` get count 0 (flash_attention's blocks for them return at once). One block of FLASH_TILES_THREADS
// threads, n <= FLASH_TILES_THREADS; `capacity` at least the tiles there are (the caller's bound: n / tile + rows).
#define FLASH_TILES_THREADS 1024
extern "C" __global__ void __launch_bounds__(FLASH_TILES_THREADS)
    flash_tiles(const int* __restrict__ tok_slot, const int* __restrict__ tok_pos, int* __restrict__ tiles, int n,
                int tile, int capacity) {
    __shared__ int scan[FLASH_TILES_THREADS];
    const int i = threadIdx.x, slot = i < n ? tok_slot[i] : -1;
    const bool starts = slot >= 0 && (i == 0 || tok_slot[i - 1] != slot || tok_pos[i - 1] + 1 != tok_pos[i]);
    scan[i] = starts ? i : -1;  // the run's first token: an inclusive max-scan of the run starts
    __syncthreads();
    for (int d = 1; d < FLASH_TILES_THREADS; d <<= 1) {
        const int other = i >= d ? scan[i - d] : -1;
        __syncthreads();
        scan[i] = max(scan[i], other);
        __syncthreads();
    }
    const int run = scan[i];
    const bool first = slot >= 0 && (i - run) % tile == 0;
    __syncthreads();
    scan[i] = first ? 1 : 0;  // the tile's index: an inclusive sum-scan of the tile starts, less one
    __syncthreads();
    for (int d = 1; d < FLASH_TILES_THREADS; d <<= 1) {
        const int other = i >= d ? scan[i - d] : 0;
        __syncthreads();
        scan[i] += other;
        __syncthreads();
    }
    const int index = scan[i] - 1, total = scan[FLASH_TILES_THREADS - 1];
    if (first && index < capacity) {
        int count = 1;  // the run's tokens from i on, up to `tile`
        while (count < tile && i + count < n && tok_slot[i + count] == slot && tok_pos[i + count] == tok_pos[i] + count)
            ++count;
        tiles[2 * index] = i;
        tiles[2 * index + 1] = count;
    }
    for (int e = total + i; e < capacity; e += FLASH_TILES_THREADS) tiles[2 * e] = tiles[2 * e + 1] = 0;
}

// dst[i] = src[index[i]] for i < n: a step's tokens taken from the last step's argmax (run's `fed`).
extern "C" __global__ void gather_ints(const int* __restrict__ src, const int* __restrict__ index, int* __restrict__ dst,
                                       int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[index[i]];
}

// y [n, m] = y * xscale[t] + bias (or 0): the epilogue of a cuBLAS product of x_to_f16's rows. Block (b, r) takes
// the values from b * blockDim.x of tokens r, r + gridDim.y, ..., strided by the grid; without a bias, rows of scale
// 1 (most: f16_shift) are neither read nor written (a block of such a row returns at once).
extern "C" __global__ void scale_rows_bias(float* __restrict__ y, const float* __restrict__ xscale,
                                           const float* __restrict__ bias, int m, int n) {
    for (i64 t = blockIdx.y; t < n; t += gridDim.y) {
        const float s = xscale[t];
        if (!bias && s == 1.0f) continue;
        float* yr = y + t * m;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < m; c += gridDim.x * blockDim.x)
            yr[c] = bias ? yr[c] * s + bias[c] : yr[c] * s;
    }
}

// The epilogue's value of one element: y * s + bias, or y * s (scale_rows_bias's, so the fused forms below give the
// same bits as the epilogue followed by silu_mul or add).
__device__ __forceinline__ float scaled(float y, float s, const float* __restrict__ bias, int c) {
    return bias ? y * s + bias[c] : y * s;
}

// The epilogue of up to three cuBLAS products of the same f16 rows, made side by side into y [n, m0 + m1 + m2]
// (columns [0, m0) the first's, then the second's, then the third's: a layer's q, k and v), each written to its own
// out_i [n, m_i] with its bias b_i (or none). One launch where three scale_rows_bias would be; grid as theirs.
extern "C" __global__ void scale_split(const float* __restrict__ y, const float* __restrict__ xscale,
                                       float* __restrict__ out0, float* __restrict__ out1, float* __restrict__ out2,
                                       const float* __restrict__ b0, const float* __restrict__ b1,
                                       const float* __restrict__ b2, int m0, int m1, int m2, int n) {
    const int ldy = m0 + m1 + m2;
    for (i64 t = blockIdx.y; t < n; t += gridDim.y) {
        const float s = xscale[t];
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < ldy; c += gridDim.x * blockDim.x) {
            const float v = y[t * ldy + c];
            if (c < m0) out0[t * m0 + c] = scaled(v, s, b0, c);
            else if (c < m0 + m1) out1[t * m1 + c - m0] = scaled(v, s, b1, c - m0);
            else out2[t * m2 + c - m0 - m1] = scaled(v, s, b2, c - m0 - m1);
        }
    }
}

// silu_mul of a gated unit whose gate and up are one cuBLAS product's columns [0, m) and [m, 2m) of y [n, 2m] (the
// same f16 rows of x), each with its epilogue (x's row scale, its bias): two epilogues and silu_mul in one launch.
extern "C" __global__ void scale_silu_mul(const float* __restrict__ y, const float* __restrict__ xscale,
                                          const float* __restrict__ bg, const float* __restrict__ bu,
                                          float* __restrict__ out, int m, int n) {
    for (i64 t = blockIdx.y; t < n; t += gridDim.y) {
        const float s = xscale[t];
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < m; c += gridDim.x * blockDim.x) {
            const float g = scaled(y[t * 2 * m + c], s, bg, c), u = scaled(y[t * 2 * m + m + c], s, bu, c);
            out[t * m + c] = g / (1.0f + expf(-g)) * u;
        }
    }
}

// a + a cuBLAS product y [n, m] with its epilogue: the residual add after a layer's o or down product, one launch
// where scale_rows_bias and add were two.
extern "C" __global__ void scale_add(const float* __restrict__ y, const float* __restrict__ xscale,
                                     const float* __restrict__ bias, const float* __restrict__ a,
                                     float* __restrict__ out, int m, int n) {
    for (i64 t = blockIdx.y; t < n; t += gridDim.y) {
        const float s = xscale[t];
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < m; c += gridDim.x * blockDim.x)
            out[t * m + c] = a[t * m + c] + scaled(y[t * m + c], s, bias, c);
    }
}

// The simple fallback product for float32 weights whose rows are not a multiple of 8 long:
// one warp per output element.
extern "C" __global__ void matmul_f32_naive(const float* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, const float* __restrict__ bias, int M, int N, int K) {
    const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (item >= (i64)M * N) return;
    const int m = item % M, t = item / M;
    float s = 0.0f;
    for (int k = lane; k < K; k += 32) s = fmaf(w[(i64)m * K + k], x[(i64)t * K + k], s);
    s = warp_sum(s);
    if (lane == 0) y[(i64)t * M + m] = s + (bias ? bias[m] : 0.0f);
}
