"""The MoE and MLA kernels (kernels/moe.cu, experts.cu, mla.cu) compiled for the host with g++ and run with each CUDA
thread a fiber on one host thread (shuffles and barriers switch between them), against leat's float64
references: routing of every gating, the grouped and ungrouped expert products, a whole MoE layer, and
latent attention. No GPU needed; skipped where g++ is missing. Sizes are small: every lane runs in turn.
"""

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.modelfile import Tensor
from leat.moe import MoESpec, MoEWeights, activate, route, selection_margin
from leat.pull import cache_dir
from leat.testing import relative_error
from leat_backend_cpu.backend import CPUBackend
from leat_backend_cuda import moe, quants

Q = gguf.GGMLQuantizationType
SHIM = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <memory>
#include <ucontext.h>
#include <vector>
using std::isfinite;
using std::max;
using std::min;
#define __global__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define FULL_MASK 0xffffffffu
inline float __int_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
#define NEG_INF __int_as_float(0xff800000u)
inline unsigned short f32_to_f16(float f) { _Float16 h = (_Float16)f; unsigned short u; memcpy(&u, &h, 2); return u; }

struct Dim { unsigned x = 0, y = 0, z = 0; };
// Every CUDA thread of a block is a fiber (ucontext) on the calling thread: a lane runs until it reaches a barrier
// or returns, then the next lane runs; once no lane can go on, the barrier every live lane waits at opens. One OS
// thread for any block size (one per CUDA thread loaded the 2-core test machine with 1,024 of them).
inline Dim threadIdx, blockIdx;  // the running lane's, set before it is resumed
inline Dim blockDim, gridDim;
enum Wait : unsigned char { RUNNING, AT_BLOCK, AT_WARP, DONE };
struct Lane { ucontext_t context; Wait wait = RUNNING; unsigned barriers = 0; };  // block barriers passed
struct HostBlock {
    std::vector<Lane> lanes;
    ucontext_t scheduler;
    std::vector<long long> exchange;
};
inline HostBlock* current;
inline void* current_kernel;
inline std::vector<std::unique_ptr<char[]>> lane_stacks;  // reused by every block
constexpr size_t LANE_STACK = 256 << 10;
inline float host_smem[1 << 16];
// Blocks whose lanes passed different numbers of block barriers: a lane that skipped one the others waited at, which
// a GPU may leave waiting for ever (here an exited lane releases the others, so it would go unseen)
inline int uneven_blocks = 0;
inline void wait_at(Wait barrier) {
    Lane& lane = current->lanes[threadIdx.x];
    lane.wait = barrier;
    swapcontext(&lane.context, &current->scheduler);
}
inline void __syncthreads() { wait_at(AT_BLOCK); }
inline void __syncwarp(unsigned = FULL_MASK) { wait_at(AT_WARP); }
template <class T> T exchange(T v, int from) {
    long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    current->exchange[threadIdx.x] = bits;
    __syncwarp();
    bits = current->exchange[(threadIdx.x & ~31u) + from];
    __syncwarp();
    T r;
    memcpy(&r, &bits, sizeof(T));
    return r;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int o) { return exchange(v, (threadIdx.x & 31) ^ o); }
template <class T> T __shfl_sync(unsigned, T v, int src) { return exchange(v, src); }
template <class T> unsigned __match_any_sync(unsigned, T v) {
    unsigned same = 0;
    for (int l = 0; l < 32; ++l) same |= (unsigned)(exchange(v, l) == v) << l;
    return same;
}
inline int __ffs(unsigned x) { return __builtin_ffs(x); }
inline int __any_sync(unsigned, int p) {
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= exchange(p != 0, l);
    return any;
}
inline float warp_sum(float v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o); return v; }
inline float warp_max(float v) { for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o)); return v; }
inline float block_reduce(float v, bool max) {
    static float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = max ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : (max ? NEG_INF : 0.0f);
    return max ? warp_max(v) : warp_sum(v);
}
inline float block_sum(float v) { return block_reduce(v, false); }
inline float block_max(float v) { return block_reduce(v, true); }
inline unsigned pack_f16x2(float lo, float hi) { return f32_to_f16(lo) | ((unsigned)f32_to_f16(hi) << 16); }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

template <class F> void lane_entry() {
    (*static_cast<F*>(current_kernel))();
    current->lanes[threadIdx.x].wait = DONE;  // an exited lane no longer holds the others up; uc_link resumes the scheduler
}

// Runs the lanes of one block until every one has returned; aborts if they wait at different barriers.
inline void run_block(HostBlock& b) {
    const unsigned n = (unsigned)b.lanes.size();
    for (;;) {
        for (unsigned t = 0; t < n; ++t)
            if (b.lanes[t].wait == RUNNING) {
                threadIdx = {t, 0, 0};
                swapcontext(&b.scheduler, &b.lanes[t].context);
            }
        bool released = false;
        for (unsigned w = 0; w < n; w += 32) {  // a warp whose live lanes all wait at __syncwarp goes on
            bool any = false, all = true;
            for (unsigned t = w; t < min(n, w + 32); ++t) {
                any |= b.lanes[t].wait == AT_WARP;
                all &= b.lanes[t].wait == AT_WARP || b.lanes[t].wait == DONE;
            }
            if (any && all)
                for (unsigned t = w; t < min(n, w + 32); ++t)
                    if (b.lanes[t].wait == AT_WARP) b.lanes[t].wait = RUNNING;
            released |= any && all;
        }
        if (released) continue;
        bool any = false, all = true;
        for (auto& lane : b.lanes) {
            any |= lane.wait == AT_BLOCK;
            all &= lane.wait == AT_BLOCK || lane.wait == DONE;
        }
        if (!any && all) {  // every lane returned
            bool even = true;
            for (auto& lane : b.lanes) even &= lane.barriers == b.lanes[0].barriers;
            uneven_blocks += !even;
            return;
        }
        if (!all) { fprintf(stderr, "lanes wait at different barriers\n"); abort(); }
        for (auto& lane : b.lanes)
            if (lane.wait == AT_BLOCK) {
                lane.wait = RUNNING;
                ++lane.barriers;
            }
    }
}

// Runs kernel() for every block of `grid`, each CUDA thread a fiber; blocks one after another.
template <class F> void launch(Dim grid, unsigned threads, F kernel) {
    blockDim = {threads, 1, 1};
    gridDim = grid;
    current_kernel = &kernel;
    while (lane_stacks.size() < threads) lane_stacks.emplace_back(new char[LANE_STACK]);
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                HostBlock b{std::vector<Lane>(threads), {}, std::vector<long long>(threads)};
                current = &b;
                blockIdx = {x, y, z};
                for (unsigned t = 0; t < threads; ++t) {
                    ucontext_t& c = b.lanes[t].context;
                    getcontext(&c);
                    c.uc_stack.ss_sp = lane_stacks[t].get();
                    c.uc_stack.ss_size = LANE_STACK;
                    c.uc_link = &b.scheduler;
                    makecontext(&c, lane_entry<F>, 0);
                }
                run_block(b);
            }
}
"""

EXPORTS = r"""
extern "C" void route(const float* logits, const float* bias, int* ids, float* w, int n, int E, int k, int gating,
                      int normalize, float scale, int groups, int used) {
    launch({(unsigned)n, 1, 1}, 32, [=] { moe_route(logits, bias, ids, w, E, k, gating, normalize, scale, groups, used); });
}
extern "C" void group(const int* ids, int P, int E, int NC, int* start, int* chunk_start, int* order) {
    launch({1, 1, 1}, 64, [=] { moe_group(ids, P, E, NC, start, chunk_start, order); });
}
extern "C" void heads(int n, int h, int NC, int* start, int* chunk_start, int* order) {
    launch({1, 1, 1}, 64, [=] { head_group(n, h, NC, start, chunk_start, order); });
}
extern "C" void glu(const float* g, const float* u, float* y, long long n, int kind, float alpha, float limit) {
    launch({1, 1, 1}, 64, [=] { moe_glu(g, u, y, n, kind, alpha, limit); });
}
extern "C" void combine(const float* y, const float* w, const float* residual, float* out, int n, int k, int d) {
    launch({(unsigned)n, (unsigned)((d + 31) / 32), 1}, 32, [=] { moe_combine(y, w, residual, out, k, d); });
}
#define PRODUCTS(T)                                                                                              \
    extern "C" void id_##T(const u8* w, i64 nb, const int* ids, int mod, const float* x, int x_div, float* y,   \
                           const float* bias, int M, int K, int pairs, const u8* w2, const float* bias2, int act) { \
        launch({(unsigned)pairs, (unsigned)((M + 7) / 8), 1}, 128, [=] {                                         \
            if (w2) gemv_id<T, true>(w, nb, ids, mod, x, x_div, y, bias, M, K, w2, bias2, act, 1.702f, 7.0f);  \
            else gemv_id<T, false>(w, nb, ids, mod, x, x_div, y, bias, M, K, w2, bias2, act, 1.702f, 7.0f);    \
        });                                                                                                      \
    }                                                                                                            \
    extern "C" void grouped_##T(const u8* w, i64 nb, const int* start, const int* chunk_start, const int* order, \
                                int E, const float* x, int x_div, float* y, const float* bias, int M, int K,      \
                                int blocks, const u8* w2, const float* bias2, int act) {                         \
        launch({(unsigned)blocks, (unsigned)((M + 7) / 8), 1}, 128, [=] {                                        \
            if (w2) gemv_grouped<T, 8, true>(w, nb, start, chunk_start, order, E, x, x_div, y, bias, M, K, w2,   \
                                             bias2, act, 1.702f, 7.0f);                                          \
            else gemv_grouped<T, 8, false>(w, nb, start, chunk_start, order, E, x, x_div, y, bias, M, K, w2,     \
                                           bias2, act, 1.702f, 7.0f);                                            \
        });                                                                                                      \
    }
