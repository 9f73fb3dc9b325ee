// Attention for many query tokens (a prefill chunk) on tensor cores, over an f16 or q8_0 paged KV
// cache (the layout of ops.cu's kv_write: K [pages, page_size, kv_heads, D], V likewise, one table
// row of pages per slot; q8_0's f16 scales, one per 32 values, in the planes ksc and vsc).
// FlashAttention-2's scheme with mma.sync m16n8k16: scores and the running
// output stay in registers, the softmax is online, K and V pass through shared memory once per
// block in tiles of BK keys.
//
// A block serves one KV head and one *tile* of consecutive tokens of one batch row (same slot,
// consecutive positions): `tiles[2i]` is the tile's first token, `tiles[2i + 1]` its count. Its 4
// warps each own 16 query rows: warp w takes query head (chunk * gb + w % gb) of the KV head's
// group and tokens (w / gb) * 16 ... + 15 of the tile, so a tile holds 16 * 4 / gb tokens.
// q is float32, scaled and rounded to f16 here; probabilities are rounded to f16 for P V;
// accumulation is float32. A q8_0 cache's keys and values are decoded into the same f16 tiles (q x d
// exact in float32, then rounded to f16). Causal, windowed (`window` > 0) and soft-capped
// (`softcap` > 0) as ops.cu's attention. The output is [n, heads, D] float32, normalized.
#include "decode_tc.cuh"

template <typename KV, int D>
__global__ void __launch_bounds__(128) flash_attention(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc, const u16* __restrict__ ksc,
    const u16* __restrict__ vsc, const int* __restrict__ page_table, const int* __restrict__ tok_slot,
    const int* __restrict__ tok_pos,
    const int* __restrict__ tiles, float* __restrict__ out, int heads, int kv_heads, int pages_per_slot,
    int page_size, int window, float scale, float softcap, int gb) {
    constexpr int BK = 32, LD = D + 8, C8 = D / 8;  // keys per tile; padded smem rows (bank spread)
    __shared__ __align__(16) u16 qs[64 * LD];
    __shared__ __align__(16) u16 ks[BK * LD];
    __shared__ __align__(16) u16 vs[BK * LD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = heads / kv_heads, kvh = blockIdx.y % kv_heads, chunk = blockIdx.y / kv_heads;
    const int first = tiles[2 * blockIdx.x], count = tiles[2 * blockIdx.x + 1];
    if (count == 0) return;  // an entry past a graph's last tile (ops.cu's flash_tiles)
    const int slot = tok_slot[first];
    if (slot < 0) return;  // padding rows of a replayed graph: nothing to attend, nothing written
    const int p_first = tok_pos[first], p_last = tok_pos[first + count - 1];
    const int begin = window > 0 ? max(0, p_first - window + 1) : 0, end = p_last + 1;
    const int* table = page_table + (i64)slot * pages_per_slot;

    // queries: row 16 w + r of qs is (head of warp w, token tw * 16 + r), times scale, in f16
    for (int idx = threadIdx.x; idx < 64 * C8; idx += 128) {
        const int row = idx / C8, c = idx % C8, w = row >> 4;
        const int g = chunk * gb + w % gb, tok = (w / gb) * 16 + (row & 15);
        uint4 val = make_uint4(0, 0, 0, 0);
        if (g < group && tok < count) {
            val = f16x8_scaled(q + ((i64)(first + tok) * heads + (i64)kvh * group + g) * D + c * 8, scale);
        }
        *(uint4*)(qs + row * LD + c * 8) = val;
    }
    __syncthreads();
    u32 qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qa[kk], qs + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);

    // this thread's two rows (r and r + 8 of the warp's 16): their token positions and windows
    const int tw = (warp / gb) * 16, r0 = lane >> 2;
    int pos[2], lo[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int tok = tw + r0 + 8 * h;
        live[h] = tok < count;
        pos[h] = live[h] ? tok_pos[first + tok] : -1;
        lo[h] = window > 0 ? pos[h] - window + 1 : 0;
    }
    float o[D / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (int k0 = begin; k0 < end; k0 += BK) {
        for (int idx = threadIdx.x; idx < BK * C8; idx += 128) {
            const int j = idx / C8, c = idx % C8, p = k0 + j;
            uint4 kval = make_uint4(0, 0, 0, 0), vval = kval;
            const int page = p < end ? table[p / page_size] : -1;
            if (page >= 0) {
                const i64 row = ((i64)page * page_size + p % page_size) * kv_heads + kvh;
                kval = kv_f16x8<D>(kc, ksc, row, c * 8);
                vval = kv_f16x8<D>(vc, vsc, row, c * 8);
            }
            *(uint4*)(ks + j * LD + c * 8) = kval;
            *(uint4*)(vs + j * LD + c * 8) = vval;
        }
        __syncthreads();
        // S = Q K^T for this warp's 16 rows x BK keys (BK / 8 tiles of 8 keys)
        float s[BK / 8][4];
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < BK / 16; ++np) {
                u32 t4[4];
                ldmatrix_x4(t4, ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
                mma_f16(s[2 * np], qa[kk], t4[0], t4[1]);
                mma_f16(s[2 * np + 1], qa[kk], t4[2], t4[3]);
            }
        }
        // mask, soft-cap, online softmax: s[nt][2h + e] is row r0 + 8h, key k0 + nt * 8 + 2 (lane & 3) + e
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + nt * 8 + 2 * (lane & 3) + e;
                    float v = s[nt][2 * h + e];
                    if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
                    v = (live[h] && key <= pos[h] && key >= lo[h]) ? v : NEG_INF;
                    s[nt][2 * h + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            const float mn = fmaxf(m[h], mx);
            const float corr = mn == NEG_INF ? 1.0f : expf(m[h] - mn);
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float v = s[nt][2 * h + e];
                    const float p = v == NEG_INF ? 0.0f : expf(v - mn);
                    s[nt][2 * h + e] = p;
                    sum += p;
                }
            l[h] = l[h] * corr + sum;  // this thread's share of the row sum; the quad adds up at the end
            m[h] = mn;
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o[i][2 * h] *= corr;
                o[i][2 * h + 1] *= corr;
            }
        }
        // O += P V: P's accumulator layout is the A operand's once packed to f16 pairs
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const u32 pa[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]), pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                               pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 t4[4];
                ldmatrix_x4_trans(t4, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8);
                mma_f16(o[2 * dp], pa, t4[0], t4[1]);
                mma_f16(o[2 * dp + 1], pa, t4[2], t4[3]);
            }
        }
        __syncthreads();
    }

    const int g = chunk * gb + warp % gb;
    if (g >= group) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float total = quad_sum(l[h]);
        if (!live[h]) continue;
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        float* dst = out + ((i64)(first + tw + r0 + 8 * h) * heads + (i64)kvh * group + g) * D + 2 * (lane & 3);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) *(float2*)(dst + i * 8) = make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
    }
}

