// The gated delta-net (leat.deltanet, its numpy reference; deltanet.py launches these) and sigmoid_mul: Qwen3.5's
// linear-attention layers. float32 throughout. The recurrent state lives in device memory per slot: each token's
// slot and position come from the step's device arrays (tok_slot, tok_pos: a graph's inputs), so a replayed graph
// reads and writes the states of the slots its batch names. A row of the batch is a run of consecutive tokens of
// one slot; a run whose first position is 0 starts a sequence from zeros; padding tokens (slot -1) output zeros.
#include "common.cuh"

// Whether token i begins a run: the first token of its row (the tokens before it belong to another slot).
__device__ __forceinline__ bool run_start(const int* __restrict__ tok_slot, int i) {
    return tok_slot[i] >= 0 && (i == 0 || tok_slot[i - 1] != tok_slot[i]);
}

// The depthwise causal convolution over the last K inputs of each channel, then SiLU: x [n, channels] from mixed
// [n, channels] (the qkv projection) and conv [channels, K] (tap K - 1 is the token's own input). tails [slots,
// K - 1, channels] keeps each slot's last K - 1 inputs between steps. One thread per (run, channel): it walks its
// run's tokens in order with the window in registers, then stores the window back.
template <int K>
__global__ void deltanet_conv(const float* __restrict__ mixed, const float* __restrict__ conv,
                              const int* __restrict__ tok_slot, const int* __restrict__ tok_pos,
                              float* __restrict__ tails, float* __restrict__ x, int n, int channels) {
    const int i = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < channels && tok_slot[i] < 0) x[(i64)i * channels + c] = 0.0f;
    if (c >= channels || !run_start(tok_slot, i)) return;
    const int slot = tok_slot[i];
    const bool fresh = tok_pos[i] == 0;
    float* tail = tails + (i64)slot * (K - 1) * channels + c;
    float w[K], window[K - 1];
#pragma unroll
    for (int j = 0; j < K; j++) w[j] = conv[(i64)c * K + j];
#pragma unroll
    for (int j = 0; j < K - 1; j++) window[j] = fresh ? 0.0f : tail[(i64)j * channels];
    for (int t = i; t < n && tok_slot[t] == slot; t++) {
        const float in = mixed[(i64)t * channels + c];
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < K - 1; j++) s = fmaf(window[j], w[j], s);
        s = fmaf(in, w[K - 1], s);
        x[(i64)t * channels + c] = s / (1.0f + expf(-s));
#pragma unroll
        for (int j = 0; j < K - 2; j++) window[j] = window[j + 1];
        window[K - 2] = in;
    }
#pragma unroll
    for (int j = 0; j < K - 1; j++) tail[(i64)j * channels] = window[j];
}

// The recurrence over x [n, channels] (after deltanet_conv): q and k [k_heads, D], then v [v_heads, D]; value head h
// reads key head h % k_heads. Per token, q and k are L2-normed (q also scaled by 1 / sqrt(D)), g = exp(softplus(
// alpha + dt_bias) * a), b = sigmoid(beta), and the head's state S [D value, D key] becomes g S + outer(b (v - g S k),
// k); the output is S q: out [n, v_heads, D]. One warp per (run, value head, 32 value rows): lane r keeps row r of S
// in registers for the whole run. states [slots, v_heads, D key, D value] is stored transposed, so that the warp's
// loads and stores of a key column are coalesced.
template <int D>
__global__ void __launch_bounds__(32)
    deltanet_recur(const float* __restrict__ x, const float* __restrict__ alpha, const float* __restrict__ beta,
                   const float* __restrict__ dt_bias, const float* __restrict__ a, const int* __restrict__ tok_slot,
                   const int* __restrict__ tok_pos, float* __restrict__ states, float* __restrict__ out, int n,
                   int k_heads, int v_heads, float eps) {
    const int i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, r = blockIdx.z * 32 + lane;
    if (tok_slot[i] < 0 && r < D) out[((i64)i * v_heads + h) * D + r] = 0.0f;
    if (!run_start(tok_slot, i)) return;
    const int slot = tok_slot[i], channels = (2 * k_heads + v_heads) * D, key = (h % k_heads) * D;
    const bool row = r < D, fresh = tok_pos[i] == 0;
    float* state = states + ((i64)slot * v_heads + h) * D * D;
    __shared__ float qs[D], ks[D];
    float s[D];
#pragma unroll
    for (int c = 0; c < D; c++) s[c] = row && !fresh ? state[(i64)c * D + r] : 0.0f;
    for (int t = i; t < n && tok_slot[t] == slot; t++) {
        const float* xt = x + (i64)t * channels;
        float qq = 0.0f, kk = 0.0f;
        for (int c = lane; c < D; c += 32) {
            const float qv = xt[key + c], kv = xt[k_heads * D + key + c];
            qs[c] = qv;
            ks[c] = kv;
            qq = fmaf(qv, qv, qq);
            kk = fmaf(kv, kv, kk);
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        __syncwarp();
        const float qn = 1.0f / sqrtf(qq + eps) / sqrtf((float)D), kn = 1.0f / sqrtf(kk + eps);
        const float z = alpha[(i64)t * v_heads + h] + dt_bias[h];
        const float g = expf((fmaxf(z, 0.0f) + log1pf(expf(-fabsf(z)))) * a[h]);
        const float b = 1.0f / (1.0f + expf(-beta[(i64)t * v_heads + h]));
        const float v = row ? xt[2 * k_heads * D + h * D + r] : 0.0f;
        float sk = 0.0f;
#pragma unroll
        for (int c = 0; c < D; c++) {
            s[c] *= g;
            sk = fmaf(s[c], ks[c], sk);
        }
        const float delta = b * (v - sk * kn) * kn;
        float o = 0.0f;
#pragma unroll
        for (int c = 0; c < D; c++) {
            s[c] = fmaf(delta, ks[c], s[c]);
            o = fmaf(s[c], qs[c], o);
        }
        if (row) out[((i64)t * v_heads + h) * D + r] = o * qn;
        __syncwarp();  // qs and ks are rewritten for the next token
    }
    if (row) {
#pragma unroll
        for (int c = 0; c < D; c++) state[(i64)c * D + r] = s[c];
    }
}

// y = sigmoid(gate) * x over x [n / cols, cols]; gate [n / cols, gate_cols] with gate_cols cols, or 1 (a gate per
// row: Qwen3.5 MoE's shared expert).
extern "C" __global__ void sigmoid_mul(const float* __restrict__ gate, const float* __restrict__ x,
                                       float* __restrict__ y, i64 n, int cols, int gate_cols) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / cols;
        const float g = gate[row * gate_cols + (gate_cols == 1 ? 0 : i % cols)];
        y[i] = x[i] / (1.0f + expf(-g));
    }
}
