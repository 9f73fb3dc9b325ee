// Multi-head latent attention (DeepSeek 2/3, absorbed form) over a paged latent cache: each cached
// key is [latent (rank), k_rope (rope)], one shared KV head, and the values are the keys' first
// `rank` entries (leat.mla; Backend.mla_attention). The page layout and the token arrays (slot -1:
// a padding token) are those of ops.cu's kv_write with kv_heads 1 and dk = rank + rope; KV as there
// (a q8_0 cache, KV = i8, has its scales in `ks`, and rank + rope a multiple of 32).
#include "decode_tc.cuh"

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
    int begin, end;
    const int* table = token_range(tok_slot, tok_pos, page_table, pages_per_slot, window, keys, begin, end);

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

// mla_attention on tensor cores (decode at 512 + 64; LEAT_CUDA_MLA_TC=0: never): a block serves one token, 16 of
// its query heads (mma.sync m16n8k16's m: every head reads the same latent keys) and split z of its range, cut as
// mla_attention cuts it; the keys pass through shared memory 16 at a time, the next 16 loaded into registers while
// the block works on these. Each of the 4 warps multiplies a quarter of the key dims (S = Q K^T, its 16 x 16 part
// sums added up through shared memory in one order, so every warp holds the same scores and keeps the same online
// softmax) and owns a quarter of the value dims (O += P V, V the keys' first RANK dims, from the same tile). A head's
// q is rounded to f16 with a power-of-two scale (its largest value in [2^14, 2^15), as mla_q_f16), probabilities to
// f16 (as the cuBLAS prefill); sums in float32. The output, or a split's (max, sum) and unnormalized sums, as
// mla_attention writes them.
template <typename KV, int RANK, int ROPE>
__global__ void __launch_bounds__(128) mla_attention_tc(
    const float* __restrict__ q_latent, const float* __restrict__ q_rope, const KV* __restrict__ kc,
    const u16* __restrict__ ks, const int* __restrict__ page_table, const int* __restrict__ tok_slot,
    const int* __restrict__ tok_pos, float* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
    int heads, int pages_per_slot, int page_size, int window, int keys, float scale) {
    constexpr int DK = RANK + ROPE, LD = DK + 8, C8 = DK / 8, BK = 16, DW = RANK / 4;  // LD: padded rows (banks)
    constexpr int PER = (BK * C8 + 127) / 128;  // a thread's 16-byte pieces of a tile
    static_assert(DK % 32 == 0 && RANK % 64 == 0, "latent keys of whole q8_0 blocks, values a multiple of 4 x 16");
    __shared__ __align__(16) u16 qs[16 * LD];
    __shared__ __align__(16) u16 kt[BK * LD];
    __shared__ float part[4][16][BK];
    __shared__ float qscale[16];
    const int t = blockIdx.x, h0 = blockIdx.y * 16, z = blockIdx.z, nsplit = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r0 = lane >> 2;
    int begin, end;
    const int* table = token_range(tok_slot, tok_pos, page_table, pages_per_slot, window, keys, begin, end);

    // a tile's pieces: keys k0 ... k0 + 15 (zeros past `end`), a key's DK values as f16; lane j < 16 of each warp
    // looks up key k0 + j's cache row, and a piece takes its key's by shuffle
    uint4 tile[PER];
    auto fetch = [&](int k0) {
        const int pj = min(k0 + (lane & 15), end - 1);
        const int mine = table[pj / page_size] * page_size + pj % page_size;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int idx = threadIdx.x + 128 * i, j = (idx / C8) & 15, c = idx % C8;
            const int row = __shfl_sync(FULL_MASK, mine, j);
            tile[i] = make_uint4(0, 0, 0, 0);
            if (idx < BK * C8 && k0 + j < end) tile[i] = kv_f16x8<DK>(kc, ks, row, c * 8);
        }
    };
    if (begin < end) fetch(begin);

    // queries: warp w rounds heads h0 + 4w ... + 3
    for (int r = 4 * warp; r < 4 * warp + 4; ++r) {
        const i64 th = (i64)t * heads + h0 + r;
        const bool real = h0 + r < heads;
        auto value = [&](int d) { return d < RANK ? q_latent[th * RANK + d] : q_rope[th * ROPE + d - RANK]; };
        float mx = 0.0f;
        for (int d = lane; d < DK; d += 32) mx = fmaxf(mx, real ? fabsf(value(d)) : 0.0f);
        const int e = binade(warp_max(mx));
        const float f = ldexpf(1.0f, 15 - e);
        for (int d = lane; d < DK; d += 32) qs[r * LD + d] = real ? f32_to_f16(value(d) * f) : (u16)0;
        if (lane == 0) qscale[r] = scale * ldexpf(1.0f, e - 15);
    }

    // this thread's rows r0 and r0 + 8: (max, its share of the sum); o[i][2h + e] is row r0 + 8h, value dim
    // DW * warp + 8i + 2 (lane & 3) + e
    float o[DW / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < DW / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    for (int k0 = begin; k0 < end; k0 += BK) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int idx = threadIdx.x + 128 * i;
            if (idx < BK * C8) *(uint4*)(kt + (idx / C8) * LD + (idx % C8) * 8) = tile[i];
        }
        __syncthreads();
        if (k0 + BK < end) fetch(k0 + BK);  // in flight while this tile is worked on

        // S over this warp's quarter of the key dims (16-dim steps warp, warp + 4, ...), then the four added up
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        for (int kk = warp; kk < DK / 16; kk += 4) {
            u32 qa[4], t4[4];
            ldmatrix_x4(qa, qs + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
            ldmatrix_x4(t4, kt + ((lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_f16(s[0], qa, t4[0], t4[1]);
            mma_f16(s[1], qa, t4[2], t4[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[warp][r0 + 8 * (i >> 1)][nt * 8 + 2 * (lane & 3) + (i & 1)] = s[nt][i];
        __syncthreads();
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = r0 + 8 * (i >> 1), key = nt * 8 + 2 * (lane & 3) + (i & 1);
                const float v = part[0][row][key] + part[1][row][key] + part[2][row][key] + part[3][row][key];
                s[nt][i] = k0 + key < end ? v * qscale[row] : NEG_INF;
            }
        softmax_tiles(s, m, l, o);
        pv_tiles<DW / 8, LD>(s, kt, DW * warp, o);  // O += P V over this warp's value dims
        __syncthreads();  // the next tile overwrites kt and part
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float total = quad_sum(l[h]);
        const int row = r0 + 8 * h;
        if (h0 + row >= heads) continue;
        const i64 th = (i64)t * heads + h0 + row;
        float* dst = nsplit == 1 ? out + th * RANK : part_acc + (th * nsplit + z) * RANK;
        const float inv = nsplit > 1 ? 1.0f : total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
        for (int i = 0; i < DW / 8; ++i)
            *(float2*)(dst + DW * warp + 8 * i + 2 * (lane & 3)) = make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
        if (nsplit > 1 && warp == 0 && (lane & 3) == 0) {
            part_ml[2 * (th * nsplit + z)] = m[h];
            part_ml[2 * (th * nsplit + z) + 1] = total;
        }
    }
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
    const int e = binade(block_max(mx));
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