PRODUCTS(TF32)
PRODUCTS(TQ8_0)
PRODUCTS(TMXFP4)
PRODUCTS(TQ4_K)
PRODUCTS(TIQ2_XXS)
template <class T, int U>
void id_q(const u8* w, i64 nb, const int* ids, int mod, const float* x, int x_div, float* y, const float* bias, int M,
          int K, int pairs, int blocks, const u8* w2, const float* bias2, int act) {
    launch({(unsigned)pairs, (unsigned)blocks, 1}, 128, [=] {
        if (w2) gemv_id_q<T, 2, U, true>(w, nb, ids, mod, x, x_div, y, bias, M, K, w2, bias2, act, 1.702f, 7.0f);
        else gemv_id_q<T, 2, U, false>(w, nb, ids, mod, x, x_div, y, bias, M, K, w2, bias2, act, 1.702f, 7.0f);
    });
}
#define INTEGER_PRODUCTS(T)                                                                                       \
    extern "C" void idq_##T(const u8* w, i64 nb, const int* ids, int mod, const float* x, int x_div, float* y,  \
                            const float* bias, int M, int K, int pairs, int blocks, int units, const u8* w2,     \
                            const float* bias2, int act) {                                                       \
        if (units == 2) id_q<T, 2>(w, nb, ids, mod, x, x_div, y, bias, M, K, pairs, blocks, w2, bias2, act);     \
        else id_q<T, 1>(w, nb, ids, mod, x, x_div, y, bias, M, K, pairs, blocks, w2, bias2, act);                \
    }
INTEGER_PRODUCTS(TQ8_0)
INTEGER_PRODUCTS(TMXFP4)
INTEGER_PRODUCTS(TQ4_KP)
INTEGER_PRODUCTS(TQ6_KP)
INTEGER_PRODUCTS(TIQ2_XXS)
extern "C" void mla_pieces(const float* ql, const float* qr, u16* qh, float* qs, int rows, int rank, int rope,
                           const float* kc, const int* table, int slot, int span, int per_slot, int page_size,
                           u16* keys) {
    launch({(unsigned)rows, 1, 1}, 128, [=] { mla_q_f16(ql, qr, qh, qs, rank, rope); });
    launch({(unsigned)span, 1, 1}, 128, [=] {
        mla_keys_f16<float>(kc, nullptr, table, slot, rank + rope, per_slot, page_size, keys);
    });
}
extern "C" void mla_probs(const float* s, u16* p, const float* qs, const int* pos, int rows, int heads, int span,
                          int window, float scale) {
    launch({(unsigned)rows, 1, 1}, 256, [=] { mla_softmax_f16(s, p, qs, pos, heads, span, window, scale); });
}
#define GEMM(T)                                                                                                  \
    template <int S>                                                                                             \
    void gemm_##T##_stages(const u8* w, i64 nb, const int* start, const int* chunk_start, const int* order, int E, \
                           const u16* xh, const float* xs, int x_div, float* y, const float* bias, int M, int K,    \
                           int blocks, const u8* w2, const float* bias2, int act) {                              \
        if (w2)                                                                                                  \
            launch({(unsigned)blocks, (unsigned)((M + 63) / 64), 1}, 128, [=] {                                  \
                gemm_grouped<T, 8, 1, true, S>(w, nb, start, chunk_start, order, E, xh, xs, x_div, y, bias, M, K,  \
                                               w2, bias2, act, 1.702f, 7.0f);                                    \
            });                                                                                                  \
        else                                                                                                     \
            launch({(unsigned)blocks, (unsigned)((M + 127) / 128), 1}, 128, [=] {                                \
                gemm_grouped<T, 8, 2, false, S>(w, nb, start, chunk_start, order, E, xh, xs, x_div, y, bias, M, K, \
                                                w2, bias2, act, 1.702f, 7.0f);                                   \
            });                                                                                                  \
    }                                                                                                            \
    extern "C" void gemm_##T(const u8* w, i64 nb, const int* start, const int* chunk_start, const int* order, int E, \
                             const u16* xh, const float* xs, int x_div, float* y, const float* bias, int M, int K,    \
                             int blocks, const u8* w2, const float* bias2, int act, int stages) {                \
        (stages == 1 ? gemm_##T##_stages<1> : gemm_##T##_stages<2>)(w, nb, start, chunk_start, order, E, xh, xs,  \
                                                                    x_div, y, bias, M, K, blocks, w2, bias2, act); \
    }
