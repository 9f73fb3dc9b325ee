// Mixture-of-experts routing, gated activation and weighted sum (leat.moe is the reference). The
// expert products themselves are experts.cu's gemv_id, which reads only the selected experts.
#include "common.cuh"

#define GATING_SOFTMAX 0
#define GATING_SOFTMAX_SELECTED 1
#define GATING_SIGMOID 2

// The best entry of v[0..E) not yet taken, across a warp: highest value, ties to the lower index
// (numpy's stable argsort of -v). Every lane gets the index.
__device__ __forceinline__ int warp_argmax(const float* v, const unsigned char* taken, int E) {
    float best = NEG_INF;
    int at = -1;
    for (int i = threadIdx.x & 31; i < E; i += 32) {
        if (taken[i]) continue;
        if (at < 0 || v[i] > best) best = v[i], at = i;  // ascending i: ties keep the lower index
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(FULL_MASK, best, o);
        const int oa = __shfl_xor_sync(FULL_MASK, at, o);
        if (oa >= 0 && (at < 0 || ob > best || (ob == best && oa < at))) best = ob, at = oa;
    }
    return at;
}

// Router logits [n, E] -> the k selected experts per token (ids [n, k], by descending selection
// score) and their weights [n, k], as leat.moe.route: scores by `gating`; selection scores = scores +
// sel_bias, limited to the `groups_used` best of `groups` groups (a group scores the sum of its two
// best) when groups > 1; weights from the unbiased scores, softmax over the k for
// GATING_SOFTMAX_SELECTED, divided by their sum (at least 6.103515625e-5) with `normalize`, times
// `scale` (0: none). One warp per token; shared memory: 2 E floats and E + groups flags.
extern "C" __global__ void __launch_bounds__(32) moe_route(
    const float* __restrict__ logits, const float* __restrict__ sel_bias, int* __restrict__ ids,
    float* __restrict__ weights, int E, int k, int gating, int normalize, float scale, int groups, int groups_used) {
    extern __shared__ float sm[];
    float* score = sm;
    float* sel = sm + E;
    unsigned char* taken = (unsigned char*)(sm + 2 * E);
    unsigned char* gtaken = taken + E;
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (i64)t * E;
    float mx = NEG_INF, sum = 0.0f;
    if (gating == GATING_SOFTMAX) {
        for (int i = lane; i < E; i += 32) mx = fmaxf(mx, l[i]);
        mx = warp_max(mx);
        for (int i = lane; i < E; i += 32) sum += expf(l[i] - mx);
        sum = warp_sum(sum);
    }
    for (int i = lane; i < E; i += 32) {
        const float s = gating == GATING_SOFTMAX ? expf(l[i] - mx) / sum
                        : gating == GATING_SIGMOID ? 1.0f / (1.0f + expf(-l[i]))
                                                    : l[i];
        score[i] = s;
        sel[i] = sel_bias ? s + sel_bias[i] : s;
        taken[i] = 0;
    }
    __syncwarp();
    if (groups > 1) {
        const int size = E / groups;
        float* gscore = sm + 2 * E + (E + groups + 3) / 4;  // after the flags
        for (int g = lane; g < groups; g += 32) {
            float a = NEG_INF, b = NEG_INF;  // the two best of the group
            for (int i = g * size; i < (g + 1) * size; ++i) {
                const float v = sel[i];
                if (v > a) b = a, a = v;
                else if (v > b) b = v;
            }
            gscore[g] = size > 1 ? a + b : a;
            gtaken[g] = 0;
        }
        __syncwarp();
        for (int j = 0; j < groups_used; ++j) {
            const int g = warp_argmax(gscore, gtaken, groups);
            if (lane == 0) gtaken[g] = 1;
            __syncwarp();
        }
        for (int i = lane; i < E; i += 32)
            if (!gtaken[i / size]) sel[i] = NEG_INF;
        __syncwarp();
    }
    int* out_ids = ids + (i64)t * k;
    float* out_w = weights + (i64)t * k;
    float total = 0.0f, top = NEG_INF;
    for (int j = 0; j < k; ++j) {
        const int e = warp_argmax(sel, taken, E);
        if (lane == 0) {
            taken[e] = 1;
            out_ids[j] = e;
            out_w[j] = score[e];
        }
        top = fmaxf(top, score[e]);
        __syncwarp();
    }
    if (lane != 0) return;
    if (gating == GATING_SOFTMAX_SELECTED) {
        for (int j = 0; j < k; ++j) total += (out_w[j] = expf(out_w[j] - top));
        for (int j = 0; j < k; ++j) out_w[j] /= total;
    }
    if (normalize) {
        total = 0.0f;
        for (int j = 0; j < k; ++j) total += out_w[j];
        total = fmaxf(total, 6.103515625e-5f);
        for (int j = 0; j < k; ++j) out_w[j] /= total;
    }
    if (scale != 0.0f && scale != 1.0f)
        for (int j = 0; j < k; ++j) out_w[j] *= scale;
}

