// Kernels over quantized weights, instantiated once per GGUF type (the type struct T from
// quants.cuh): matrix-vector products for a few tokens, a tensor-core GEMM for many, embedding
// rows, and a plain dequantization (the one tested bit for bit against gguf-py).
//
// Weights W are [M, K] row-major (GGUF order), activations X [N, K] float32, outputs Y [N, M].
#include "runs.cuh"
#include "kv.cuh"  // rope_pair, for the ROPE epilogue
#include "mma.cuh"

// Y = X W^T (+ bias) for N = NC tokens. Each warp computes R output rows; its lanes stride over
// the units of the row, issuing the loads of U units (per row) before decoding any. Accumulation
// is float32 throughout; a weight is decoded once and used for all NC tokens.
template <class T, int NC, int R, int U>
__global__ void __launch_bounds__(128) gemv(const u8* __restrict__ w, i64 nb, const float* __restrict__ x,
                                            float* __restrict__ y, const float* __restrict__ bias, int M, int K) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * R;
    if (row0 >= M) return;
    const int bpr = K / T::BLOCK, upr = bpr * T::UNITS;
    i64 first[R];
#pragma unroll
    for (int r = 0; r < R; ++r) first[r] = (i64)min(row0 + r, M - 1) * bpr;
    float acc[R][NC];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;

    for (int base = lane; base < upr; base += 32 * U) {
        typename T::Raw raw[U][R];
        load_units<T, U, R, R>(raw, w, w, nb, first, base, upr);
#pragma unroll
        for (int s = 0; s < U; ++s) {
            const int u = base + 32 * s;
            if (u < upr) {
                const int unit = u % T::UNITS;
                const float* xb = x + (i64)(u / T::UNITS) * T::BLOCK;
                float v[R][T::UV];
#pragma unroll
                for (int r = 0; r < R; ++r) T::template decode<false>(raw[s][r], unit, v[r]);
#pragma unroll
                for (int run = 0; run < T::NR; ++run) {
                    const int off = T::run_offset(unit, run);
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        const float4* xp = (const float4*)(xb + (i64)c * K + off);
#pragma unroll
                        for (int q = 0; q < T::RL / 4; ++q) {
                            const float4 xv = __ldg(xp + q);
#pragma unroll
                            for (int r = 0; r < R; ++r) {
                                const float* vr = v[r] + run * T::RL + 4 * q;
                                acc[r][c] = fmaf(vr[0], xv.x, acc[r][c]);
                                acc[r][c] = fmaf(vr[1], xv.y, acc[r][c]);
                                acc[r][c] = fmaf(vr[2], xv.z, acc[r][c]);
                                acc[r][c] = fmaf(vr[3], xv.w, acc[r][c]);
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float total = warp_sum(acc[r][c]);
            if (lane == 0 && row0 + r < M) y[(i64)c * M + row0 + r] = total + (bias ? bias[row0 + r] : 0.0f);
        }
    }
}


// The matrix-vector product with integer dot products, for quantized weights. First the block
// rounds its NC rows of x to int16 in shared memory, each run of each unit with its own scale
// (quants.cuh's quantize_runs). Then as gemv, with T::dot (dp2a) in place of decode-and-FMA.
//
// MODE fuses neighbours into the product: with NORM, x is RMS-normalized first (x * rsqrt(mean(x^2)
// + eps) * nw, as rms_norm): the block quantizes x * nw, sums x^2 in the same pass, and scales each
// row's dot products by the rsqrt at the end, which is exact in the scales (they are linear in x).
// With GLU it multiplies x by two matrices, w (gate) and w2 (up), and writes silu(gate) * up.
// `res` (or null) is added to the output (a residual connection), after the bias.
//
// Without GLU, up to three matrices of the same type and row length (q, k and v) are done in one
// launch: segment s is (w, nb, y, bias, M) for s = 0 and the numbered parameters for s = 1, 2
// (M2 = M3 = 0 when unused). The grid is persistent: each block loops over groups of 4R rows of
// every segment, so x is quantized once per block, not once per 4R rows.
//
// With PIPE (a variant, not a fusion) a warp issues the loads of its next step (the next U units of its rows, or
// the first of its next group's) before the dot products of the current one, so its loads stay in flight while it
// computes; the sums are the same, in the same order.
//
// With ROPE (one token a launch; not with GLU or PIPE; R even) the rows do not all go to y: segment s's role,
// (roles >> 2s) & 3, is 0 (to its y, as without ROPE), 1 (q: rotated pair by pair, rows 2i and 2i + 1 of each head of
// `head_dim` rows, into its y), 2 (k: rotated the same way, into the cache's K rows) or 3 (v: into the cache's V
// rows of `dv`): rope_kv_write's values bit for bit (rope_pair; kv_put's f16 rounding), with no launch of its own.
//
// With SPLIT (a variant, not a fusion; not with PIPE) a block has 8 warps, and warps w and w + 4 share the
// same rows, each taking every other step of the units: twice the warps in flight for the same prologue, where few
// rows leave the multiprocessors short of warps. Warp w + 4 adds its sums to warp w's through shared memory, after
// x's runs, and warp w alone writes the rows. The sums are added in another order than without SPLIT. It pays only
// where a warp has two steps of units or more (a pair with one step leaves its second warp without units).
#define NORM 1
#define GLU 2
#define PIPE 4
#define ROPE 16
#define SPLIT 32

// Where gemv_q's ROPE epilogue puts its rows: the token's rotation (its RoPE position, the float64 frequencies, the
// rotated dimensions of a head and the factor) and its cache row (its position in its page, the caches: f16 or
// float32; the page is looked up once a launch).
struct RopeWrite {
    const int *tok_pos, *rope_pos;
    const double* inv_freq;
    void *kc, *vc;
    int kv_f16, head_dim, dims, page_size;
    float magnitude;
};

// The ROPE epilogue of a warp's R rows (row0 even; the sums and norm factor as gemv_q_rows_out makes them): lane
// j < R / 2 takes pair j (rows row0 + 2j, row0 + 2j + 1) for q and k, lane j < R row row0 + j for v.
template <int R, int MODE>
__device__ __forceinline__ void gemv_q_rope_out(const float (&acc)[R][1], float* ys, const float* bs, int Ms, int row0,
                                                int role, const float (&rnorm)[1], int lane, const RopeWrite& rw,
                                                int page) {
    float tot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float total = warp_sum(acc[r][0]);
        if (MODE & NORM) total *= rnorm[0];
        tot[r] = total + (bs ? bs[min(row0 + r, Ms - 1)] : 0.0f) + 0.0f;  // gemv_q_rows_out's value (no residual)
    }
    // the token's cache entry (its heads adjoin: Ms values a position), and a value into it as f16 or float32
    auto entry = [&]() { return ((i64)page * rw.page_size + rw.tok_pos[0] % rw.page_size) * Ms; };
    auto put = [&](void* cache, i64 at, float value) {
        if (rw.kv_f16) ((u16*)cache)[at] = f32_to_f16(value);
        else ((float*)cache)[at] = value;
    };
    if (role == 3) {  // v: row row0 + lane into the cache
        float x = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) x = lane == r ? tot[r] : x;
        if (lane < R && row0 + lane < Ms && page >= 0) put(rw.vc, entry() + row0 + lane, x);
        return;
    }
    float xa = 0.0f, xb = 0.0f;
#pragma unroll
    for (int j = 0; j < R / 2; ++j) {
        xa = lane == j ? tot[2 * j] : xa;
        xb = lane == j ? tot[2 * j + 1] : xb;
    }
    const int row = row0 + 2 * lane, d = row % rw.head_dim;
    if (lane >= R / 2 || row >= Ms) return;
    float ya = xa, yb = xb;  // dimensions past `dims` are copied
    if (d < rw.dims) rope_pair(xa, xb, (double)rw.rope_pos[0] * rw.inv_freq[d / 2], rw.magnitude, ya, yb);
    if (role == 1) {
        ys[row] = ya;
        ys[row + 1] = yb;
    } else if (page >= 0) {  // k into the cache
        const i64 at = entry() + row;
        put(rw.kc, at, ya);
        put(rw.kc, at + 1, yb);
    }
}

// Where a warp of a gemv_q block works in a group of rows, for the pipelined loop (which holds the current group's
// and the next one's): the segment (0-2) and its matrices (ws; wu, the gated unit's up matrix), output, bias and
// rows; the warp's first row and each of its R rows' first block.
template <int R, int MODE>
struct GemvRows {
    int seg, Ms, row0;
    const u8 *ws, *wu;
    i64 nbs;
    float* ys;
    const float* bs;
    i64 first[R];
    // false where the group's rows for this warp lie past its segment's last row
    __device__ __forceinline__ bool at(int group, int g1, int g2, const u8* w, const u8* w2, const u8* w3, i64 nb,
                                       i64 nb2, i64 nb3, float* y, float* y2, float* y3, const float* bias,
                                       const float* bias2, const float* bias3, int M, int M2, int M3, int bpr) {
        seg = group < g1 ? 0 : group < g2 ? 1 : 2;
        ws = seg == 0 ? w : seg == 1 ? w2 : w3;
        wu = (MODE & GLU) ? w2 : ws;
        nbs = seg == 0 ? nb : seg == 1 ? nb2 : nb3;
        ys = seg == 0 ? y : seg == 1 ? y2 : y3;
        bs = seg == 0 ? bias : seg == 1 ? bias2 : bias3;
        Ms = seg == 0 ? M : seg == 1 ? M2 : M3;
        row0 = ((group - (seg == 0 ? 0 : seg == 1 ? g1 : g2)) * 4 + (threadIdx.x >> 5)) * R;
#pragma unroll
        for (int r = 0; r < R; ++r) first[r] = (i64)min(row0 + r, Ms - 1) * bpr;
        return row0 < Ms;
    }
};

// A lane's dot products of its U units from `base` (their weights in raw) with x, added to acc.
template <class T, int NC, int U, int RR>
__device__ __forceinline__ void gemv_q_step(const typename T::Raw (&raw)[U][RR], int base, int upr,
                                            const uint4* xsh, int lines, int lane, float (&acc)[RR][NC]) {
#pragma unroll
    for (int s = 0; s < U; ++s) {
        const int u = base + 32 * s;
        if (u < upr) {
            const int unit = u % T::UNITS;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                u32 xw[T::UV / 2];
                float xsr[T::NR], xsumr[T::NR];
                unit_x<T, NC>(xsh, lines, c * lines + (u >> 5), lane, xw, xsr, xsumr);
#pragma unroll
                for (int r = 0; r < RR; ++r) acc[r][c] += T::dot(raw[s][r], unit, xw, xsr, xsumr);
            }
        }
    }
}

