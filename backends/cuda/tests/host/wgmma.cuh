// Host stand-in for kernels/wgmma.cuh (test_wgmma_on_host.py): wgmma.m64nNk16 with A from registers across a
// warpgroup of fibers. A warp's 16 rows of the product need only its own lanes' A fragments, so each lane posts
// its fragment, waits for its warp, and adds its places of the 16 x 8 NT product: A by PTX's fragment layout (as
// mma.cuh's), B read from the harness's shared memory where the descriptor says (start address, and the leading
// and stride byte offsets: element (k, n) of a K-major B at start + (n / 8) SBO + (k / 8) LBO + (n % 8) 16 +
// (k % 8) 2 bytes). The products are done when issued, so the fences and waits do nothing.
#pragma once
#include "common.cuh"

inline u32 host_wg_fragments[1024][4];
inline u32 shared_address(const void* p) { return (u32)((const char*)p - (const char*)host_smem); }
inline void wg_fence() {}
inline void wg_commit() {}
template <int N> void wg_wait() {}
inline void proxy_fence() {}
inline void keep_reg(float&) {}

// f16x2 arithmetic: each half in double (a product of two f16 and a sum with a third are exact there), rounded to
// f16 once, as the device's .rn instructions round
inline u32 h2_apply(u32 a, u32 b, u32 c, int op) {
    u32 r = 0;
    for (int h = 0; h < 2; ++h) {
        const double x = f16_to_f32((u16)(a >> 16 * h)), y = f16_to_f32((u16)(b >> 16 * h)), z = f16_to_f32((u16)(c >> 16 * h));
        const _Float16 v = (_Float16)(op == 0 ? x + y : op == 1 ? x * y : x * y + z);
        u16 bits;
        memcpy(&bits, &v, 2);
        r |= (u32)bits << 16 * h;
    }
    return r;
}
inline u32 h2_add(u32 a, u32 b) { return h2_apply(a, b, 0, 0); }
inline u32 h2_mul(u32 a, u32 b) { return h2_apply(a, b, 0, 1); }
inline u32 h2_fma(u32 a, u32 b, u32 c) { return h2_apply(a, b, c, 2); }

template <int NT>
struct WG {
    static void mma(float (&d)[4 * NT], const u32 (&a)[4], u64 desc) {
        const unsigned me = threadIdx.x, warp = me & ~31u, g = (me & 31) >> 2, t = me & 3;
        memcpy(host_wg_fragments[me], a, sizeof(a));
        __syncwarp();
        const unsigned start = (desc & 0x3FFF) << 4, lbo = ((desc >> 16) & 0x3FFF) << 4, sbo = ((desc >> 32) & 0x3FFF) << 4;
        const char* smem = (const char*)host_smem;
        auto half = [](u32 word, int k) { return f16_to_f32((u16)(k & 1 ? word >> 16 : word & 0xFFFF)); };
        float sums[4 * NT] = {};
        for (int i = 0; i < 4 * NT; ++i) {
            const int r = g + 8 * ((i >> 1) & 1), n = 8 * (i >> 2) + 2 * t + (i & 1);
            for (int k = 0; k < 16; ++k) {
                u16 b;
                memcpy(&b, smem + start + (n / 8) * sbo + (k / 8) * lbo + (n % 8) * 16 + (k % 8) * 2, 2);
                sums[i] += half(host_wg_fragments[warp + (r % 8) * 4 + (k % 8) / 2][r / 8 + 2 * (k / 8)], k) * f16_to_f32(b);
            }
        }
        __syncwarp();
        for (int i = 0; i < 4 * NT; ++i) d[i] += sums[i];
    }
};