// Decode attention on tensor cores (backend.py's ATTENTION_TC_MIN_GROUP; LEAT_CUDA_ATTENTION_TC=0: never): ops.cu's
// attention (a block one token, one KV head and split z of the token's range, cut by token_range) with up to 16 of
// the KV head's query heads (heads g0 ... g0 + 15 of its group, g0 = 16 (blockIdx.y / kv_heads)) as mma.sync's rows. Each warp takes its own
// runs of 16 keys (runs warp, warp + 4, ... of the split; K and V through the warp's own shared tiles, the next run's
// loads in registers meanwhile) and keeps its own online softmax, as flash_attention's warps do for their rows; the
// 4 warps' (max, sum, values) are merged at the end as kv.cuh's attention_store merges them, which writes the output
// (sinks joined) or the split's partial sums the same way. q times scale and the probabilities in f16, as
// flash_attention; sums in float32; soft-capping as attention.
template <typename KV, int D>
__global__ void __launch_bounds__(128) attention_tc(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc, const u16* __restrict__ ksc,
    const u16* __restrict__ vsc, const int* __restrict__ page_table, const int* __restrict__ tok_slot,
    const int* __restrict__ tok_pos, float* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
    int heads, int kv_heads, int pages_per_slot, int page_size, int window, int keys, float scale, float softcap,
    const float* __restrict__ sinks) {
    constexpr int BK = 16, LD = D + 8, C8 = D / 8, PER = BK * C8 / 32;  // PER: a lane's 16-byte pieces of a run's K
    static_assert(4 * 16 * D * 4 <= 4 * 2 * BK * LD * 2, "the merge's values fit in the warps' tiles");
    __shared__ __align__(16) u16 qs[16 * LD];
    __shared__ __align__(16) u16 tiles[4][2][BK * LD];  // each warp's K and V
    __shared__ float merge_m[4][16], merge_l[4][16];
    const int t = blockIdx.x, kvh = blockIdx.y % kv_heads, g0 = (blockIdx.y / kv_heads) * 16;
    const int z = blockIdx.z, nsplit = gridDim.z, group = heads / kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r0 = lane >> 2;
    int begin, end;
    const int* table = token_range(tok_slot, tok_pos, page_table, pages_per_slot, window, keys, begin, end);
    u16 *kt = tiles[warp][0], *vt = tiles[warp][1];

    uint4 kn[PER], vn[PER];  // the warp's next run of keys and values
    auto fetch = [&](int k0) {
        // lane j < 16 looks up key k0 + j's cache row (one page-table load and division a lane, not one a piece);
        // a piece takes its key's by shuffle
        const int pj = min(k0 + (lane & 15), end - 1);
        const int mine = (table[pj / page_size] * page_size + pj % page_size) * kv_heads + kvh;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int idx = lane + 32 * i, j = idx / C8, c = idx % C8;
            const int row = __shfl_sync(FULL_MASK, mine, j);
            kn[i] = vn[i] = make_uint4(0, 0, 0, 0);
            if (k0 + j < end) {
                kn[i] = kv_f16x8<D>(kc, ksc, row, c * 8);
                vn[i] = kv_f16x8<D>(vc, vsc, row, c * 8);
            }
        }
    };
    const int first = begin + BK * warp;
    if (first < end) fetch(first);

    // queries: row r of qs is head g0 + r of the KV head's group, times scale, in f16 (zeros past the group)
    for (int idx = threadIdx.x; idx < 16 * C8; idx += 128) {
        const int r = idx / C8, c = idx % C8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (g0 + r < group) {
            val = f16x8_scaled(q + ((i64)t * heads + (i64)kvh * group + g0 + r) * D + c * 8, scale);
        }
        *(uint4*)(qs + r * LD + c * 8) = val;
    }
    __syncthreads();
    u32 qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qa[kk], qs + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);

    // o[i][2h + e]: row r0 + 8h, value dim 8i + 2 (lane & 3) + e; m and l: rows r0 and r0 + 8 (l a quad's share)
    float o[D / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    for (int k0 = first; k0 < end; k0 += 4 * BK) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int idx = lane + 32 * i, at = (idx / C8) * LD + (idx % C8) * 8;
            *(uint4*)(kt + at) = kn[i];
            *(uint4*)(vt + at) = vn[i];
        }
        __syncwarp();
        if (k0 + 4 * BK < end) fetch(k0 + 4 * BK);  // in flight while this run is worked on
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 t4[4];
            ldmatrix_x4(t4, kt + ((lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_f16(s[0], qa[kk], t4[0], t4[1]);
            mma_f16(s[1], qa[kk], t4[2], t4[3]);
        }
        // soft-cap, the run's keys past `end` masked (s[nt][2h + e]: row r0 + 8h, key nt * 8 + 2 (lane & 3) + e),
        // online softmax
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v = s[nt][i];
                if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
                s[nt][i] = k0 + nt * 8 + 2 * (lane & 3) + (i & 1) < end ? v : NEG_INF;
            }
        softmax_tiles(s, m, l, o);
        pv_tiles<D / 8, LD>(s, vt, 0, o);
        __syncwarp();  // the next run overwrites kt and vt
    }

    // the 4 warps merged (their tiles hold their values now): attention_store's arithmetic
    __syncthreads();
    float* values = (float*)&tiles[0][0][0];  // [warp][row][D]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float total = quad_sum(l[h]);
        const int row = r0 + 8 * h;
        if ((lane & 3) == 0) {
            merge_m[warp][row] = m[h];
            merge_l[warp][row] = total;
        }
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
            *(float2*)(values + (warp * 16 + row) * D + 8 * i + 2 * (lane & 3)) = make_float2(o[i][2 * h], o[i][2 * h + 1]);
    }
    __syncthreads();
    const int live = min(16, group - g0);
    for (int idx = threadIdx.x; idx < live * D; idx += 128) {
        const int r = idx / D, d = idx % D;
        merge_warps([&](int w) { return merge_m[w][r]; }, [&](int w) { return merge_l[w][r]; },
                    [&](int w) { return values[(w * 16 + r) * D + d]; }, (i64)t * heads + (i64)kvh * group + g0 + r,
                    d, heads, D, z, nsplit, sinks, out, part_ml, part_acc);
    }
}