// The warp's rows done: sums over the lanes, the norm's factor, the gated unit, bias and residual.
template <int NC, int R, int RR, int MODE>
__device__ __forceinline__ void gemv_q_rows_out(const float (&acc)[RR][NC], float* ys, const float* bs, int Ms, int row0,
                                                bool first_segment, const float (&rnorm)[NC],
                                                const float* __restrict__ res, int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            float total = warp_sum(acc[r][c]);
            if (MODE & NORM) total *= rnorm[c];
            if (MODE & GLU) {
                float up = warp_sum(acc[r + R][c]);
                if (MODE & NORM) up *= rnorm[c];
                total = total / (1.0f + expf(-total)) * up;
            }
            const i64 at = (i64)c * Ms + row0 + r;
            if (lane == 0 && row0 + r < Ms)
                ys[at] = total + (bs ? bs[row0 + r] : 0.0f) + (res && first_segment ? res[at] : 0.0f);
        }
    }
}

template <class T, int NC, int R, int U, int MODE>
__global__ void __launch_bounds__((MODE & SPLIT) ? 256 : 128) gemv_q(
    const u8* __restrict__ w, const u8* __restrict__ w2, const u8* __restrict__ w3, i64 nb, i64 nb2, i64 nb3,
    const float* __restrict__ x, float* __restrict__ y, float* __restrict__ y2, float* __restrict__ y3,
    const float* __restrict__ bias, const float* __restrict__ bias2, const float* __restrict__ bias3,
    const float* __restrict__ res, const float* __restrict__ nw, float eps, int M, int M2, int M3, int K, int roles,
    const int* __restrict__ tok_slot, const int* __restrict__ tok_pos, const int* __restrict__ page_table,
    const int* __restrict__ rope_pos, const double* __restrict__ inv_freq, void* kc, void* vc, int kv_f16,
    int head_dim, int dims, int pages_per_slot, int page_size, float magnitude) {
    constexpr int RR = (MODE & GLU) ? 2 * R : R;
    static_assert(!(MODE & ROPE) || (NC == 1 && !(MODE & (GLU | PIPE)) && R % 2 == 0), "ROPE: one token, R even");
    static_assert(!((MODE & SPLIT) && (MODE & PIPE)), "SPLIT: the plain loop");
    extern __shared__ uint4 xsh[];
    const int bpr = K / T::BLOCK, upr = bpr * T::UNITS, lines = (upr + 31) >> 5;
    int page = -1;  // ROPE: the token's cache page (loaded ahead: its loads overlap x's quantizing)
    if constexpr ((MODE & ROPE) != 0) {
        const int slot = tok_slot[0];
        if (slot >= 0) page = page_table[(i64)slot * pages_per_slot + tok_pos[0] / page_size];
    }
    float squares[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) squares[c] = 0.0f;
    quantize_runs<T, NC, (MODE & NORM) != 0>(x, K, nw, xsh, squares);
    float rnorm[NC];
    if (MODE & NORM) {
#pragma unroll
        for (int c = 0; c < NC; ++c) rnorm[c] = 1.0f / sqrtf(block_sum(squares[c]) / K + eps);
    }
    __syncthreads();

    const int lane = threadIdx.x & 31;
    const int g1 = (M + 4 * R - 1) / (4 * R), g2 = g1 + (M2 + 4 * R - 1) / (4 * R), groups = g2 + (M3 + 4 * R - 1) / (4 * R);
#define GEMV_Q_AT(rows, g) rows.at(g, g1, g2, w, w2, w3, nb, nb2, nb3, y, y2, y3, bias, bias2, bias3, M, M2, M3, bpr)
#define GEMV_Q_ZERO \
    _Pragma("unroll") for (int r = 0; r < RR; ++r) _Pragma("unroll") for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f
    if constexpr ((MODE & PIPE) == 0) {
        // SPLIT: warps quad and quad + 4 take the same rows, part 0 the even steps of the units, part 1 the odd ones
        // (without it, 4 warps a block: quad is the warp)
        constexpr int KS = (MODE & SPLIT) ? 2 : 1;
        const int warp = threadIdx.x >> 5;
        const int quad = (MODE & SPLIT) ? warp & 3 : warp, part = (MODE & SPLIT) ? warp >> 2 : 0;
        // SPLIT: part 1's sums for part 0, in shared memory after x's runs and sums
        float* red = (float*)(xsh + NC * lines * (T::UV / 8) * 32) + 2 * NC * lines * T::NR * 32;
        for (int group = blockIdx.x; group < groups; group += gridDim.x) {
            // GemvRows::at's work written out: through the struct NVRTC 13 gives the gated unit (1 x 2) 117 registers
            // for sm_90 where this takes 96
            const int seg = group < g1 ? 0 : group < g2 ? 1 : 2;
            const u8* ws = seg == 0 ? w : seg == 1 ? w2 : w3;
            const u8* wu = (MODE & GLU) ? w2 : ws;
            const i64 nbs = seg == 0 ? nb : seg == 1 ? nb2 : nb3;
            float* ys = seg == 0 ? y : seg == 1 ? y2 : y3;
            const float* bs = seg == 0 ? bias : seg == 1 ? bias2 : bias3;
            const int Ms = seg == 0 ? M : seg == 1 ? M2 : M3;
            const int row0 = ((group - (seg == 0 ? 0 : seg == 1 ? g1 : g2)) * 4 + quad) * R;
            // a warp past its segment's last row has nothing to do; with SPLIT it still meets the block's barriers
            if constexpr (KS == 1) {
                if (row0 >= Ms) continue;
            }
            const int end = KS == 1 || row0 < Ms ? upr : 0;
            i64 first[R];
#pragma unroll
            for (int r = 0; r < R; ++r) first[r] = (i64)min(row0 + r, Ms - 1) * bpr;
            float acc[RR][NC];  // a lane's sums for its warp's rows
            GEMV_Q_ZERO;
            for (int base = lane + 32 * U * part; base < end; base += 32 * U * KS) {
                typename T::Raw raw[U][RR];
                load_units<T, U, RR, R>(raw, ws, wu, nbs, first, base, upr);
                gemv_q_step<T, NC, U, RR>(raw, base, upr, xsh, lines, lane, acc);
            }
            if constexpr (KS == 2) {  // part 1's sums into part 0's
                if (part == 1) {
#pragma unroll
                    for (int r = 0; r < RR; ++r)
#pragma unroll
                        for (int c = 0; c < NC; ++c) red[((quad * RR + r) * NC + c) * 32 + lane] = acc[r][c];
                }
                __syncthreads();
                if (part == 0) {
#pragma unroll
                    for (int r = 0; r < RR; ++r)
#pragma unroll
                        for (int c = 0; c < NC; ++c) acc[r][c] += red[((quad * RR + r) * NC + c) * 32 + lane];
                }
                __syncthreads();  // read before the next group's sums are written
                if (part == 1 || row0 >= Ms) continue;
            }
            const int role = (MODE & ROPE) ? (roles >> (2 * seg)) & 3 : 0;
            if constexpr ((MODE & ROPE) != 0) {
                if (role != 0) {
                    const RopeWrite rw{tok_pos, rope_pos, inv_freq, kc, vc, kv_f16, head_dim, dims, page_size, magnitude};
                    gemv_q_rope_out<R, MODE>(acc, ys, bs, Ms, row0, role, rnorm, lane, rw, page);
                    continue;
                }
            }
            gemv_q_rows_out<NC, R, RR, MODE>(acc, ys, bs, Ms, row0, seg == 0, rnorm, res, lane);
        }
    } else {
        const int steps = (upr + 32 * U - 1) / (32 * U);  // a group's steps, the same for every lane
        int group = blockIdx.x;
        GemvRows<R, MODE> at;
        while (group < groups && !GEMV_Q_AT(at, group)) group += gridDim.x;
        if (group >= groups) return;
        GemvRows<R, MODE> next = at;
        float acc[RR][NC];
        GEMV_Q_ZERO;
        typename T::Raw raw[U][RR], ahead[U][RR];
        load_units<T, U, RR, R>(raw, at.ws, at.wu, at.nbs, at.first, lane, upr);
        for (int step = 0;;) {
            int coming = step + 1;
            bool more = true;
            if (coming == steps) {  // the next group with rows for this warp, if any
                coming = 0;
                do group += gridDim.x;
                while (group < groups && !GEMV_Q_AT(next, group));
                more = group < groups;
            }
            if (more) load_units<T, U, RR, R>(ahead, next.ws, next.wu, next.nbs, next.first, lane + 32 * U * coming, upr);
            gemv_q_step<T, NC, U, RR>(raw, lane + 32 * U * step, upr, xsh, lines, lane, acc);
            if (step == steps - 1) {
                gemv_q_rows_out<NC, R, RR, MODE>(acc, at.ys, at.bs, at.Ms, at.row0, at.seg == 0, rnorm, res, lane);
                GEMV_Q_ZERO;
            }
            if (!more) break;
#pragma unroll
            for (int s = 0; s < U; ++s)
#pragma unroll
                for (int r = 0; r < RR; ++r) raw[s][r] = ahead[s][r];
            at = next;
            step = coming;
        }
    }
#undef GEMV_Q_AT
#undef GEMV_Q_ZERO
}

