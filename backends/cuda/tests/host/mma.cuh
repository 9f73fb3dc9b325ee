// Host stand-in for kernels/mma.cuh: mma.sync m16n8k16 (f16 inputs, float32 sums) across a warp of fibers
// (test_moe_mla_on_host.py's SHIM): each lane posts its A and B fragments, waits for the warp, and adds its four
// places of the 16 x 8 product, reading the others' fragments by PTX's layout.
#pragma once
#include "common.cuh"

inline u32 host_fragments[1024][6];

inline void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    const unsigned me = threadIdx.x, warp = me & ~31u, g = (me & 31) >> 2, t = me & 3;
    memcpy(host_fragments[me], a, sizeof(a));
    host_fragments[me][4] = b0;
    host_fragments[me][5] = b1;
    __syncwarp();
    auto half = [](u32 word, int k) { return f16_to_f32((u16)(k & 1 ? word >> 16 : word & 0xFFFF)); };
    // A [16, 16] row-major: row r, column k is in lane (r % 8) * 4 + (k % 8) / 2, register r / 8 + 2 (k / 8);
    // B [16, 8] by columns: row k, column n in lane n * 4 + (k % 8) / 2, register k / 8
    float sums[4] = {};
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
        for (int k = 0; k < 16; ++k)
            sums[i] += half(host_fragments[warp + (r % 8) * 4 + (k % 8) / 2][r / 8 + 2 * (k / 8)], k) *
                       half(host_fragments[warp + n * 4 + (k % 8) / 2][4 + k / 8], k);
    }
    __syncwarp();
    for (int i = 0; i < 4; ++i) c[i] += sums[i];
}

// ldmatrix .x4: lane l gives the address of row l % 8 of tile l / 8; each lane receives, of tile j in register j,
// row lane / 4 at columns 2 (lane % 4) and + 1; transposed (.trans), column lane / 4 at rows 2 (lane % 4) and + 1.
inline const u16* host_rows[1024];

inline void host_ldmatrix(u32 (&r)[4], const u16* p, bool trans) {
    const unsigned me = threadIdx.x, warp = me & ~31u, lane = me & 31;
    host_rows[me] = p;
    __syncwarp();
    for (int j = 0; j < 4; ++j) {
        const u16* const* tile = host_rows + warp + 8 * j;
        const unsigned a = 2 * (lane % 4), b = lane / 4;
        r[j] = trans ? tile[a][b] | (u32)tile[a + 1][b] << 16 : tile[b][a] | (u32)tile[b][a + 1] << 16;
    }
    __syncwarp();
}
inline void ldmatrix_x4(u32 (&r)[4], const u16* p) { host_ldmatrix(r, p, false); }
inline void ldmatrix_x4_trans(u32 (&r)[4], const u16* p) { host_ldmatrix(r, p, true); }

// cp.async as a plain copy (the host's copies are done when issued; the kernels' barriers still order them)
inline void cp_async16(void* dst, const void* src, int bytes) {
    if (bytes) memcpy(dst, src, 16);
    else memset(dst, 0, 16);
}
inline void cp_async_commit() {}
template <int N> void cp_async_wait() {}