// The P pairs of ids [P] grouped by expert, for experts.cu's gemv_grouped and gemm_grouped: start [E + 1] (pairs
// of expert e are order[start[e] .. start[e + 1]), in ascending pair order) and chunk_start [E + 1] (the prefix
// sums of ceil(count / NC)). One block; warp w takes pairs [w * per, (w + 1) * per), 32 at a time (lanes with the
// same expert found by __match_any_sync): it counts them per expert into row w of the shared [warps][E] table,
// which then becomes where row w's pairs of each expert start, and lists them there in a second pass.
// Dynamic shared memory: 4 * warps * E bytes.
extern "C" __global__ void moe_group(const int* __restrict__ ids, int P, int E, int NC, int* __restrict__ start,
                                     int* __restrict__ chunk_start, int* __restrict__ order) {
    extern __shared__ float sm[];
    int* count = (int*)sm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int per = (P + warps - 1) / warps, lo = warp * per, hi = min(P, lo + per);
    for (int i = threadIdx.x; i < warps * E; i += blockDim.x) count[i] = 0;
    __syncthreads();
    for (int p0 = lo; p0 < hi; p0 += 32) {
        const int e = p0 + lane < hi ? ids[p0 + lane] : -1;
        const unsigned same = __match_any_sync(FULL_MASK, e);
        if (e >= 0 && lane == __ffs(same) - 1) count[warp * E + e] += __popc(same);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int total = 0;
        for (int w = 0; w < warps; ++w) {
            const int c = count[w * E + e];
            count[w * E + e] = total;
            total += c;
        }
        start[e + 1] = total;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        start[0] = chunk_start[0] = 0;
        for (int e = 0; e < E; ++e) {
            chunk_start[e + 1] = chunk_start[e] + (start[e + 1] + NC - 1) / NC;
            start[e + 1] += start[e];
        }
    }
    __syncthreads();
    for (int p0 = lo; p0 < hi; p0 += 32) {
        const int p = p0 + lane, e = p < hi ? ids[p] : -1;
        const unsigned same = __match_any_sync(FULL_MASK, e);
        if (e >= 0) order[start[e] + count[warp * E + e] + __popc(same & ((1u << lane) - 1))] = p;
        __syncwarp();
        if (e >= 0 && lane == __ffs(same) - 1) count[warp * E + e] += __popc(same);
        __syncwarp();
    }
}

// The same grouping for per-head products (head_matmul): pair p = t * heads + h uses matrix h, so
// matrix h's pairs are h, h + heads, ... (n of them). One block.
extern "C" __global__ void head_group(int n, int heads, int NC, int* __restrict__ start, int* __restrict__ chunk_start,
                                      int* __restrict__ order) {
    const int chunks = (n + NC - 1) / NC;
    for (int h = threadIdx.x; h <= heads; h += blockDim.x) {
        start[h] = h * n;
        chunk_start[h] = h * chunks;
    }
    for (int i = threadIdx.x; i < n * heads; i += blockDim.x) order[i] = (i % n) * heads + i / n;
}

// The experts' gated activation over n values: silu(g) * u (kind 0), or gpt-oss's clamped SwiGLU
// (kind 1): x = min(g, limit), y = clamp(u, -limit, limit), x * sigmoid(alpha x) * (y + 1).
extern "C" __global__ void moe_glu(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                                   i64 n, int kind, float alpha, float limit) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        if (kind == 0) {
            y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        } else {
            const float x = fminf(g[i], limit), v = fminf(fmaxf(u[i], -limit), limit);
            y[i] = x / (1.0f + expf(-alpha * x)) * (v + 1.0f);
        }
    }
}

// out[t] = residual[t] (where given) + the sum over j < k of weights[t, j] * y[t * k + j], rows of d values, summed
// in order of j. Block (t, b) takes token t's columns from b * blockDim.x, one a thread: a decode step's few tokens
// still fill the card, and each thread loads four experts' values before it adds them (a short chain of dependent
// loads, where one block per token looping over j took ~12 us a layer on an H200).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                       const float* __restrict__ residual, float* __restrict__ out, int k, int d) {
    const i64 t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d) return;
    const float* wt = weights + t * k;
    const float* yt = y + t * k * d + c;
    float s = 0.0f;
    int j = 0;
    for (; j + 4 <= k; j += 4) {
        float wv[4], yv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) wv[i] = wt[j + i], yv[i] = yt[(i64)(j + i) * d];
#pragma unroll
        for (int i = 0; i < 4; ++i) s = fmaf(wv[i], yv[i], s);
    }
    for (; j < k; ++j) s = fmaf(wt[j], yt[(i64)j * d], s);
    out[t * d + c] = residual ? residual[t * d + c] + s : s;  // the residual add of the layer, fused
}

// experts.cu's gemv_id for float32 matrices whose rows are not a multiple of 8 long (stored plainly):
// one warp per output value; grid (pairs, ceil(M / 4)).
extern "C" __global__ void gemv_id_f32(const float* __restrict__ w, const int* __restrict__ ids, int mod,
                                       const float* __restrict__ x, int x_div, float* __restrict__ y,
                                       const float* __restrict__ bias, int M, int K) {
    const int p = blockIdx.x, row = blockIdx.y * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= M) return;
    const i64 e = ids ? ids[p] : p % mod;
    const float* wr = w + (e * M + row) * K;
    const float* xr = x + (i64)(p / x_div) * K;
    float s = 0.0f;
    for (int c = lane; c < K; c += 32) s = fmaf(wr[c], xr[c], s);
    s = warp_sum(s);
    if (lane == 0) y[(i64)p * M + row] = s + (bias ? bias[e * M + row] : 0.0f);
}