// Y = X W^T (+ bias) for a few tokens (up to 8 * NT) on tensor cores, each weight read once: the
// matrix-vector kernels' access pattern with mma.sync m16n8k16 in place of FMA. A block owns 16 * RT
// weight rows; its 8 warps share out the rows' units, four consecutive units per step (one per lane
// of a quad), and add their partial products in shared memory at the end. A lane (g = lane / 4,
// t = lane % 4) decodes unit 4s + t of rows g and g + 8 of each row tile straight into A fragments:
// k-step j takes the quad's values 4j..4j+3, lane t's at fragment columns 2t, 2t + 1, 2t + 8, 2t + 9.
// That is a permutation of k, and the B fragments (x as f16: x_to_f16's rows, `xscale` undoes their
// scaling) follow it: lane t loads x at the same four places, 8 bytes, once for all RT row tiles.
// No weight goes through shared memory and no tile is decoded for tokens that are not there.
// With GATED the block also multiplies the same rows of w2 (up; w is the gate): the x fragments serve
// both, and it writes silu(gate) * up (as silu_mul) instead of the two products.
template <class T, int NT, int RT, bool GATED>
__global__ void __launch_bounds__(256) gemm_few(const u8* __restrict__ w, const u8* __restrict__ w2, i64 nb,
                                                const u16* __restrict__ xh, const float* __restrict__ xscale,
                                                float* __restrict__ y, const float* __restrict__ bias, int M, int N,
                                                int K) {
    constexpr int WARPS = 8, J = T::UV / 4, RS = GATED ? 2 * RT : RT, C = RS * NT * 4, OUT = RT * NT * 4 * 32;
    extern __shared__ float partial[];  // [WARPS][C][32]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * 16 * RT;
    const int bpr = K / T::BLOCK, upr = bpr * T::UNITS, steps = (upr + 3) >> 2;
    i64 first[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) first[rt][h] = (i64)min(m0 + 16 * rt + g + 8 * h, M - 1) * bpr;
    const u16* xrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xrow[nt] = xh + (i64)min(8 * nt + g, N - 1) * K;
    float acc[RS][NT][4];
#pragma unroll
    for (int rs = 0; rs < RS; ++rs)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[rs][nt][c] = 0.0f;

    for (int s = warp; s < steps; s += WARPS) {
        const int u = 4 * s + t, uc = min(u, upr - 1);
        const int blk = uc / T::UNITS, unit = uc % T::UNITS;
        const float keep = u < upr ? 1.0f : 0.0f;  // a row's last step may run past its units
        typename T::Raw raw[RS][2];
#pragma unroll
        for (int rs = 0; rs < RS; ++rs)
#pragma unroll
            for (int h = 0; h < 2; ++h) raw[rs][h] = T::load(rs < RT ? w : w2, nb, first[rs % RT][h] + blk, unit);
        u32 a[RS][J][4];  // the unit decoded once, as the A fragments of its J k-steps
#pragma unroll
        for (int rs = 0; rs < RS; ++rs) unit_fragments<T>(raw[rs][0], raw[rs][1], unit, keep, a[rs]);
        const i64 base = (i64)blk * T::BLOCK;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const i64 at = base + T::run_offset(unit, 4 * j / T::RL) + (4 * j) % T::RL;
            uint2 b[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) b[nt] = __ldg((const uint2*)(xrow[nt] + at));
#pragma unroll
            for (int rs = 0; rs < RS; ++rs)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_f16(acc[rs][nt], a[rs][j], b[nt].x, b[nt].y);
        }
    }