GEMM(TQ8_0)
GEMM(TQ5_0)
GEMM(TMXFP4)
GEMM(TQ4_K)
GEMM(TQ6_K)
template <typename KV>
void mla_kv(const float* ql, const float* qr, const float* latent, const float* kr, KV* kc, u16* ks, const int* table,
            const int* slots, const int* pos, float* out, float* ml, float* acc, int n, int heads, int rank, int rope,
            int per_slot, int page_size, int window, int split, int splits, float scale) {
    launch({(unsigned)n, 1, 1}, 128, [=] { mla_kv_write<KV>(latent, kr, kc, ks, table, slots, pos, rank, rope, per_slot, page_size); });
    launch({(unsigned)n, (unsigned)((heads + 3) / 4), (unsigned)splits}, 128, [=] {
        mla_attention<KV, 2, 4>(ql, qr, kc, ks, table, slots, pos, out, ml, acc, heads, rank, rope, per_slot, page_size,
                                window, split, scale);
    });
}
extern "C" void mla(const float* ql, const float* qr, const float* latent, const float* kr, float* kc, const int* table,
                    const int* slots, const int* pos, float* out, float* ml, float* acc, int n, int heads, int rank,
                    int rope, int per_slot, int page_size, int window, int split, int splits, float scale) {
    mla_kv<float>(ql, qr, latent, kr, kc, nullptr, table, slots, pos, out, ml, acc, n, heads, rank, rope, per_slot,
                  page_size, window, split, splits, scale);
}
extern "C" void mla_q8_0(const float* ql, const float* qr, const float* latent, const float* kr, i8* kc, u16* ks,
                         const int* table, const int* slots, const int* pos, float* out, float* ml, float* acc, int n,
                         int heads, int rank, int rope, int per_slot, int page_size, int window, int split, int splits,
                         float scale) {
    mla_kv<i8>(ql, qr, latent, kr, kc, ks, table, slots, pos, out, ml, acc, n, heads, rank, rope, per_slot, page_size,
               window, split, splits, scale);
}
template <typename KV>
void mla_tc_run(const float* ql, const float* qr, const KV* kc, const u16* ks, const int* table, const int* slots,
                const int* pos, float* out, float* ml, float* acc, int n, int heads, int per_slot, int page_size,
                int window, int split, int splits, float scale) {
    launch({(unsigned)n, (unsigned)((heads + 15) / 16), (unsigned)splits}, 128, [=] {
        mla_attention_tc<KV, 64, 32>(ql, qr, kc, ks, table, slots, pos, splits == 1 ? out : nullptr, ml, acc, heads,
                                     per_slot, page_size, window, split, scale);
    });
}
extern "C" void mla_tc(const float* ql, const float* qr, const void* kc, const u16* ks, const int* table,
                       const int* slots, const int* pos, float* out, float* ml, float* acc, int n, int heads,
                       int per_slot, int page_size, int window, int split, int splits, float scale, int q8_0) {
    if (q8_0)
        mla_tc_run<i8>(ql, qr, (const i8*)kc, ks, table, slots, pos, out, ml, acc, n, heads, per_slot, page_size,
                       window, split, splits, scale);
    else
        mla_tc_run<u16>(ql, qr, (const u16*)kc, ks, table, slots, pos, out, ml, acc, n, heads, per_slot, page_size,
                        window, split, splits, scale);
}
"""


ATTENTION = r"""
template <typename KV>
void attend_kv(const float* q, const float* k, const float* v, KV* kc, KV* vc, u16* ks, u16* vs, const int* table,
               const int* slots, const int* pos, float* out, float* ml, float* acc, int n, int heads, int kv_heads,
               int dim, int per_slot, int page_size, int window, int split, int splits, float scale,
               const float* sinks, int wide) {
    launch({(unsigned)n, 1, 1}, 128, [=] {
        kv_write<KV>(k, v, kc, vc, ks, vs, table, slots, pos, kv_heads, dim, dim, per_slot, page_size);
    });
    const unsigned chunks = (heads / kv_heads + 3) / 4;
    auto body = [=] {
        float* target = splits == 1 ? out : nullptr;
        if (wide)
            attention_wide<KV, 1, 4>(q, kc, vc, ks, vs, table, slots, pos, target, ml, acc, heads, kv_heads, dim, dim,
                                     per_slot, page_size, window, split, scale, 0.0f, sinks);
        else
            attention<KV, 1, 4>(q, kc, vc, ks, vs, table, slots, pos, target, ml, acc, heads, kv_heads, dim, dim,
                                per_slot, page_size, window, split, scale, 0.0f, sinks);
    };
    launch({(unsigned)n, (unsigned)(kv_heads * chunks), (unsigned)splits}, 128, body);
    if (splits > 1) launch({(unsigned)(n * heads), 1, 1}, 32, [=] { attention_combine(ml, acc, out, splits, dim, sinks, heads); });
}
extern "C" void attend(const float* q, const float* k, const float* v, float* kc, float* vc, const int* table,
                       const int* slots, const int* pos, float* out, float* ml, float* acc, int n, int heads,
                       int kv_heads, int dim, int per_slot, int page_size, int window, int split, int splits,
                       float scale, const float* sinks, int wide) {
    attend_kv<float>(q, k, v, kc, vc, nullptr, nullptr, table, slots, pos, out, ml, acc, n, heads, kv_heads, dim, per_slot,
                     page_size, window, split, splits, scale, sinks, wide);
}
// q8_0 KV: quants kc/vc, f16 scales ks/vs (the CUDA backend's two planes); dim 32 (one dim per lane)
extern "C" void attend_q8_0(const float* q, const float* k, const float* v, i8* kc, i8* vc, u16* ks, u16* vs,
                            const int* table, const int* slots, const int* pos, float* out, float* ml, float* acc, int n,
                            int heads, int kv_heads, int dim, int per_slot, int page_size, int window, int split,
                            int splits, float scale, int wide) {
    attend_kv<i8>(q, k, v, kc, vc, ks, vs, table, slots, pos, out, ml, acc, n, heads, kv_heads, dim, per_slot, page_size,
                  window, split, splits, scale, nullptr, wide);
}
extern "C" void merge_splits(const float* ml, const float* acc, float* out, int rows, int splits, int dv,
                             const float* sinks, int heads, int threads) {
    launch({(unsigned)rows, (unsigned)((dv + threads - 1) / threads), 1}, (unsigned)threads,
           [=] { attention_combine(ml, acc, out, splits, dv, sinks, heads); });
}
// The merge a split at a time, one load after another (attention_combine before its loads went out together)
extern "C" void merge_splits_in_turn(const float* ml, const float* acc, float* out, int rows, int splits, int dv,
                                     const float* sinks, int heads) {
    for (int th = 0; th < rows; ++th) {
        float mx = NEG_INF;
        for (int z = 0; z < splits; ++z) mx = fmaxf(mx, ml[2 * (th * splits + z)]);
        for (int d = 0; d < dv; ++d) {
            float sum = 0.0f, a = 0.0f;
            for (int z = 0; z < splits; ++z) {
                const float* m = ml + 2 * (th * splits + z);
                if (m[1] > 0.0f) {
                    const float f = expf(m[0] - mx);
                    sum += m[1] * f;
                    a += acc[((i64)th * splits + z) * dv + d] * f;
                }
            }
            if (sinks) sink_join(sinks[th % heads], mx, sum, a);
            out[(i64)th * dv + d] = sum > 0.0f ? a / sum : 0.0f;
        }
    }
}
extern "C" void top_k(const float* x, float* values, int* ids, int rows, int cols, int k) {
    launch({(unsigned)rows, 1, 1}, 1024, [=] { top_k_rows(x, values, ids, cols, k); });
}
extern "C" void norm_then_f16(const float* x, const float* w, float* y, u16* xh, float* xscale, int n, int cols,
                              float eps, int threads) {
    launch({(unsigned)n, 1, 1}, threads, [=] { rms_norm(x, w, y, cols, eps); });
    launch({(unsigned)n, 1, 1}, threads, [=] { x_to_f16(y, xh, xscale, cols); });
}
extern "C" void norm_f16(const float* x, const float* w, u16* xh, float* xscale, int n, int cols, float eps,
                         int threads) {
    launch({(unsigned)n, 1, 1}, threads, [=] { rms_norm_f16(x, w, xh, xscale, cols, eps); });
}
extern "C" void rotate(const float* x, float* y, const int* pos, const double* inv_freq, int n, int heads, int head_dim,
                       int dims, int neox, float magnitude) {
    launch({(unsigned)(n * heads), 1, 1}, 32, [=] { rope(x, y, pos, inv_freq, heads, head_dim, dims, neox, magnitude); });
}
"""


def _kernel(name: str) -> str:
    return resources.files("leat_backend_cuda").joinpath("kernels", name).read_text()


def host_library(tmp_path_factory, name: str, harness: str, headers: dict[str, str] | None = None) -> ctypes.CDLL:
    """Kernel sources built for the host with g++ (common.cuh with the SHIM in place of CUDA's runtime, and kv.cuh
    beside them), loaded as a shared library. The library is kept in ``$LEAT_HOME/cuda-host-tests`` (default
    ~/.cache/leat), named by the hash of every file, the flags and g++'s version, as the NVRTC cache keeps cubins:
    a later run of the same sources loads it instead of compiling again (2-8 s a library here)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    host_common = (Path(__file__).parent / "host" / "common.cuh").read_text().replace("#pragma once", "")
    files = {"common.cuh": "#pragma once\n" + host_common + SHIM, "kv.cuh": _kernel("kv.cuh"), **(headers or {})}
    files["harness.cpp"] = harness
    flags = ["-O1", "-std=c++20", "-shared", "-fPIC", "-pthread", "-w"]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(json.dumps([sorted(files.items()), flags, version]).encode()).hexdigest()[:32]
    cache = cache_dir() / "cuda-host-tests"
    library = cache / f"lib{name}-{key}.so"
    if not library.exists():
        folder = tmp_path_factory.mktemp(name)
        for file, text in files.items():
            (folder / file).write_text(text)
        built = folder / f"lib{name}.so"
        subprocess.run([compiler, *flags, "-o", built, folder / "harness.cpp"], check=True)
        cache.mkdir(parents=True, exist_ok=True)
        partial = library.with_name(f"{library.name}.{os.getpid()}.partial")
        shutil.copy(built, partial)
        os.replace(partial, library)  # whole or not at all, for a run beside this one
    return ctypes.CDLL(str(library))


