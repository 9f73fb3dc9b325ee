// What images need beyond a text model's ops (vision.py): LayerNorm, gelu alone, and attention in which a
// token may see positions after its own (an image's span, a vision encoder's patches). float32 activations;
// the KV cache as ops.cu's (KV = float, u16 or i8; kv.cuh), written by ops.cu's kv_write before these read it.
#include "kv.cuh"

// y = (x - mean) / sqrt(var + eps) * w + b over rows of `cols` (the population variance, two passes over
// the row as the float64 oracle computes it; w or b null: left out). One block per row.
extern "C" __global__ void layer_norm(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ b, float* __restrict__ y, int cols, float eps) {
    const float* xr = x + (i64)blockIdx.x * cols;
    float* yr = y + (i64)blockIdx.x * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c];
    const float mean = block_sum(s) / cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss = fmaf(xr[c] - mean, xr[c] - mean, ss);
    const float r = 1.0f / sqrtf(block_sum(ss) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = (xr[c] - mean) * r;
        yr[c] = (w ? v * w[c] : v) + (b ? b[c] : 0.0f);
    }
}

// gelu in ggml's tanh form, over n values (a vision encoder's MLP, which has no up projection).
extern "C" __global__ void gelu(const float* __restrict__ g, float* __restrict__ y, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = 0.5f * g[i] * (1.0f + tanhf(0.7978845608028654f * (g[i] + 0.044715f * g[i] * g[i] * g[i])));
}

// Attention whose keys for token t run from its window's start (relative to its own position, as in causal
// attention) up to and including tok_last[t]: the row's last position in a bidirectional row, the token's own
// position otherwise. One warp per (token, query head), 4 per block; a lane holds dims lane, lane + 32, ...
// (DL of them) of q, each key and the output; keys are taken 4 at a time (loaded before any arithmetic) with an
// online softmax in float32, soft-capped scores and a sink per head as ops.cu's attention. Not tuned: images
// are a prefill's worth of keys once per image, not a decode step's.
template <typename KV, int DL>
__global__ void __launch_bounds__(128) attention_open(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc, const u16* __restrict__ ks,
    const u16* __restrict__ vs, const int* __restrict__ page_table, const int* __restrict__ tok_slot,
    const int* __restrict__ tok_pos, const int* __restrict__ tok_last, float* __restrict__ out, int n, int heads,
    int kv_heads, int dk, int dv, int pages_per_slot, int page_size, int window, float scale, float softcap,
    const float* __restrict__ sinks) {
    const i64 item = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);  // token * heads + head
    const int lane = threadIdx.x & 31;
    if (item >= (i64)n * heads) return;
    const int t = item / heads, h = item % heads, kvh = h / (heads / kv_heads);
    const int slot = tok_slot[t], pos = tok_pos[t];
    const int first = window > 0 ? max(0, pos - window + 1) : 0, stop = slot < 0 ? 0 : tok_last[t] + 1;
    const int* table = page_table + (i64)max(slot, 0) * pages_per_slot;
    float qd[DL], acc[DL], mx = NEG_INF, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < DL; ++i) {
        const int d = lane + 32 * i;
        qd[i] = d < dk ? q[item * dk + d] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    constexpr int KEYS = 4;
    for (int p0 = first; p0 < stop; p0 += KEYS) {
        float kd[KEYS][DL], vd[KEYS][DL];
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            const int p = min(p0 + j, stop - 1);
            const i64 row = ((i64)table[p / page_size] * page_size + p % page_size) * kv_heads + kvh;
#pragma unroll
            for (int i = 0; i < DL; ++i) {
                const int d = lane + 32 * i;
                kd[j][i] = d < dk ? kv_load(kc, ks, row, dk, d) : 0.0f;
                vd[j][i] = d < dv ? kv_load(vc, vs, row, dv, d) : 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            if (p0 + j >= stop) break;
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < DL; ++i) s = fmaf(qd[i], kd[j][i], s);
            s = warp_sum(s);
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            const float top = fmaxf(mx, s), fade = expf(mx - top), e = expf(s - top);
            sum = sum * fade + e;
#pragma unroll
            for (int i = 0; i < DL; ++i) acc[i] = fmaf(acc[i], fade, e * vd[j][i]);
            mx = top;
        }
    }
    float fade = 1.0f;
    if (sinks) {
        float a = 1.0f;  // sink_join's factor on the weighted values, applied to each dim below
        sink_join(sinks[h], mx, sum, a);
        fade = a;
    }
#pragma unroll
    for (int i = 0; i < DL; ++i) {
        const int d = lane + 32 * i;
        if (d < dv) out[item * dv + d] = sum > 0.0f ? acc[i] * fade / sum : 0.0f;
    }
}