#pragma unroll
    for (int rs = 0; rs < RS; ++rs)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) partial[(warp * C + (rs * NT + nt) * 4 + c) * 32 + lane] = acc[rs][nt][c];
    __syncthreads();
    for (int i = threadIdx.x; i < OUT; i += 32 * WARPS) {  // the up tiles follow the gate tiles, OUT later
        float sum = 0.0f, up = 0.0f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) {
            sum += partial[v * C * 32 + i];
            if (GATED) up += partial[v * C * 32 + OUT + i];
        }
        const int l = i & 31, c = (i >> 5) & 3, tile = i >> 7, nt = tile % NT, rt = tile / NT;
        const int row = m0 + 16 * rt + (l >> 2) + 8 * (c >> 1), token = 8 * nt + 2 * (l & 3) + (c & 1);
        if (row >= M || token >= N) continue;
        const float total = sum * xscale[token];
        y[(i64)token * M + row] =
            GATED ? total / (1.0f + expf(-total)) * (up * xscale[token]) : total + (bias ? bias[row] : 0.0f);
    }
}

// Y = X W^T (+ bias) for up to 8 * NT tokens a block column (blockIdx.z: which 8 * NT tokens), on tensor
// cores, each weight decoded once straight into A fragments as gemm_few does, but with x staged in shared
// memory ROWS_KC values of K at a time and shared by the block's 4 warps, each of which owns RT row tiles of
// 16 rows: x is read from L2 once per 64 * RT rows (gemm_few: once per 16 * RT), and no weight goes through
// shared memory (the GEMM decodes its tiles there and reads them back with ldmatrix, which bounds it at 33-128
// tokens). Split K: block y covers K from y * kchunk (a multiple of ROWS_KC) and writes its partial sums to
// y + blockIdx.y * N * M (bias in part 0 only) for splitk_sum.
#define ROWS_KC 256
template <class T, int NT, int RT>
__global__ void __launch_bounds__(128) gemm_rows(const u8* __restrict__ w, i64 nb, const u16* __restrict__ xh,
                                                 const float* __restrict__ xscale, float* __restrict__ y,
                                                 const float* __restrict__ bias, int M, int N, int K, int kchunk) {
    constexpr int J = T::UV / 4, LD = ROWS_KC + 8, STEPS = ROWS_KC / T::UV / 4;
    static_assert(ROWS_KC % (4 * T::UV) == 0, "a chunk of K holds whole quad steps");
    __shared__ __align__(16) u16 xs[8 * NT][LD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = (blockIdx.x * 4 + warp) * 16 * RT, n0 = blockIdx.z * 8 * NT;
    const int bpr = K / T::BLOCK, kbegin = blockIdx.y * kchunk, kend = min(K, kbegin + kchunk);
    if (blockIdx.y > 0) {
        y += (i64)blockIdx.y * N * M;
        bias = nullptr;
    }
    i64 first[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) first[rt][h] = (i64)min(m0 + 16 * rt + g + 8 * h, M - 1) * bpr;
    float acc[RT][NT][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[rt][nt][c] = 0.0f;
    for (int k0 = kbegin; k0 < kend; k0 += ROWS_KC) {
        __syncthreads();  // the last chunk's x has been read
        for (int idx = threadIdx.x; idx < 8 * NT * (ROWS_KC / 8); idx += 128) {
            const int tok = idx / (ROWS_KC / 8), c = idx % (ROWS_KC / 8);
            uint4 val = make_uint4(0, 0, 0, 0);
            if (n0 + tok < N) val = __ldg((const uint4*)(xh + (i64)(n0 + tok) * K + k0) + c);
            *(uint4*)&xs[tok][8 * c] = val;
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            const int u = 4 * s + t;  // the chunk's unit u: its block, its unit within the block
            const int blk = k0 / T::BLOCK + u / T::UNITS, unit = u % T::UNITS;
            typename T::Raw raw[RT][2];
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int h = 0; h < 2; ++h) raw[rt][h] = T::load(w, nb, first[rt][h] + blk, unit);
            u32 a[RT][J][4];
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) unit_fragments<T>(raw[rt][0], raw[rt][1], unit, 1.0f, a[rt]);
            const int base = (u / T::UNITS) * T::BLOCK;  // the unit's block, from the chunk's start
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const int at = base + T::run_offset(unit, 4 * j / T::RL) + (4 * j) % T::RL;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const uint2 b = *(const uint2*)&xs[8 * nt + g][at];
#pragma unroll
                    for (int rt = 0; rt < RT; ++rt) mma_f16(acc[rt][nt], a[rt][j], b.x, b.y);
                }
            }
        }
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = m0 + 16 * rt + g + 8 * (c >> 1), token = n0 + 8 * nt + 2 * t + (c & 1);
                if (row < M && token < N) y[(i64)token * M + row] = acc[rt][nt][c] * xscale[token] + (bias ? bias[row] : 0.0f);
            }
}

