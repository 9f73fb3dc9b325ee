// What the matrix-vector kernels (matmul.cu's gemv and gemv_q, experts.cu's gemv_id_q) share around quants.cuh's
// decoders: a lane's weight loads, and x as the integer dot products (T::dot) read it, int16 runs in a block's
// shared memory.
#pragma once
#include "quants.cuh"

// The loads a lane of the matrix-vector kernels issues before decoding any: units base, base + 32, ... (U of
// them; past the row's last unit, the last again) of RR rows, row r's first block at first[r % R], rows r >= R read
// from w2 (the gated unit's up matrix; w2 = w without one).
template <class T, int U, int RR, int R>
__device__ __forceinline__ void load_units(typename T::Raw (&raw)[U][RR], const u8* w, const u8* w2, i64 nb,
                                           const i64 (&first)[R], int base, int upr) {
#pragma unroll
    for (int s = 0; s < U; ++s) {
        const int u = min(base + 32 * s, upr - 1);
#pragma unroll
        for (int r = 0; r < RR; ++r) raw[s][r] = T::load(r < R ? w : w2, nb, first[r % R] + u / T::UNITS, u % T::UNITS);
    }
}

// x as the integer dot products (T::dot) read it, made by a block in shared memory: each run of RL values of each
// unit rounded to int16 with its own scale (x = xq * scale; 16 bits relative to the run's largest value) and the
// run's sum beside it, laid out so that lane l finds the x of its k-th unit at 16-byte group (k * QG + g) * 32 + l
// (loads without bank conflicts): xg [NC][lines][QG][32], then xs and xsum [NC][lines][NR][32] floats, where lines
// = ceil(units a row / 32). Rows c < NC of x at x + c * K. With NORMED, x * nw is quantized (nw null: x) and each
// row's sum of x^2 added to squares[c] (this thread's part; the caller reduces it). The caller syncs the block
// before reading.
// A thread takes its runs B at a time, all B runs' loads of x (and nw) issued before any is rounded: one trip to L2
// for B runs, where a run at a time waits on one trip each (a 14,336-value row of x: 7 runs a thread at 128
// threads, 7 trips before the block's first weight load). The runs are rounded, and their squares added, in the same
// order whatever B, so the values are the same bit for bit. B is LEAT_RUNS_AHEAD (half of it with NORMED, which loads
// nw's values too; at least 1): 1 unless the program is compiled with -DLEAT_RUNS_AHEAD=N (LEAT_CUDA_RUNS_AHEAD=N,
// backend.runs_ahead), as 4 measured level on an H100 (tg128 +0.2-0.6%) and more runs in flight cost registers.
#ifndef LEAT_RUNS_AHEAD
#define LEAT_RUNS_AHEAD 1
#endif
template <class T, int NC, bool NORMED, int B = (NORMED && LEAT_RUNS_AHEAD > 1 ? LEAT_RUNS_AHEAD / 2 : LEAT_RUNS_AHEAD)>
__device__ __forceinline__ void quantize_runs(const float* __restrict__ x, int K, const float* __restrict__ nw,
                                              uint4* __restrict__ xg, float (&squares)[NC]) {
    static_assert(B >= 1, "runs a thread loads before rounding them");
    constexpr int QG = T::UV / 8, NR = T::NR, RL = T::RL;
    const int upr = K / T::BLOCK * T::UNITS, lines = (upr + 31) >> 5, items = NC * upr * NR;
    float* xs = (float*)(xg + NC * lines * QG * 32);
    float* xsum = xs + NC * lines * NR * 32;
    for (int first = threadIdx.x; first < items; first += B * blockDim.x) {
        float v[B][RL], wn[B][RL];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int item = first + b * blockDim.x;
            if (item >= items) break;
            const int c = item / (upr * NR), u = (item / NR) % upr, run = item % NR;
            const int k0 = (u / T::UNITS) * T::BLOCK + T::run_offset(u % T::UNITS, run);
            const float* xr = x + (i64)c * K + k0;
#pragma unroll
            for (int q = 0; q < RL / 4; ++q) {
                const float4 f = *(const float4*)(xr + 4 * q);
                v[b][4 * q] = f.x; v[b][4 * q + 1] = f.y; v[b][4 * q + 2] = f.z; v[b][4 * q + 3] = f.w;
            }
            if (NORMED && B > 1 && nw) {  // (one run at a time reads nw as it rounds, as before B)
#pragma unroll
                for (int i = 0; i < RL; ++i) wn[b][i] = nw[k0 + i];
            }
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int item = first + b * blockDim.x;
            if (item >= items) break;
            const int c = item / (upr * NR), u = (item / NR) % upr, run = item % NR;
            if (NORMED) {
                const int k0 = (u / T::UNITS) * T::BLOCK + T::run_offset(u % T::UNITS, run);
                float ss = 0.0f;
#pragma unroll
                for (int i = 0; i < RL; ++i) {
                    ss = fmaf(v[b][i], v[b][i], ss);
                    if (nw) v[b][i] *= B > 1 ? wn[b][i] : nw[k0 + i];
                }
#pragma unroll
                for (int cc = 0; cc < NC; ++cc)
                    if (cc == c) squares[cc] += ss;
            }
            float amax = 0.0f, sum = 0.0f;
#pragma unroll
            for (int i = 0; i < RL; ++i) {
                amax = fmaxf(amax, fabsf(v[b][i]));
                sum += v[b][i];
            }
            const float f = amax > 0.0f ? 32767.0f / amax : 0.0f;
            u32 words[RL / 2];
#pragma unroll
            for (int i = 0; i < RL / 2; ++i) {  // round to nearest: 1.5 * 2^23 leaves the integer in the low bits
                const u32 lo = __float_as_uint(fmaf(v[b][2 * i], f, 12582912.0f)) - 0x4B400000u;
                const u32 hi = __float_as_uint(fmaf(v[b][2 * i + 1], f, 12582912.0f)) - 0x4B400000u;
                words[i] = (lo & 0xFFFF) | (hi << 16);
            }
            const int line = c * lines + (u >> 5), lane = u & 31;
#pragma unroll
            for (int g = 0; g < RL / 8; ++g)
                xg[(line * QG + run * (RL / 8) + g) * 32 + lane] =
                    make_uint4(words[4 * g], words[4 * g + 1], words[4 * g + 2], words[4 * g + 3]);
            xs[(line * NR + run) * 32 + lane] = amax / 32767.0f;
            xsum[(line * NR + run) * 32 + lane] = sum;
        }
    }
}

// Lane `lane`'s x for a unit of line `line` (quantize_runs's layout, `lines` lines a row of x): its int16 words, and
// each run's scale and sum, as T::dot takes them.
template <class T, int NC>
__device__ __forceinline__ void unit_x(const uint4* __restrict__ xg, int lines, int line, int lane,
                                       u32 (&xw)[T::UV / 2], float (&xsr)[T::NR], float (&xsumr)[T::NR]) {
    constexpr int QG = T::UV / 8, NR = T::NR;
    const float* xs = (const float*)(xg + NC * lines * QG * 32);
    const float* xsum = xs + NC * lines * NR * 32;
#pragma unroll
    for (int g = 0; g < QG; ++g) {
        const uint4 t = xg[(line * QG + g) * 32 + lane];
        xw[4 * g] = t.x; xw[4 * g + 1] = t.y; xw[4 * g + 2] = t.z; xw[4 * g + 3] = t.w;
    }
#pragma unroll
    for (int run = 0; run < NR; ++run) {
        xsr[run] = xs[(line * NR + run) * 32 + lane];
        xsumr[run] = xsum[(line * NR + run) * 32 + lane];
    }
}
