// Products of 9-64 tokens on Hopper's warpgroup tensor cores (sm_90a only; wgmma.py routes to them): Y = X W^T
// (+ bias), X as x_to_f16's f16 rows (`xscale` undoes their scaling), W quantized and read once.
//
// gemm_wg decodes each weight once, straight into the A registers of wgmma.m64nNk16 (unit_fragments, as gemm_rows
// does for mma.sync: a lane (g, t) decodes unit 4s + t of rows g and g + 8 of its warp's 16, k-step j taking the
// unit's values 4j..4j+3 at columns 2t, 2t + 1, 2t + 8, 2t + 9). That order of K is a permutation, which B (x) must
// follow: wg_order_x writes x once per product in it, as the 8 x 8 core matrices the descriptor reads, so that a
// block copies each chunk of WG_KC values of K whole (cp.async, 16 bytes a thread), two chunks in flight.
#include "quants.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

#define WG_KC 256  // values of K a chunk: K must be a multiple

// x's k-step of 8 NT tokens as the B operand's descriptor: K-major core matrices without swizzle, the step's
// columns 8-15 128 bytes after 0-7 (the leading byte offset), the next 8 tokens 256 bytes on (the stride byte
// offset; PTX ISA, "Matrix Descriptor Format": start address, leading and stride byte offsets in 16-byte units).
__device__ __forceinline__ u64 wg_desc(u32 address) {
    return (u64)((address & 0x3FFFF) >> 4) | (u64)(128 >> 4) << 16 | (u64)(256 >> 4) << 32;
}

// x [N, K] f16 rows in gemm_wg<T, NT>'s order: for each tile of 8 NT tokens, each chunk of WG_KC values, each of its
// WG_KC / 16 k-steps (step s of the chunk's units, k-step j of the unit: index s J + j), a [NT][2][8][8] block of
// core matrices: 8 tokens by 8 columns, the columns 0-7 then 8-15 of the step. Tokens past N are zeros. One thread
// a pair of values (4 bytes).
template <class T, int NT>
__global__ void wg_order_x(const u16* __restrict__ xh, u16* __restrict__ xo, int N, int K) {
    constexpr int J = T::UV / 4, NTOK = 8 * NT;
    const i64 pairs = (i64)((N + NTOK - 1) / NTOK) * NTOK * K / 2;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += (i64)gridDim.x * blockDim.x) {
        const int t = i & 3, r = (i >> 2) & 7, h = (i >> 5) & 1, group = (i >> 6) % NT;
        const i64 step = i / (64 * NT);  // k-steps of 16 from the tile's start
        const int q = step % (WG_KC / 16), chunk = (step / (WG_KC / 16)) % (K / WG_KC);
        const int tile = step / (K / 16), token = tile * NTOK + 8 * group + r;
        const int s = q / J, j = q % J, u = 4 * s + t, unit = u % T::UNITS;
        const int at = chunk * WG_KC + (u / T::UNITS) * T::BLOCK + T::run_offset(unit, 4 * j / T::RL) + (4 * j) % T::RL;
        ((u32*)xo)[i] = token < N ? *(const u32*)(xh + (i64)token * K + at + 2 * h) : 0u;
    }
}

// Y = X W^T (+ bias) for 8 NT tokens a block column (blockIdx.z), 128 weight rows a block (two warpgroups of 64),
// xo from wg_order_x<T, NT>. Split K: block y covers K from y * kchunk (a multiple of WG_KC) and writes its partial
// sums to y + blockIdx.y * N * M (bias in part 0 only) for splitk_sum. Dynamic shared memory: two chunks of x,
// 2 * WG_KC * 8 NT f16 (wg_smem in wgmma.py).
template <class T, int NT>
__global__ void __launch_bounds__(256, 2) gemm_wg(const u8* __restrict__ w, i64 nb, const u16* __restrict__ xo,
                                                  const float* __restrict__ xscale, float* __restrict__ y,
                                                  const float* __restrict__ bias, int M, int N, int K, int kchunk) {
    constexpr int J = T::UV / 4, STEPS = WG_KC / T::UV / 4, NTOK = 8 * NT, CHUNK = WG_KC * NTOK;
    static_assert(WG_KC % (4 * T::UV) == 0, "a chunk of K holds whole quad steps");
    extern __shared__ __align__(128) u16 xs[];  // [2][CHUNK]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * 128 + 16 * warp, tile = blockIdx.z;
    const int bpr = K / T::BLOCK, kbegin = blockIdx.y * kchunk, chunks = (min(K, kbegin + kchunk) - kbegin) / WG_KC;
    if (blockIdx.y > 0) {
        y += (i64)blockIdx.y * N * M;
        bias = nullptr;
    }
    i64 first[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) first[h] = (i64)min(m0 + g + 8 * h, M - 1) * bpr + kbegin / T::BLOCK;
    const u16* src = xo + ((i64)tile * (K / WG_KC) + kbegin / WG_KC) * CHUNK;
    float acc[4 * NT];
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) acc[i] = 0.0f;
    auto stage = [&](int c) {  // chunk c of x into buffer c & 1
        const uint4* from = (const uint4*)(src + (i64)c * CHUNK);
        u16* to = xs + (c & 1) * CHUNK;
        for (int i = threadIdx.x; i < CHUNK / 8; i += 256) cp_async16(to + 8 * i, from + i, 16);
        cp_async_commit();
    };
    stage(0);
    for (int c = 0; c < chunks; ++c) {
        typename T::Raw raw[STEPS][2];  // the chunk's weights asked for before waiting for its x
#pragma unroll
        for (int s = 0; s < STEPS; ++s)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int u = 4 * s + t;
                raw[s][h] = T::load(w, nb, first[h] + c * (WG_KC / T::BLOCK) + u / T::UNITS, u % T::UNITS);
            }
        if (c + 1 < chunks) {
            stage(c + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        proxy_fence();
        __syncthreads();  // chunk c is in buffer c & 1 for every warp
        const u32 buffer = shared_address(xs + (c & 1) * CHUNK);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            u32 a[J][4];
            unit_fragments<T>(raw[s][0], raw[s][1], (4 * s + t) % T::UNITS, 1.0f, a);
            wg_fence();
#pragma unroll
            for (int j = 0; j < J; ++j) WG<NT>::mma(acc, a[j], wg_desc(buffer + (s * J + j) * NTOK * 32));
            wg_commit();
        }
        wg_wait<0>();
        __syncthreads();  // every warpgroup is done with buffer c & 1 before chunk c + 2 is copied into it
    }
#pragma unroll
    for (int i = 0; i < 4 * NT; ++i) {
        keep_reg(acc[i]);
        const int row = m0 + g + 8 * ((i >> 1) & 1), token = tile * NTOK + 8 * (i >> 2) + 2 * t + (i & 1);
        if (row < M && token < N) y[(i64)token * M + row] = acc[i] * xscale[token] + (bias ? bias[row] : 0.0f);
    }
}