@pytest.fixture(scope="module")
def ops_kernels(tmp_path_factory):
    """ops.cu's kv_write, attention, attention_wide and attention_combine on the host (the sink paths)."""
    return host_library(tmp_path_factory, "ops-host", _kernel("ops.cu") + ATTENTION)


@pytest.mark.parametrize("threads", [256, 32])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_f16_equals_rms_norm_then_x_to_f16(ops_kernels, weighted, threads):
    """The norm fused into a product's f16 rows (rms_norm_f16) gives x_to_f16's rows of rms_norm's output bit for bit,
    and those rows times their scales are the float64 norm within f16 rounding: with a row held in registers (256
    threads) and with one too long for them (32 threads), which the kernels read in loops."""
    rng = np.random.default_rng(11)
    n, cols, eps = 3, 2304, 1e-5
    x = f32(rng.standard_normal((n, cols)) * np.array([[1e-3], [1.0], [50.0]]))
    w = f32(rng.standard_normal(cols)) if weighted else None
    y = np.full((n, cols), np.nan, np.float32)
    two = [(np.zeros((n, cols), np.uint16), np.full(n, np.nan, np.float32)) for _ in range(2)]
    eps32 = ctypes.c_float(eps)
    ops_kernels.norm_then_f16(ptr(x), ptr(w), ptr(y), ptr(two[0][0]), ptr(two[0][1]), n, cols, eps32, threads)
    ops_kernels.norm_f16(ptr(x), ptr(w), ptr(two[1][0]), ptr(two[1][1]), n, cols, eps32, threads)
    np.testing.assert_array_equal(two[1][0], two[0][0])
    np.testing.assert_array_equal(two[1][1], two[0][1])
    want = CPUBackend("f64").rms_norm(x.astype(np.float64), None if w is None else w.astype(np.float64), eps)
    got = two[1][0].view(np.float16).astype(np.float64) * two[1][1][:, None]
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("wide", [0, 1])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks(ops_kernels, wide, splits, window):
    """attention (a decode step's) and attention_wide (a prefill's) over 11 positions, windowed or not, with sinks,
    whole or split: attention_wide's splits cut the positions at multiples of its split; attention cuts each token's
    own range (window included) into `splits` parts rounded up to its `keys` (4 splits of 2 keys: the 11th token's 11
    keys in parts of 4, the 3rd's 3 keys in parts of 2, the windowed ones from their window's start)."""
    rng = np.random.default_rng(wide + 2 * splits + window)
    heads, kv_heads, dim, n, page_size = 6, 2, 16, 11, 4
    cpu = CPUBackend("f64")
    kv = cpu.allocate_kv([KVLayout(kv_heads, dim, window=window or None)], 1, 12, page_size=page_size)
    q, k, v = (f32(rng.standard_normal((n, h, dim))) for h in (heads, kv_heads, kv_heads))
    sinks = f32(np.linspace(-3, 4, heads))
    batch = Batch([Row(0, 0, np.zeros(n, int), all_logits=True)])
    want = cpu.attention(*(a.astype(np.float64) for a in (q, k, v)), kv, 0, batch, 0.4, sinks=sinks.astype(np.float64))
    kc, vc = (np.full(3 * page_size * kv_heads * dim, np.nan, np.float32) for _ in range(2))
    table = np.ascontiguousarray(kv.page_table, np.int32)
    slots, pos = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    out = np.full((n, heads * dim), np.nan, np.float32)
    ml, acc = np.zeros(n * heads * splits * 2, np.float32), np.zeros(n * heads * splits * dim, np.float32)
    ops_kernels.attend(
        ptr(q),
        ptr(k),
        ptr(v),
        ptr(kc),
        ptr(vc),
        ptr(table),
        ptr(slots),
        ptr(pos),
        ptr(out),
        ptr(ml),
        ptr(acc),
        n,
        heads,
        kv_heads,
        dim,
        table.shape[1],
        page_size,
        window,
        -(-n // splits) if wide else {1: 64, 2: 8, 4: 2}[splits],  # attention_wide's split, attention's keys
        splits,
        ctypes.c_float(0.4),
        ptr(sinks),
        wide,
    )
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("splits", "dv", "threads"), [(3, 16, 32), (37, 300, 128), (200, 64, 64)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_combine_equals_the_merge_a_split_at_a_time(ops_kernels, splits, dv, threads, with_sinks):
    """attention_combine (the splits' weights once a block, its loads COMBINE_AHEAD at a time, a row's values over
    several blocks) gives the merge a split at a time bit for bit, and the float64 merge within float32 rounding:
    over split counts past and not a multiple of 16, splits without keys (sum 0) among them, and a row with none."""
    rng = np.random.default_rng(splits + dv + with_sinks)
    heads, rows = 3, 6
    ml = np.stack([rng.standard_normal((rows, splits)) * 4, rng.uniform(0.5, 9.0, (rows, splits))], -1)
    ml[rng.random((rows, splits)) < 0.3] = (-np.inf, 0.0)  # splits a token's range left empty
    ml[4] = (-np.inf, 0.0)  # a row whose splits all have no keys (a token with no slot)
    ml = f32(ml)
    acc = f32(rng.standard_normal((rows, splits, dv)) * ml[..., 1:])
    sinks = f32(np.linspace(-2, 3, heads)) if with_sinks else None
    got, want = (np.full((rows, dv), np.nan, np.float32) for _ in range(2))
    ops_kernels.merge_splits(ptr(ml), ptr(acc), ptr(got), rows, splits, dv, ptr(sinks), heads, threads)
    ops_kernels.merge_splits_in_turn(ptr(ml), ptr(acc), ptr(want), rows, splits, dv, ptr(sinks), heads)
    np.testing.assert_array_equal(got, want)
    exact = merged_splits(ml, acc, sinks[np.arange(rows) % heads] if with_sinks else None)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wide", [0, 1])
@pytest.mark.parametrize("splits", [1, 2])
def test_q8_0_cache_and_attention(ops_kernels, wide, splits):
    """kv_write<i8> stores the CPU backend's q8_0 quants and scales bit for bit (pages out of order, a
    half-rounding case planted), and attention over them equals the CPU's over its q8_0 cache."""
    rng = np.random.default_rng(20 + wide + 2 * splits)
    heads, kv_heads, dim, n, page_size = 6, 2, 32, 11, 4
    cpu = CPUBackend("f64")
    kv = cpu.allocate_kv([KVLayout(kv_heads, dim)], 1, 12, page_size=page_size, dtype="q8_0")
    cpu.set_pages(kv, 0, np.array([2, 0, 1]))
    q, k, v = (f32(rng.standard_normal((n, h, dim))) for h in (heads, kv_heads, kv_heads))
    k[3, 1, :] = np.arange(32) - 15.5  # with the 127 below, d = 1: the other 31 are halves, rounded away from 0
    k[3, 1, 0] = 127.0
    k[4, 0, :] = 0.0  # an all-zero block: scale 0
    batch = Batch([Row(0, 0, np.zeros(n, int), all_logits=True)])
    want = cpu.attention(*(a.astype(np.float64) for a in (q, k, v)), kv, 0, batch, 0.4)
    kc, vc = (np.zeros(3 * page_size * kv_heads * dim, np.int8) for _ in range(2))
    ks, vs = (np.zeros(3 * page_size * kv_heads * dim // 32, np.uint16) for _ in range(2))
    table = np.ascontiguousarray(kv.page_table, np.int32)
    slots, pos = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    out = np.full((n, heads * dim), np.nan, np.float32)
    ml, acc = np.zeros(n * heads * splits * 2, np.float32), np.zeros(n * heads * splits * dim, np.float32)
    ops_kernels.attend_q8_0(
        *map(ptr, (q, k, v, kc, vc, ks, vs, table, slots, pos, out, ml, acc)),
        n,
        heads,
        kv_heads,
        dim,
        table.shape[1],
        page_size,
        0,
        64 if splits == 1 else 8,
        splits,
        ctypes.c_float(0.4),
        wide,
    )
    written = table[0, : -(-n // page_size)]
    for got, stored in ((kc, kv.k[0]), (vc, kv.v[0]), (ks, kv.k_scale[0]), (vs, kv.v_scale[0])):
        got = got.reshape(3, page_size, -1)[written].reshape(-1)[: n * stored[0, 0].size]
        np.testing.assert_array_equal(got, stored[written].reshape(-1).view(got.dtype)[: got.size])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)  # float32 sums; the 127 makes scores of ~50


def test_top_k_rows(ops_kernels):
    """top_k_rows equals numpy's stable sort of -x: ties to the lower index, -inf rows, k past a thread's
    share of the row, a row shorter than the block."""
    rng = np.random.default_rng(30)
    rows, cols = 4, 5000
    x = f32(rng.integers(-40, 40, (rows, cols)) / 4)  # many ties
    x[1] = -np.inf
    x[2, : cols - 3] = -np.inf  # three finite values, then -inf ones by index
    x[3, 1234] = np.inf
    for k in (1, 9, 64):
        values, ids = np.full((rows, k), np.nan, np.float32), np.full((rows, k), -1, np.int32)
        ops_kernels.top_k(ptr(x), ptr(values), ptr(ids), rows, cols, k)
        order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, order)
        np.testing.assert_array_equal(values, np.take_along_axis(x, order, -1))
    short = f32(rng.standard_normal((1, 70)))
    values, ids = np.zeros((1, 64), np.float32), np.zeros((1, 64), np.int32)
    ops_kernels.top_k(ptr(short), ptr(values), ptr(ids), 1, 70, 64)
    np.testing.assert_array_equal(ids, np.argsort(-short, axis=-1, kind="stable")[:, :64])


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    moe = _kernel("moe.cu").replace("extern __shared__ float sm[];", "float* sm = host_smem;")
    experts = _kernel("experts.cu").replace('#include "runs.cuh"', "")
    experts = experts.replace("extern __shared__ uint4 grouped_smem[];", "uint4* grouped_smem = (uint4*)host_smem;")
    experts = experts.replace("extern __shared__ uint4 xsh[];", "uint4* xsh = (uint4*)host_smem;")
    harness = "\n".join(['#include "runs.cuh"', moe, experts, _kernel("mla.cu"), EXPORTS])
    headers = {name: _kernel(name) for name in ("quants.cuh", "runs.cuh", "iq_grids.cuh", "decode_tc.cuh")}
    headers["mma.cuh"] = (Path(__file__).parent / "host" / "mma.cuh").read_text()  # experts.cu's gemm_grouped
    return host_library(tmp_path_factory, "moe-mla-host", harness, headers)


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else ctypes.c_void_p(0)


def f32(x):
    return np.ascontiguousarray(x, np.float32)


def merged_splits(ml, acc, sinks=None):
    """The float64 merge of attention's splits (ops.cu's attention_combine): ``ml`` [rows, splits, 2] each split's max
    and sum (sum 0: a split without keys, which takes no part), ``acc`` [rows, splits, dv] its unnormalized values,
    ``sinks`` a logit a row or None."""
    m, l, a = ml[..., 0].astype(np.float64), ml[..., 1].astype(np.float64), acc.astype(np.float64)
    top = np.where(l > 0, m, -np.inf).max(axis=1)
    if sinks is not None:
        top = np.maximum(top, sinks)
    with np.errstate(invalid="ignore"):  # a row without keys: -inf - -inf, not taken
        f = np.where(l > 0, np.exp(m - top[:, None]), 0.0)
    total = (l * f).sum(axis=1) + (np.exp(sinks - top) if sinks is not None else 0.0)
    return (a * f[..., None]).sum(axis=1) / np.where(total > 0, total, 1.0)[:, None]


SPECS = [
    MoESpec(8, 2, "softmax", normalize=True),
    MoESpec(6, 3, "softmax_selected", activation="swiglu_oai"),
    MoESpec(16, 4, "sigmoid", True, 2.5, groups=4, groups_used=2),
    MoESpec(40, 6, "softmax", scale=1.5),
]


def route_on_host(kernels, logits, bias, ids, w, spec):
    """moe_route over [n, experts] logits into ids and weights [n, experts_used], as the backend launches it."""
    n, e = logits.shape
    kernels.route(
        ptr(logits),
        ptr(bias),
        ptr(ids),
        ptr(w),
        n,
        e,
        spec.experts_used,
        {"softmax": 0, "softmax_selected": 1, "sigmoid": 2}[spec.gating],
        int(spec.normalize),
        ctypes.c_float(spec.scale),
        spec.groups if spec.groups > 1 else 0,
        spec.groups_used,
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.gating}-{s.experts}")
def test_route(kernels, spec):
    rng = np.random.default_rng(spec.experts)
    n, e, k = 9, spec.experts, spec.experts_used
    logits = f32(rng.standard_normal((n, e)) * 2)  # float32 arrays kept alive while the kernels read them
    bias = f32(rng.standard_normal(e) / 4) if spec.groups else None
    want_ids, want_w = route(logits, spec, bias)
    ids, w = np.full((n, k), -1, np.int32), np.full((n, k), np.nan, np.float32)
    route_on_host(kernels, logits, bias, ids, w, spec)
    decided = selection_margin(logits, spec, bias) > 1e-5
    assert decided.sum() >= n - 2
    np.testing.assert_array_equal(ids[decided], want_ids[decided])
    np.testing.assert_allclose(w[decided], want_w[decided], rtol=2e-6, atol=1e-7)


# byte offsets of the f16 scales of the types gguf-py cannot quantize (their blocks are random, with small scales)
RANDOM_BLOCKS = {Q.Q4_K: (0, 2), Q.IQ2_XXS: (0,), Q.Q6_K: (208,)}


def upload(qtype, values, rng):
    values = f32(values)
    if qtype in RANDOM_BLOCKS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (values.size // block, size), dtype=np.uint8)
        for at in RANDOM_BLOCKS[qtype]:
            data[:, at : at + 2] = rng.uniform(0.0005, 0.002, (len(data), 1)).astype(np.float16).view(np.uint8)
    else:
        data = values if qtype == Q.F32 else gguf.quants.quantize(values.reshape(-1, values.shape[-1]), qtype)
    exact = CPUBackend("f64").upload(Tensor("w", qtype, values.shape, data))
    return (
        quants.device_bytes(qtype, data),
        quants.blocks_of(qtype, values.size // values.shape[-1], values.shape[-1]),
        exact,
    )


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.MXFP4, Q.Q4_K, Q.IQ2_XXS])
def test_expert_products_ungrouped_and_grouped(kernels, qtype):
    rng = np.random.default_rng(int(qtype))
    e, m, k, n, used = 5, 12, 256, 11, 2
    stored, nb, exact = upload(qtype, rng.standard_normal((e, m, k)) / 8, rng)
    x = f32(rng.standard_normal((n, k)))
    ids = np.stack([rng.choice(e, used, replace=False) for _ in range(n)]).astype(np.int32)
    bias = f32(rng.standard_normal((e, m)))
    want = np.einsum("pmk,pk->pm", exact[ids.reshape(-1)], np.repeat(x.astype(np.float64), used, axis=0))
    want += bias[ids.reshape(-1)]
    struct = quants.LAYOUTS[qtype].struct
    got = np.full((n * used, m), np.nan, np.float32)
    getattr(kernels, f"id_{struct}")(
        ptr(stored),
        ctypes.c_longlong(nb),
        ptr(ids),
        e,
        ptr(x),
        used,
        ptr(got),
        ptr(bias),
        m,
        k,
        n * used,
        ptr(None),
        ptr(None),
        0,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    start, chunk_start, order = (np.full(s, -7, np.int32) for s in (e + 1, e + 1, n * used))
    kernels.group(ptr(ids), n * used, e, 8, ptr(start), ptr(chunk_start), ptr(order))
    counts = np.bincount(ids.reshape(-1), minlength=e)
    np.testing.assert_array_equal(np.diff(start), counts)
    np.testing.assert_array_equal(np.diff(chunk_start), -(-counts // 8))
    np.testing.assert_array_equal(order, np.argsort(ids.reshape(-1), kind="stable"))
    grouped = np.full((n * used, m), np.nan, np.float32)
    getattr(kernels, f"grouped_{struct}")(
        ptr(stored),
        ctypes.c_longlong(nb),
        ptr(start),
        ptr(chunk_start),
        ptr(order),
        e,
        ptr(x),
        used,
        ptr(grouped),
        ptr(bias),
        m,
        k,
        -(-n * used // 8) + e,
        ptr(None),
        ptr(None),
        0,
    )
    np.testing.assert_allclose(grouped, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # gate and up in one launch, with the gated activation (both kinds), ungrouped and grouped
    stored_up, _, exact_up = upload(qtype, rng.standard_normal((e, m, k)) / 8, rng)
    bias_up = f32(rng.standard_normal((e, m)))
    want_up = np.einsum("pmk,pk->pm", exact_up[ids.reshape(-1)], np.repeat(x.astype(np.float64), used, axis=0))
    want_up += bias_up[ids.reshape(-1)]
    for act, activation in ((0, "silu"), (1, "swiglu_oai")):
        want_h = activate(want, want_up, MoESpec(e, used, activation=activation))
        fused = np.full((n * used, m), np.nan, np.float32)
        getattr(kernels, f"id_{struct}")(
            ptr(stored),
            ctypes.c_longlong(nb),
            ptr(ids),
            e,
            ptr(x),
            used,
            ptr(fused),
            ptr(bias),
            m,
            k,
            n * used,
            ptr(stored_up),
            ptr(bias_up),
            act,
        )
        np.testing.assert_allclose(fused, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
        fused[:] = np.nan
        getattr(kernels, f"grouped_{struct}")(
            ptr(stored),
            ctypes.c_longlong(nb),
            ptr(start),
            ptr(chunk_start),
            ptr(order),
            e,
            ptr(x),
            used,
            ptr(fused),
            ptr(bias),
            m,
            k,
            -(-n * used // 8) + e,
            ptr(stored_up),
            ptr(bias_up),
            act,
        )
        np.testing.assert_allclose(fused, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.MXFP4, Q.Q4_K, Q.Q6_K, Q.IQ2_XXS], ids=lambda q: q.name)
def test_integer_expert_products(kernels, qtype):
    """gemv_id_q (a decode step's expert products with int16 x and T::dot) against the float64 products; gated both
    ways against the activation of its plain products; x shared by a token's pairs (x_div 2) and one row per pair (x_div 1): 1 and 2 units in flight
    (rows of 3 lines of units, the last partial), the blocks of a pair sharing its row groups (3 blocks for 42 rows:
    5.25 groups of 8), rows past the last whole group."""
    rng = np.random.default_rng(50 + int(qtype))
    block = quants.LAYOUTS[qtype].block
    values, _ = quants.unit_shape(qtype)
    e, m, n, used = 5, 42, 3, 2
    k = max(block, values * 80 // block * block)  # 80 units of the dot struct or the next whole block below
    stored, nb, exact = upload(qtype, rng.standard_normal((e, m, k)) / 8, rng)
    stored_up, _, exact_up = upload(qtype, rng.standard_normal((e, m, k)) / 8, rng)
    bias, bias_up = f32(rng.standard_normal((e, m))), f32(rng.standard_normal((e, m)))
    ids = np.stack([rng.choice(e, used, replace=False) for _ in range(n)]).astype(np.int32)
    pairs = n * used
    run = getattr(kernels, f"idq_{quants.LAYOUTS[qtype].dot_struct}")
    for x_div, rows in ((used, n), (1, pairs)):
        x = f32(rng.standard_normal((rows, k)) * np.logspace(-2, 2, rows)[:, None])
        xp = np.repeat(x.astype(np.float64), used, axis=0) if x_div == used else x.astype(np.float64)
        want = np.einsum("pmk,pk->pm", exact[ids.reshape(-1)], xp) + bias[ids.reshape(-1)]
        want_up = np.einsum("pmk,pk->pm", exact_up[ids.reshape(-1)], xp) + bias_up[ids.reshape(-1)]
        for units in (1, 2):
            plain = []
            for weight, b, reference in ((stored, bias, want), (stored_up, bias_up, want_up)):
                got = np.full((pairs, m), np.nan, np.float32)
                run(ptr(weight), ctypes.c_longlong(nb), ptr(ids), e, ptr(x), x_div, ptr(got), ptr(b), m, k, pairs, 3,
                    units, ptr(None), ptr(None), 0)  # fmt: skip
                for p in range(pairs):
                    assert relative_error(got[p], reference[p]) < 2e-4, (x_div, units, p)
                plain.append(got.astype(np.float64))
            for act, activation in ((0, "silu"), (1, "swiglu_oai")):  # the same sums, then the activation
                want_h = activate(*plain, MoESpec(e, used, activation=activation))
                got = np.full((pairs, m), np.nan, np.float32)
                run(ptr(stored), ctypes.c_longlong(nb), ptr(ids), e, ptr(x), x_div, ptr(got), ptr(bias), m, k, pairs,
                    3, units, ptr(stored_up), ptr(bias_up), act)  # fmt: skip
                np.testing.assert_allclose(got, want_h, rtol=1e-5, atol=1e-6 * np.abs(want_h).max())


def f16_rows(x):
    """x as ops.cu's x_to_f16 makes it: f16 rows scaled by a power of two each (the largest value in [2^14, 2^15)),
    and the scales that undo it."""
    exponent = np.frexp(np.abs(x).max(axis=1))[1]
    scale = np.ldexp(1.0, exponent - 15).astype(np.float32)
    return np.ascontiguousarray((x / scale[:, None]).astype(np.float16).view(np.uint16)), scale


@pytest.mark.parametrize("qtype", moe.TENSOR_TYPES, ids=lambda q: q.name)
def test_tensor_core_grouped_products(kernels, qtype):
    """gemm_grouped (mma.sync emulated by tests/host/mma.cuh) against float64 products of the f16 inputs it takes,
    and the plain products within f16 rounding of the exact ones: uneven loads (expert 0 has no pair, expert 3 every token: two
    chunks, the second of 6 pairs), 40 rows (not a whole row tile), K past the last whole 256 where blocks allow;
    x rows shared by the pairs of a token (gate and up: plain, and gated both ways; x staged in two buffers) and one
    row per pair (down; one buffer)."""
    rng = np.random.default_rng(int(qtype))
    e, m, n, used = 4, 40, 70, 2
    k = 512 if quants.LAYOUTS[qtype].block == 256 else 320
    stored, nb, exact = upload(qtype, rng.standard_normal((e, m, k)) / 8, rng)
    stored_up, _, exact_up = upload(qtype, rng.standard_normal((e, m, k)) / 8, rng)
    bias, bias_up = f32(rng.standard_normal((e, m))), f32(rng.standard_normal((e, m)))
    ids = np.stack([np.full(n, 3), rng.choice([1, 2], n)], axis=1).astype(np.int32)
    pairs, chunk = n * used, 8 * 8  # the harness's gemm_grouped: NT 8
    start, chunk_start, order = (np.full(s, -7, np.int32) for s in (e + 1, e + 1, pairs))
    kernels.group(ptr(ids), pairs, e, chunk, ptr(start), ptr(chunk_start), ptr(order))
    counts = np.bincount(ids.reshape(-1), minlength=e)
    assert counts[0] == 0 and counts[3] == n
    np.testing.assert_array_equal(np.diff(chunk_start), -(-counts // chunk))
    np.testing.assert_array_equal(order, np.argsort(ids.reshape(-1), kind="stable"))
    run = getattr(kernels, f"gemm_{quants.LAYOUTS[qtype].struct}")
    rounded = [w.astype(np.float16).astype(np.float64) for w in (exact, exact_up)]
    for x_div in (used, 1):  # a token's row for each of its pairs (gate, up), or a row per pair (down)
        x = f32(rng.standard_normal((pairs // x_div, k)) * rng.uniform(0.01, 10, (pairs // x_div, 1)))
        xh, xscale = f16_rows(x)
        xr = np.repeat(xh.view(np.float16).astype(np.float64) * xscale[:, None], x_div, axis=0)
        for act in (None, 0, 1) if x_div > 1 else (None,):
            w_up, b_up = (None, None) if act is None else (stored_up, bias_up)
            got = np.full((pairs, m), np.nan, np.float32)
            blocks = -(-pairs // chunk) + e
            args = (ptr(start), ptr(chunk_start), ptr(order), e, ptr(xh), ptr(xscale), x_div, ptr(got), ptr(bias), m, k)
            stages = 2 if x_div > 1 else 1  # x copied into two buffers in turn, or one
            run(ptr(stored), ctypes.c_longlong(nb), *args, blocks, ptr(w_up), ptr(b_up), act or 0, stages)
            want, exactly = ([], [])
            for weights, b in zip((rounded, (exact, exact_up)), (want, exactly)):
                xe = xr if weights is rounded else np.repeat(x.astype(np.float64), x_div, axis=0)
                g = np.einsum("pmk,pk->pm", weights[0][ids.reshape(-1)], xe) + bias[ids.reshape(-1)]
                if act is not None:
                    u = np.einsum("pmk,pk->pm", weights[1][ids.reshape(-1)], xe) + bias_up[ids.reshape(-1)]
                    g = activate(g, u, MoESpec(e, used, activation=("silu", "swiglu_oai")[act]))
                b.append(g)
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want[0], rtol=0, atol=2e-4 * np.abs(want[0]).max())
            if act is None:  # (the gated activations amplify the products' f16 rounding near their clamps)
                np.testing.assert_allclose(got, exactly[0], rtol=0, atol=2e-3 * np.abs(exactly[0]).max())


@pytest.mark.parametrize("window", [0, 7])
def test_mla_gemm_prefill_pieces(kernels, window):
    """mla.py's cuBLAS prefill with the two products done here in float64 on the kernels' f16 operands: the query
    rows (mla_q_f16: f16 rows scaled by powers of two), the keys gathered from a paged cache (mla_keys_f16), the
    causal, windowed softmax (mla_softmax_f16); the output within f16 rounding of float64 attention."""
    rng = np.random.default_rng(5 + window)
    heads, rank, rope, start, n, page = 3, 32, 8, 5, 20, 16
    span, dk, rows = start + n, rank + rope, n * heads
    ql, qr = f32(rng.standard_normal((rows, rank)) * 4), f32(rng.standard_normal((rows, rope)))
    table = np.array([[2, 0]], np.int32)  # positions 0-15 on page 2, 16-24 on page 0
    kc = f32(rng.standard_normal((3 * page, dk)))
    qh, qs, keys = np.zeros((rows, dk), np.uint16), np.zeros(rows, np.float32), np.zeros((span, dk), np.uint16)
    kernels.mla_pieces(
        ptr(ql), ptr(qr), ptr(qh), ptr(qs), rows, rank, rope, ptr(kc), ptr(table), 0, span, 2, page, ptr(keys)
    )
    cached = kc[table[0, np.arange(span) // page] * page + np.arange(span) % page]
    np.testing.assert_array_equal(keys.view(np.float16), cached.astype(np.float16))
    q = np.concatenate([ql, qr], axis=1)
    np.testing.assert_array_equal(qh.view(np.float16), (q / qs[:, None]).astype(np.float16))
    assert (np.abs(qh.view(np.float16)).max(axis=1) >= 2**14).all()
    k16 = keys.view(np.float16).astype(np.float64)
    scores = f32(qh.view(np.float16).astype(np.float64) @ k16.T)
    pos = np.arange(start, start + n, dtype=np.int32)
    probs = np.full((rows, span), 0xFFFF, np.uint16)
    kernels.mla_probs(ptr(scores), ptr(probs), ptr(qs), ptr(pos), rows, heads, span, window, ctypes.c_float(0.3))
    got = probs.view(np.float16).astype(np.float64) @ k16[:, :rank]
    s = q.astype(np.float64) @ cached.astype(np.float64).T * 0.3
    at, c = pos[np.arange(rows) // heads][:, None], np.arange(span)[None]
    s = np.where((c <= at) & ((window == 0) | (c > at - window)), s, -np.inf)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    want = (w / w.sum(axis=1, keepdims=True)) @ cached[:, :rank].astype(np.float64)
    assert np.abs(got - want).max() < 3e-3 * np.abs(want).max()


def test_head_groups(kernels):
    n, heads = 11, 3
    start, chunk_start, order = (np.full(s, -7, np.int32) for s in (heads + 1, heads + 1, n * heads))
    kernels.heads(n, heads, 8, ptr(start), ptr(chunk_start), ptr(order))
    np.testing.assert_array_equal(start, np.arange(heads + 1) * n)
    np.testing.assert_array_equal(chunk_start, np.arange(heads + 1) * 2)
    np.testing.assert_array_equal(order, (np.arange(n)[None, :] * heads + np.arange(heads)[:, None]).reshape(-1))


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.gating)
def test_whole_moe_layer(kernels, spec):
    """route -> group -> grouped gate/up -> activation -> grouped down -> weighted sum, against CPUBackend.moe."""
    rng = np.random.default_rng(3)
    n, d, ffn, e, k = 10, 64, 16, spec.experts, spec.experts_used
    cpu = CPUBackend("f64")
    router, gate, up, down = (f32(rng.standard_normal(s) / 4) for s in ((e, d), (e, ffn, d), (e, ffn, d), (e, d, ffn)))
    biases = [f32(rng.standard_normal(s)) for s in ((e, ffn), (e, ffn), (e, d))]
    x = f32(rng.standard_normal((n, d)))
    weights = MoEWeights(router, gate, up, down, None, *biases)
    want = cpu.moe(x.astype(np.float64), weights, spec)
    logits = f32(x @ router.T)
    ids, w = np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)
    route_on_host(kernels, logits, None, ids, w, spec)
    start, chunk_start, order = (np.zeros(s, np.int32) for s in (e + 1, e + 1, n * k))
    kernels.group(ptr(ids), n * k, e, 8, ptr(start), ptr(chunk_start), ptr(order))
    blocks = -(-n * k // 8) + e

    def product(matrix, bias, inputs, x_div, up=None, up_bias=None):
        out = np.full((n * k, matrix.shape[1]), np.nan, np.float32)
        kernels.grouped_TF32(
            ptr(matrix),
            ctypes.c_longlong(matrix.size // 8),
            ptr(start),
            ptr(chunk_start),
            ptr(order),
            e,
            ptr(inputs),
            x_div,
            ptr(out),
            ptr(bias),
            matrix.shape[1],
            matrix.shape[2],
            blocks,
            ptr(up),
            ptr(up_bias),
            int(spec.activation == "swiglu_oai"),
        )
        return out

    g, u = product(gate, biases[0], x, k), product(up, biases[1], x, k)
    h = np.full_like(g, np.nan)
    kernels.glu(
        ptr(g),
        ptr(u),
        ptr(h),
        ctypes.c_longlong(g.size),
        int(spec.activation == "swiglu_oai"),
        ctypes.c_float(spec.alpha),
        ctypes.c_float(spec.limit),
    )
    np.testing.assert_allclose(product(gate, biases[0], x, k, up, biases[1]), h, rtol=1e-5, atol=1e-6)  # fused
    y = product(down, biases[2], h, 1)
    out = np.full((n, d), np.nan, np.float32)
    kernels.combine(ptr(y), ptr(w), None, ptr(out), n, k, d)
    decided = selection_margin(logits, spec) > 1e-4
    np.testing.assert_allclose(out[decided], want[decided], rtol=1e-4, atol=1e-5 * np.abs(want).max())
    residual, summed = rng.standard_normal((n, d)).astype(np.float32), np.full((n, d), np.nan, np.float32)
    kernels.combine(ptr(y), ptr(w), ptr(residual), ptr(summed), n, k, d)  # the layer's residual add, fused
    np.testing.assert_array_equal(summed, residual + out)


@pytest.mark.parametrize("window", [0, 4])
def test_mla_attention(kernels, window):
    """Latent attention over 13 positions, windowed or not: whole, and each token's own range (from its window's
    start) cut into 2 splits of multiples of 8 keys and 4 of multiples of 2 (the last's 13 keys in parts of 4)."""
    rng = np.random.default_rng(5 + window)
    heads, rank, rope, n, page_size = 5, 32, 8, 13, 4
    cpu = CPUBackend("f64")
    layout = KVLayout(1, rank + rope, rank, window=window or None, latent=True)
    kv = cpu.allocate_kv([layout], 1, 16, page_size=page_size)
    cpu.set_pages(kv, 0, kv.page_table[0][::-1].copy())
    args = [f32(rng.standard_normal(s)) for s in ((n, heads, rank), (n, heads, rope), (n, rank), (n, rope))]
    batch = Batch([Row(0, 0, np.zeros(n, int), all_logits=True)])
    want = cpu.mla_attention(*(a.astype(np.float64) for a in args), kv, 0, batch, 0.3)
    cache = np.full(4 * page_size * (rank + rope), np.nan, np.float32)
    table = np.ascontiguousarray(kv.page_table, np.int32)
    slots, pos = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    for splits, split in ((1, 64), (2, 8), (4, 2)):
        out = np.full((n, heads, rank), np.nan, np.float32)
        ml, acc = np.zeros(n * heads * splits * 2, np.float32), np.zeros(n * heads * splits * rank, np.float32)
        kernels.mla(
            *(ptr(a) for a in args),
            ptr(cache),
            ptr(table),
            ptr(slots),
            ptr(pos),
            ptr(out),
            ptr(ml),
            ptr(acc),
            n,
            heads,
            rank,
            rope,
            table.shape[1],
            page_size,
            window,
            split,
            splits,
            ctypes.c_float(0.3),
        )
        if splits == 1:
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        else:  # the partial results merged as ops.cu's attention_combine does
            merged = merged_splits(ml.reshape(n * heads, splits, 2), acc.reshape(n * heads, splits, rank))
            np.testing.assert_allclose(merged.reshape(n, heads, rank), want, rtol=1e-5, atol=1e-6)


def test_mla_attention_q8_0(kernels):
    """mla_kv_write<i8> stores [latent, k_rope] as the CPU's q8_0 latent cache does, bit for bit, and attention
    over it (one split and two) equals the CPU's."""
    rng = np.random.default_rng(40)
    heads, rank, rope, n, page_size = 5, 56, 8, 13, 4
    cpu = CPUBackend("f64")
    kv = cpu.allocate_kv([KVLayout(1, rank + rope, rank, latent=True)], 1, 16, page_size=page_size, dtype="q8_0")
    cpu.set_pages(kv, 0, kv.page_table[0][::-1].copy())
    args = [f32(rng.standard_normal(s)) for s in ((n, heads, rank), (n, heads, rope), (n, rank), (n, rope))]
    batch = Batch([Row(0, 0, np.zeros(n, int), all_logits=True)])
    want = cpu.mla_attention(*(a.astype(np.float64) for a in args), kv, 0, batch, 0.3)
    table = np.ascontiguousarray(kv.page_table, np.int32)
    slots, pos = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    for splits, split in ((1, 64), (2, 8)):
        cache, scales = np.zeros(4 * page_size * (rank + rope), np.int8), np.zeros(4 * page_size * 2, np.uint16)
        out = np.full((n, heads, rank), np.nan, np.float32)
        ml, acc = np.zeros(n * heads * splits * 2, np.float32), np.zeros(n * heads * splits * rank, np.float32)
        kernels.mla_q8_0(
            *map(ptr, (*args, cache, scales, table, slots, pos, out, ml, acc)),
            n,
            heads,
            rank,
            rope,
            table.shape[1],
            page_size,
            0,
            split,
            splits,
            ctypes.c_float(0.3),
        )
        np.testing.assert_array_equal(cache.reshape(kv.k[0].shape), kv.k[0])
        np.testing.assert_array_equal(scales, kv.k_scale[0].reshape(-1).view(np.uint16))
        if splits == 1:
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        else:
            merged = merged_splits(ml.reshape(n * heads, splits, 2), acc.reshape(n * heads, splits, rank))
            np.testing.assert_allclose(merged.reshape(n, heads, rank), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,window", [("f16", 0), ("f16", 11), ("q8_0", 0)])
def test_mla_attention_on_tensor_cores(kernels, dtype, window):
    """mla_attention_tc (rank 64 + rope 32 here) over the float64 CPU backend's f16 or q8_0 latent cache of 40
    positions (pages out of order), 20 heads (a block of 16 and one of 4): whole, and each token's range cut into
    3 splits of multiples of 16 keys and 5 of multiples of 3, merged as attention_combine merges them. Queries past
    f16's range (rounded through their per-head scale) and f16 probabilities keep it within 1e-3 (2-3e-4 here); with
    the queries' rope dims zeroed it is 0.1 away or more."""
    rng = np.random.default_rng(70 + window)
    heads, rank, rope, n, page_size = 20, 64, 32, 40, 4
    cpu = CPUBackend("f64")
    layout = KVLayout(1, rank + rope, rank, window=window or None, latent=True)
    kv = cpu.allocate_kv([layout], 1, 48, page_size=page_size, dtype=dtype)
    cpu.set_pages(kv, 0, kv.page_table[0][::-1].copy())
    args = [rng.standard_normal(s) for s in ((n, heads, rank), (n, heads, rope), (n, rank), (n, rope))]
    args[0] *= 1e5  # queries past f16's range (65504): rounded to f16 only through the per-head scale
    args[1] *= 1e5
    scale = 1e-6
    batch = Batch([Row(0, 0, np.zeros(n, int), all_logits=True)])
    want = cpu.mla_attention(*args, kv, 0, batch, scale)
    q8_0 = dtype == "q8_0"
    cache = np.ascontiguousarray(kv.k[0]) if q8_0 else np.ascontiguousarray(kv.k[0]).view(np.uint16)
    scales = np.ascontiguousarray(kv.k_scale[0]).view(np.uint16) if q8_0 else None
    table = np.ascontiguousarray(kv.page_table, np.int32)
    slots, pos = np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    ql, qr = f32(args[0]), f32(args[1])

    def run(splits, split, query_rope):
        out = np.full((n, heads, rank), np.nan, np.float32)
        ml, acc = np.zeros(n * heads * splits * 2, np.float32), np.zeros(n * heads * splits * rank, np.float32)
        kernels.mla_tc(
            *map(ptr, (ql, query_rope, cache, scales, table, slots, pos, out, ml, acc)),
            n,
            heads,
            table.shape[1],
            page_size,
            window,
            split,
            splits,
            ctypes.c_float(scale),
            int(q8_0),
        )
        if splits == 1:
            return out
        return merged_splits(ml.reshape(n * heads, splits, 2), acc.reshape(n * heads, splits, rank)).reshape(out.shape)

    for splits, split in ((1, 64), (3, 16), (5, 3)):
        got = run(splits, split, qr)
        assert np.isfinite(got).all()
        assert relative_error(got, want) < 1e-3, (splits, relative_error(got, want))
    assert relative_error(run(1, 64, np.zeros_like(qr)), want) > 0.1


@pytest.mark.parametrize("neox", [0, 1])
def test_rope_magnitude(ops_kernels, neox):
    from leat.backend import RopeSpec

    rng = np.random.default_rng(9)
    spec = RopeSpec(16, 10000.0, bool(neox), 1.0, np.linspace(1, 4, 8), attn_factor=1.3465735902799727)
    x, positions = f32(rng.standard_normal((3, 2, 16))), np.array([0, 5, 300], np.int32)
    want = CPUBackend("f64").rope(x.astype(np.float64), positions, spec)
    inv_freq = np.ascontiguousarray(spec.base ** (-np.arange(8, dtype=np.float64) * 2 / 16) / spec.freq_factors)
    got = np.full_like(x, np.nan)
    ops_kernels.rotate(
        ptr(x), ptr(got), ptr(positions), ptr(inv_freq), 3, 2, 16, 16, neox, ctypes.c_float(spec.attn_factor)
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
