// What the decode attention kernels on tensor cores (flash.cu's attention_tc, mla.cu's mla_attention_tc) share: a
// warp's online-softmax step over 16 x 16 scores in mma.sync's accumulator layout, and its probabilities times a tile
// of 16 value rows; and the sum over a quad of lanes, flash_attention's too.
#pragma once
#include "mma.cuh"
#include "kv.cuh"

// The sum over a quad of lanes (the four that hold one row of an mma.sync accumulator tile), in every lane of it.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

// An online-softmax step over a warp's 16 x 16 scores, two m16n8 accumulator tiles (s[nt][2h + e]: row lane / 4 + 8h,
// key nt * 8 + 2 (lane % 4) + e; -inf where a key takes no part): the scores become probabilities exp(s - max), each
// row's running max m and sum l (this lane's share; a quad adds them up at the end) move on, and the value tiles o
// are rescaled where a row's max moved (a warp whose every row kept its max skips that: it would multiply by 1).
template <int NO>
__device__ __forceinline__ void softmax_tiles(float (&s)[2][4], float (&m)[2], float (&l)[2], float (&o)[NO][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float mn = fmaxf(m[h], mx), corr = mn == NEG_INF ? 1.0f : expf(m[h] - mn);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float v = s[nt][2 * h + e], p = v == NEG_INF ? 0.0f : expf(v - mn);
                s[nt][2 * h + e] = p;
                sum += p;
            }
        l[h] = l[h] * corr + sum;
        m[h] = mn;
        if (__any_sync(FULL_MASK, corr != 1.0f)) {
#pragma unroll
            for (int i = 0; i < NO; ++i) {
                o[i][2 * h] *= corr;
                o[i][2 * h + 1] *= corr;
            }
        }
    }
}

// O += P V for a warp: the probabilities s (softmax_tiles' layout, rounded to f16: mma.sync's A operand) times 16
// value rows in shared memory (`LD` values a row), value dims d0 ... d0 + 8 NO - 1 into the NO accumulator tiles o.
template <int NO, int LD>
__device__ __forceinline__ void pv_tiles(const float (&s)[2][4], const u16* v, int d0, float (&o)[NO][4]) {
    const int lane = threadIdx.x & 31;
    const u32 pa[4] = {pack_f16x2(s[0][0], s[0][1]), pack_f16x2(s[0][2], s[0][3]), pack_f16x2(s[1][0], s[1][1]),
                       pack_f16x2(s[1][2], s[1][3])};
#pragma unroll
    for (int dp = 0; dp < NO / 2; ++dp) {
        u32 t4[4];
        ldmatrix_x4_trans(t4, v + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + d0 + dp * 16 + (lane >> 4) * 8);
        mma_f16(o[2 * dp], pa, t4[0], t4[1]);
        mma_f16(o[2 * dp + 1], pa, t4[2], t4[3]);
    }
}