// One unit of a block decoded to f16 at its places in `dst` (the block's first value), 16-byte stores:
// the GEMM's shared-memory tile and dequantize_f16's rows alike.
template <class T>
__device__ __forceinline__ void decode_f16(const typename T::Raw& raw, int unit, u16* dst) {
    float v[T::UV];
    T::template decode<false>(raw, unit, v);
#pragma unroll
    for (int run = 0; run < T::NR; ++run) {
        const int off = T::run_offset(unit, run);
#pragma unroll
        for (int i = 0; i < T::RL; i += 8) {
            const float* s = v + run * T::RL + i;
            *(uint4*)(dst + off + i) = make_uint4(pack_f16x2(s[0], s[1]), pack_f16x2(s[2], s[3]),
                                                  pack_f16x2(s[4], s[5]), pack_f16x2(s[6], s[7]));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core GEMM for many tokens: Y = X W^T (+ bias), X given as f16 rows scaled by powers of
// two (x_to_f16 in ops.cu; `xscale` undoes the scaling). Each block computes 128 weight rows x 64
// tokens, stepping K by KT: the weight tile is decoded to f16 in shared memory, the token tile
// copied there, and 8 warps (4 x 2) each multiply a 32 x 32 piece with mma.sync m16n8k16
// (f16 inputs, f32 accumulation). Shared-memory rows are padded by 16 bytes so ldmatrix's eight
// row addresses fall in distinct banks. Split K: block z covers K from z * kchunk and writes its
// partial sums to y + z * N * M (bias in part 0 only) for splitk_sum to add up.

template <class T, int KT>
__global__ void __launch_bounds__(256, 2) gemm(const u8* __restrict__ w, i64 nb, const u16* __restrict__ xh,
                                            const float* __restrict__ xscale, float* __restrict__ y,
                                            const float* __restrict__ bias, int M, int N, int K, int kchunk) {
    constexpr int BM = 128, BN = 64, LD = KT + 8;
    constexpr int TB = KT / T::BLOCK, UPR = TB * T::UNITS;  // quant blocks, units per tile row
    extern __shared__ __align__(16) u16 smem[];
    u16* ws = smem;
    u16* xs = smem + BM * LD;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wn = warp >> 2;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int bpr = K / T::BLOCK;
    float acc[2][4][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;

    const int kbegin = blockIdx.z * kchunk, kend = min(K, kbegin + kchunk);
    if (blockIdx.z > 0) {
        y += (i64)blockIdx.z * N * M;
        bias = nullptr;
    }
    // The weight units this thread stages per K step. When they fit in a few registers, the next
    // step's are fetched (from DRAM) before the current step's products, so the latency overlaps
    // them; the token rows (small, in L2) are read when staged.
    constexpr int UPT = BM * UPR / 256;
    constexpr bool PREFETCH = UPT > 0 && BM * UPR % 256 == 0 && UPT * sizeof(typename T::Raw) <= 160;
    typename T::Raw raw[PREFETCH ? UPT : 1];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int idx = tid + 256 * i, r = idx / UPR, b = (idx % UPR) / T::UNITS, unit = idx % T::UNITS;
            raw[i] = T::load(w, nb, (i64)min(m0 + r, M - 1) * bpr + k0 / T::BLOCK + b, unit);
        }
    };
    auto stage_unit = [&](int idx, const typename T::Raw& rw) {
        const int r = idx / UPR, b = (idx % UPR) / T::UNITS, unit = idx % T::UNITS;
        decode_f16<T>(rw, unit, ws + r * LD + b * T::BLOCK);
    };
    if (PREFETCH && kbegin < kend) fetch(kbegin);
    for (int k0 = kbegin; k0 < kend; k0 += KT) {
        if constexpr (PREFETCH) {
#pragma unroll
            for (int i = 0; i < UPT; ++i) stage_unit(tid + 256 * i, raw[i]);
        } else {
            for (int idx = tid; idx < BM * UPR; idx += 256) {
                const int r = idx / UPR, b = (idx % UPR) / T::UNITS, unit = idx % T::UNITS;
                stage_unit(idx, T::load(w, nb, (i64)min(m0 + r, M - 1) * bpr + k0 / T::BLOCK + b, unit));
            }
        }
        for (int idx = tid; idx < BN * (KT / 8); idx += 256) {
            const int t = idx / (KT / 8), c = idx % (KT / 8);
            uint4 val = make_uint4(0, 0, 0, 0);
            if (n0 + t < N) val = __ldg((const uint4*)(xh + (i64)(n0 + t) * K + k0) + c);
            *(uint4*)(xs + t * LD + c * 8) = val;
        }
        __syncthreads();
        if constexpr (PREFETCH) {
            if (k0 + KT < kend) fetch(k0 + KT);
        }
#pragma unroll 4
        for (int kk = 0; kk < KT; kk += 16) {
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(a[mt], ws + (wm * 32 + mt * 16 + (lane & 15)) * LD + kk + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                u32 t4[4];
                ldmatrix_x4(t4, xs + (wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk + ((lane >> 3) & 1) * 8);
                b[2 * np][0] = t4[0];
                b[2 * np][1] = t4[1];
                b[2 * np + 1][0] = t4[2];
                b[2 * np + 1][1] = t4[3];
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_f16(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + wm * 32 + mt * 16 + (lane >> 2) + 8 * h;
                if (m >= M) continue;
                const float b = bias ? bias[m] : 0.0f;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t = n0 + wn * 32 + nt * 8 + 2 * (lane & 3) + e;
                    if (t < N) y[(i64)t * M + m] = acc[mt][nt][2 * h + e] * xscale[t] + b;
                }
            }
}

// ---------------------------------------------------------------------------------------------

// All nb blocks as float32 values in order, rounded exactly as gguf-py's dequantize.
template <class T>
__global__ void dequantize(const u8* __restrict__ w, i64 nb, float* __restrict__ out) {
    const i64 gid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= nb * T::UNITS) return;
    const i64 blk = gid / T::UNITS;
    const int unit = gid % T::UNITS;
    float v[T::UV];
    T::template decode<true>(T::load(w, nb, blk, unit), unit, v);
    float* dst = out + blk * T::BLOCK;
#pragma unroll
    for (int run = 0; run < T::NR; ++run)
#pragma unroll
        for (int i = 0; i < T::RL; ++i) dst[T::run_offset(unit, run) + i] = v[run * T::RL + i];
}

// Blocks [first, first + count) as f16 values in order: the weight rows a cuBLAS product reads
// (cublas.py). 16-byte stores; values rounded once, from the float decode, to f16.
template <class T>
__global__ void dequantize_f16(const u8* __restrict__ w, i64 nb, u16* __restrict__ out, i64 first, i64 count) {
    const i64 gid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= count * T::UNITS) return;
    const i64 blk = gid / T::UNITS;
    const int unit = gid % T::UNITS;
    decode_f16<T>(T::load(w, nb, first + blk, unit), unit, out + blk * T::BLOCK);
}

// Rows `tokens` of an embedding table [vocab, cols]: out [n, cols]; grid (units of a row / 128, n).
template <class T>
__global__ void embed(const u8* __restrict__ w, i64 nb, const int* __restrict__ tokens, float* __restrict__ out, int cols) {
    const int u = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    const int bpr = cols / T::BLOCK;
    if (u >= bpr * T::UNITS) return;
    const i64 blk = (i64)tokens[t] * bpr + u / T::UNITS;
    const int unit = u % T::UNITS;
    float v[T::UV];
    T::template decode<true>(T::load(w, nb, blk, unit), unit, v);
    float* dst = out + (i64)t * cols + (u / T::UNITS) * T::BLOCK;
#pragma unroll
    for (int run = 0; run < T::NR; ++run)
#pragma unroll
        for (int i = 0; i < T::RL; ++i) dst[T::run_offset(unit, run) + i] = v[run * T::RL + i];
}
