// Multi-head latent attention (DeepSeek 2/3, absorbed form) over a paged latent cache: each cached
// key is [latent (rank), k_rope (rope)], one shared KV head, and the values are the keys' first
// `rank` entries (leat.mla; Backend.mla_attention). The page layout and the token arrays (slot -1:
// a padding token) are those of ops.cu's kv_write with kv_heads 1 and dk = rank + rope; KV as there
// (a q8_0 cache, KV = i8, has its scales in `ks`, and rank + rope a multiple of 32).
#include "kv.cuh"

// Writes [latent[t], k_rope[t]] at each token's position; one block per token.
template <typename KV>
__global__ void mla_kv_write(const float* __restrict__ latent, const float* __restrict__ k_rope, KV* __restrict__ kc,
                             u16* __restrict__ ks, const int* __restrict__ page_table, const int* __restrict__ tok_slot,
                             const int* __restrict__ tok_pos, int rank, int rope, int pages_per_slot, int page_size) {
    const int t = blockIdx.x, slot = tok_slot[t], pos = tok_pos[t];
    if (slot < 0) return;
    const int page = page_table[(i64)slot * pages_per_slot + pos / page_size];
    if (page < 0) return;
    const i64 row = (i64)page * page_size + pos % page_size;
    const float *lt = latent + (i64)t * rank, *rt = k_rope + (i64)t * rope - rank;
    kv_put(kc, ks, row * (rank + rope), rank + rope, [=](int i) { return i < rank ? lt[i] : rt[i]; });
}

// Causal (optionally windowed) attention of query heads [q_latent, q_rope] over the cached keys, as
// ops.cu's attention with one KV head: a block serves one token and GB heads over split z of the
// token's own range, cut as attention cuts it (grid (n, ceil(heads / GB), splits); each split's
// length a multiple of `keys`); its 4 warps take turns over the
// keys, KB at a time; a lane holds dims lane, lane + 32, ... (DL of them, covering rank + rope) of q
// and the key, and of the output where they are below `rank`. Online softmax in float32; one split
// writes the normalized output [n, heads, rank], several write (max, sum) and the unnormalized sums
// for ops.cu's attention_combine.
template <typename KV, int DL, int GB>
__global__ void __launch_bounds__(128) mla_attention(
    const float* __restrict__ q_latent, const float* __restrict__ q_rope, const KV* __restrict__ kc,
    const u16* __restrict__ ks, const int* __restrict__ page_table, const int* __restrict__ tok_slot, const int* __restrict__ tok_pos,
    float* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc, int heads, int rank, int rope,
    int pages_per_slot, int page_size, int window, int keys, float scale) {
    const int t = blockIdx.x, h0 = blockIdx.y * GB, z = blockIdx.z, nsplit = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, dk = rank + rope;
    const int slot = tok_slot[t], pos = tok_pos[t];
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    int begin, end;
    split_range(lo, pos, slot, z, nsplit, keys, begin, end);

    float qv[GB][DL], m[GB], l[GB], acc[GB][DL];
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        const i64 th = (i64)t * heads + h0 + g;
        const bool real = h0 + g < heads;
#pragma unroll
        for (int i = 0; i < DL; ++i) {
            const int d = lane + 32 * i;
            const float v = !real ? 0.0f : d < rank ? q_latent[th * rank + d] : d < dk ? q_rope[th * rope + d - rank] : 0.0f;
            qv[g][i] = v * scale;
            acc[g][i] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    const int* table = page_table + (i64)max(slot, 0) * pages_per_slot;
    constexpr int KB = 2;
    for (int p0 = begin + KB * warp; p0 < end; p0 += 4 * KB) {
        float kd[KB][DL];
#pragma unroll
        for (int j = 0; j < KB; ++j) {
            const int p = min(p0 + j, end - 1);
            const i64 row = (i64)table[p / page_size] * page_size + p % page_size;
#pragma unroll
            for (int i = 0; i < DL; ++i) {
                const int d = lane + 32 * i;
                kd[j][i] = d < dk ? kv_load(kc, ks, row, dk, d) : 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < KB; ++j) {
            if (p0 + j >= end) break;
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < DL; ++i) s = fmaf(qv[g][i], kd[j][i], s);
                s = warp_sum(s);
                const float mn = fmaxf(m[g], s), corr = expf(m[g] - mn), e = expf(s - mn);
                l[g] = l[g] * corr + e;
#pragma unroll
                for (int i = 0; i < DL; ++i) acc[g][i] = fmaf(acc[g][i], corr, lane + 32 * i < rank ? e * kd[j][i] : 0.0f);
                m[g] = mn;
            }
        }
    }
    attention_store<GB, DL>(m, l, acc, min(GB, heads - h0), (i64)t * heads + h0, heads, rank, z, nsplit, nullptr, out,
                            part_ml, part_acc);
}

