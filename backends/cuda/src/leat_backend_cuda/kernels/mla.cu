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
// ops.cu's attention with one KV head: a block serves one token and GB heads over positions
// [z * split, (z + 1) * split) (grid (n, ceil(heads / GB), splits)); its 4 warps take turns over the
// keys, KB at a time; a lane holds dims lane, lane + 32, ... (DL of them, covering rank + rope) of q
// and the key, and of the output where they are below `rank`. Online softmax in float32; one split
// writes the normalized output [n, heads, rank], several write (max, sum) and the unnormalized sums
// for ops.cu's attention_combine.
template <typename KV, int DL, int GB>
__global__ void __launch_bounds__(128) mla_attention(
    const float* __restrict__ q_latent, const float* __restrict__ q_rope, const KV* __restrict__ kc,
    const u16* __restrict__ ks, const int* __restrict__ page_table, const int* __restrict__ tok_slot, const int* __restrict__ tok_pos,
    float* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc, int heads, int rank, int rope,
    int pages_per_slot, int page_size, int window, int split, float scale) {
    const int t = blockIdx.x, h0 = blockIdx.y * GB, z = blockIdx.z, nsplit = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, dk = rank + rope;
    const int slot = tok_slot[t], pos = tok_pos[t];
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int begin = max(lo, z * split), end = slot < 0 ? 0 : min(pos + 1, (z + 1) * split);

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