// Prefill through cuBLAS (mla.py; LEAT_CUDA_MLA_GEMM=0 keeps mla_attention): a sequence's queries times its keys
// in one f16 GEMM, the causal softmax of the scores (mla_softmax_f16), the probabilities times the values in
// another. The pieces:

// Query rows [q_latent, q_rope] (rows = tokens x heads) as f16, each scaled by a power of two (its largest value in
// [2^14, 2^15), as ops.cu's x_to_f16), and the scales that undo it. One block per row.
extern "C" __global__ void mla_q_f16(const float* __restrict__ q_latent, const float* __restrict__ q_rope,
                                     u16* __restrict__ qh, float* __restrict__ qscale, int rank, int rope) {
    const i64 r = blockIdx.x;
    const int dk = rank + rope;
    const float *ql = q_latent + r * rank, *qr = q_rope + r * rope - rank;
    float mx = 0.0f;
    for (int d = threadIdx.x; d < dk; d += blockDim.x) mx = fmaxf(mx, fabsf(d < rank ? ql[d] : qr[d]));
    mx = block_max(mx);
    int e = 0;
    if (mx > 0.0f && isfinite(mx)) frexpf(mx, &e);
    const float f = ldexpf(1.0f, 15 - e);
    for (int d = threadIdx.x; d < dk; d += blockDim.x) qh[r * dk + d] = f32_to_f16((d < rank ? ql[d] : qr[d]) * f);
    if (threadIdx.x == 0) qscale[r] = ldexpf(1.0f, e - 15);
}

// The cached keys of positions [0, gridDim.x) of `slot` as f16 rows [positions, dk] (their first `rank` entries
// are the values). One block per position.
template <typename KV>
__global__ void mla_keys_f16(const KV* __restrict__ kc, const u16* __restrict__ ks, const int* __restrict__ page_table,
                             int slot, int dk, int pages_per_slot, int page_size, u16* __restrict__ keys) {
    const int p = blockIdx.x;
    const i64 row = (i64)page_table[(i64)slot * pages_per_slot + p / page_size] * page_size + p % page_size;
    for (int d = threadIdx.x; d < dk; d += blockDim.x) keys[(i64)p * dk + d] = f32_to_f16(kv_load(kc, ks, row, dk, d));
}

// Row r of the scores s [rows, span] (query row r: token r / heads, at position pos[r / heads]; column c: the key
// at position c) as softmax probabilities in f16 (p): over the keys in [lo, pos] (lo = pos - window + 1 with a
// window, else 0), of the scores times `scale` and the query row's f16 scale; 0 for every other key. One block per
// row.
extern "C" __global__ void mla_softmax_f16(const float* __restrict__ s, u16* __restrict__ p,
                                           const float* __restrict__ qscale, const int* __restrict__ pos, int heads,
                                           int span, int window, float scale) {
    const i64 r = blockIdx.x;
    const int at = pos[r / heads], lo = window > 0 ? max(0, at - window + 1) : 0, hi = min(at, span - 1);
    const float f = scale * qscale[r];
    const float* sr = s + r * span;
    float mx = NEG_INF;
    for (int c = lo + threadIdx.x; c <= hi; c += blockDim.x) mx = fmaxf(mx, sr[c] * f);
    mx = block_max(mx);
    float sum = 0.0f;
    for (int c = lo + threadIdx.x; c <= hi; c += blockDim.x) sum += expf(sr[c] * f - mx);
    const float inv = 1.0f / block_sum(sum);
    for (int c = threadIdx.x; c < span; c += blockDim.x)
        p[r * span + c] = f32_to_f16(c >= lo && c <= hi ? expf(sr[c] * f - mx) * inv : 0.0f);
}
