/* Products with GGUF blocks as stored: blocks are decoded in vector registers and multiplied in float32.
 *
 * Every type has one decoder, chunk_<TYPE>(block, c): the c-th 16 values of a block as a vector of 16 floats,
 * written from gguf-py's dequantize_blocks (the tests compare it with gguf.quants.dequantize). Vectors are GCC
 * vector extensions: 16 floats are one AVX-512 register, two AVX2 ones. From the decoder come two entry points:
 *   gemv_<TYPE>(w, rows, k, x, n, y, threads): y[t][r] = dot(row r of w, x[t]) for n activation rows x [n][k];
 *       y[t][r] does not depend on n (each activation row's sum runs alone, in the same order), so a batch of
 *       decode steps equals the steps one by one;
 *   dequant_<TYPE>(w, ids, count, k, out, threads): rows ids[0..count-1] (ids NULL: the first count rows) into
 *       out [count][k], float32 (embedding lookups, and a prompt's products where there is no VNNI);
 *   gemm_<TYPE>(w, rows, k, x, n, y, xmax, threads): a prompt's product, with int16 activations and integer dot
 *       products (below, "prompt GEMM"), from a second decoder per type, ichunk_<TYPE> (on AVX2 gemmb_q4_k,
 *       gemmb_q6_k decode its panels a block at a time);
 *   igemv_<TYPE> (and on AVX2 igemvb_q4_k, igemvb_q6_k, a block at a time; with AVX-512 VBMI igemvb_q4_0,
 *       igemvb_q4_1, igemvb_q5_0, two blocks at a time, and igemvb_q4_k, igemvb_q6_k, four groups at a time): a few
 *       rows' product with the GEMM's int16 activations (below, "decode GEMV with integer dot products").
 * Rows are split over `threads` threads (the caller's and a pool's, below).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* Sums in a fixed order inside a function (the flags allow reassociation elsewhere): NO_REASSOCIATION opens its body
 * for clang, KEEP_ORDER marks it for GCC (which keeps no pragma for it inside a function). */
#ifdef __clang__
#define NO_REASSOCIATION _Pragma("clang fp reassociate(off)")
#define KEEP_ORDER
#else
#define NO_REASSOCIATION
#define KEEP_ORDER __attribute__((optimize("no-associative-math")))
#endif

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef int8_t vsb __attribute__((vector_size(16)));

static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const vsb KVALUES_IQ4NL = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const vsb KVALUES_MXFP4 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}; /* e2m1, doubled */

static inline vb bytes(const uint8_t *p) {
    vb v;
    memcpy(&v, p, 16);
    return v;
}
#if defined(__AVX512F__)
/* GCC 12 widens 16 bytes to 16 int32 lane by lane through general registers: say vpmovzxbd/vpmovsxbd */
static inline vf floats(vb v) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)v)); }
static inline vf signed_floats(vsb v) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)v)); }
static inline vf lookup(vsb table, vb index) { return signed_floats((vsb)_mm_shuffle_epi8((__m128i)table, (__m128i)index)); }
#else
static inline vf floats(vb v) { return __builtin_convertvector(__builtin_convertvector(v, vi), vf); }
static inline vf signed_floats(vsb v) { return __builtin_convertvector(__builtin_convertvector(v, vi), vf); }
/* table[index] in each of 16 byte lanes (GCC's shuffle; clang has no variable one, so lane by lane) */
static inline vsb bytes_lookup(vsb table, vb index) {
#if defined(__clang__)
    vsb out;
    for (int i = 0; i < 16; i++) out[i] = table[index[i] & 15];
    return out;
#else
    return __builtin_shuffle(table, (vsb)index);
#endif
}
static inline vf lookup(vsb table, vb index) { return signed_floats(bytes_lookup(table, index)); }
#endif
static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, 64);
    return v;
}

static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp of 16 floats: Cephes' expf (exp(r) on |r| <= ln2 / 2 by a degree-7 polynomial, times 2^n by adding n to its
 * exponent bits: p is in [0.70, 1.42], and below 1 where n reaches 128), inf above 88.72, 0 below -87.34 (where
 * float32 has only subnormals left), nan for nan */
static inline vf vexp(vf x) {
    vf c = pick(x > 88.72f, (vf){0} + 88.72f, x);
    c = pick(c < -87.33f, (vf){0} - 87.33f, c);
    vf t = c * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(t, vi);
    n += __builtin_convertvector(n, vf) > t; /* truncation to floor: a comparison is -1 where true */
    vf fn = __builtin_convertvector(n, vf);
    vf r = c - fn * 0.693359375f + fn * 2.12194440e-4f;
    vf p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
            1.6666665459e-1f) * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vf y = (vf)((vi)p + (n << 23));
    y = pick(x > 88.7228394f, (vf){0} + INFINITY, y);
    y = pick(x < -87.3365448f, (vf){0}, y);
    return pick(x != x, x, y);
}

static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Bits (word >> (shift + lane)) & 1 of the 16 lanes, as 0/1 floats (the fifth bit of Q5_0/Q5_1). */
static inline vi bits16(uint32_t word, int shift) { return (((vi){0} + (int32_t)(word >> shift)) >> IOTA) & 1; }

/* Q4_0, 18 bytes: f16 d, 16 bytes of nibbles (low: values 0-15, high: 16-31); value d * (q - 8) */
static inline vf chunk_q4_0(const uint8_t *b, int c) { return f16(b) * (floats((bytes(b + 2) >> (4 * c)) & 15) - 8); }

/* Q4_1, 20 bytes: f16 d, f16 m, nibbles as Q4_0; value d * q + m */
static inline vf chunk_q4_1(const uint8_t *b, int c) { return f16(b) * floats((bytes(b + 4) >> (4 * c)) & 15) + f16(b + 2); }

/* Q5_0, 22 bytes: f16 d, 32 high bits (little-endian u32, bit i for value i), nibbles as Q4_0; d * (q - 16) */
static inline vf chunk_q5_0(const uint8_t *b, int c) {
    vi q = __builtin_convertvector((bytes(b + 6) >> (4 * c)) & 15, vi) | (bits16(u32(b + 2), 16 * c) << 4);
    return f16(b) * (__builtin_convertvector(q, vf) - 16);
}

/* Q5_1, 24 bytes: f16 d, f16 m, high bits and nibbles as Q5_0; d * q + m */
static inline vf chunk_q5_1(const uint8_t *b, int c) {
    vi q = __builtin_convertvector((bytes(b + 8) >> (4 * c)) & 15, vi) | (bits16(u32(b + 4), 16 * c) << 4);
    return f16(b) * __builtin_convertvector(q, vf) + f16(b + 2);
}

/* Q8_0, 34 bytes: f16 d, 32 int8; d * q */
static inline vf chunk_q8_0(const uint8_t *b, int c) { return f16(b) * signed_floats((vsb)bytes(b + 2 + 16 * c)); }

/* MXFP4, 17 bytes: e8m0 exponent e, nibbles as Q4_0 indexing e2m1 values (doubled); value * 2^(e - 128) */
static inline vf chunk_mxfp4(const uint8_t *b, int c) {
    uint32_t bits = b[0] < 2 ? 0x00200000u << b[0] : (uint32_t)(b[0] - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d * lookup(KVALUES_MXFP4, (bytes(b + 1) >> (4 * c)) & 15);
}

/* IQ4_NL, 18 bytes: f16 d, nibbles as Q4_0 indexing the non-linear table; d * table[q] */
static inline vf chunk_iq4_nl(const uint8_t *b, int c) { return f16(b) * lookup(KVALUES_IQ4NL, (bytes(b + 2) >> (4 * c)) & 15); }

/* Q2_K, 84 bytes: 16 scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of 2-bit values,
 * f16 d, f16 dmin. Value i = 128h + 32s + j is (qs[32h + j] >> 2s) & 3 in group i / 16: d*sc*q - dmin*mn. */
static inline vf chunk_q2_k(const uint8_t *b, int c) {
    int h = c / 8, s = (c % 8) / 2, half = c % 2;
    vf q = floats((bytes(b + 16 + h * 32 + half * 16) >> (2 * s)) & 3);
    return f16(b + 80) * (float)(b[c] & 15) * q - f16(b + 82) * (float)(b[c] >> 4);
}

/* Q3_K, 110 bytes: 32 bytes hmask, 64 bytes of low 2 bits (as Q2_K), 12 bytes of 6-bit scales, f16 d.
 * Value i = 128h + 32s + j: low (qs[32h + j] >> 2s) & 3, minus 4 where bit (4h + s) of hmask[j] is clear;
 * scale of group g = i / 16: low nibble of byte g % 8 (>> 4 for g >= 8), high 2 bits from byte 8 + g % 4
 * (>> 2 (g / 4)), minus 32. */
static inline vf chunk_q3_k(const uint8_t *b, int c) {
    int h = c / 8, s = (c % 8) / 2, half = c % 2;
    const uint8_t *sc = b + 96;
    int scale = (((sc[c % 8] >> (4 * (c / 8))) & 15) | (((sc[8 + c % 4] >> (2 * (c / 4))) & 3) << 4)) - 32;
    vb low = (bytes(b + 32 + h * 32 + half * 16) >> (2 * s)) & 3;
    vb high = (bytes(b + half * 16) >> (4 * h + s)) & 1;
    return f16(b + 108) * (float)scale * (floats(low) - 4 * (1 - floats(high)));
}

/* The 6-bit scale and min of sub-block g (0-7) of Q4_K and Q5_K from their 12 packed bytes. */
static inline void scale_min_k4(const uint8_t *s, int g, float *sc, float *mn) {
    if (g < 4) {
        *sc = (float)(s[g] & 63);
        *mn = (float)(s[g + 4] & 63);
    } else {
        *sc = (float)((s[g + 4] & 15) | ((s[g - 4] >> 6) << 4));
        *mn = (float)((s[g + 4] >> 4) | ((s[g] >> 6) << 4));
    }
}

/* Q4_K, 144 bytes: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles. Value i = 64p + 32s + j is
 * (qs[32p + j] >> 4s) & 15 in sub-block 2p + s: d*sc*q - dmin*mn. */
static inline vf chunk_q4_k(const uint8_t *b, int c) {
    int p = c / 4, s = (c / 2) % 2, half = c % 2;
    float sc, mn;
    scale_min_k4(b + 4, 2 * p + s, &sc, &mn);
    return f16(b) * sc * floats((bytes(b + 16 + p * 32 + half * 16) >> (4 * s)) & 15) - f16(b + 2) * mn;
}

/* Q5_K, 176 bytes: as Q4_K with 32 bytes of high bits before the nibbles: value i = 32g + j takes bit g of
 * qh[j] as its fifth bit. */
static inline vf chunk_q5_k(const uint8_t *b, int c) {
    int p = c / 4, s = (c / 2) % 2, half = c % 2, g = 2 * p + s;
    float sc, mn;
    scale_min_k4(b + 4, g, &sc, &mn);
    vb q = ((bytes(b + 48 + p * 32 + half * 16) >> (4 * s)) & 15) | (((bytes(b + 16 + half * 16) >> g) & 1) << 4);
    return f16(b) * sc * floats(q) - f16(b + 2) * mn;
}

/* Q6_K, 210 bytes: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d. Value i = 128h + 32s + j:
 * low (ql[64h + 32(s & 1) + j] >> 4(s >> 1)) & 15, high (qh[32h + j] >> 2s) & 3; d * scale[i / 16] * (q - 32). */
static inline vf chunk_q6_k(const uint8_t *b, int c) {
    int h = c / 8, s = (c % 8) / 2, half = c % 2;
    vb low = (bytes(b + h * 64 + (s & 1) * 32 + half * 16) >> (4 * (s >> 1))) & 15;
    vb high = (bytes(b + 128 + h * 32 + half * 16) >> (2 * s)) & 3;
    return f16(b + 208) * (float)(int8_t)b[192 + c] * (floats(low | (high << 4)) - 32);
}

/* IQ4_XS, 136 bytes: f16 d, u16 of high scale bits (2 per sub-block), 4 bytes of low scale nibbles, 128 bytes of
 * nibbles. Sub-block g (32 values): scale ((sl[g/2] >> 4(g%2)) & 15 | ((sh >> 2g) & 3) << 4) - 32; value
 * 32g + 16s + j is table[(qs[16g + j] >> 4s) & 15]. */
static inline vf chunk_iq4_xs(const uint8_t *b, int c) {
    int g = c / 2, s = c % 2;
    int sh = b[2] | (b[3] << 8);
    int scale = (((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((sh >> (2 * g)) & 3) << 4)) - 32;
    return f16(b) * (float)scale * lookup(KVALUES_IQ4NL, (bytes(b + 8 + g * 16) >> (4 * s)) & 15);
}

/* The sums of 16 vectors: lane j of the result is the sum of v[j]'s lanes. With AVX-512, halves, quarters, pairs
 * and lanes of pairs of vectors are added in a tree (31 two-vector permutes and 15 adds in all), which leaves key j in
 * lane bitrev4(j); a last permute puts it back. */
static inline vf sum16(const vf *v) {
#if defined(__AVX512F__)
    static const vi halves[2] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                 {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
    static const vi quarters[2] = {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                                   {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}};
    static const vi pairs[2] = {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                                {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}};
    static const vi lanes[2] = {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                                {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
    static const vi bitrev = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#define ADD_PERMUTED(a, b, masks)                                                                                    \
    ((vf)_mm512_permutex2var_ps((__m512)(a), (__m512i)(masks)[0], (__m512)(b)) +                                    \
     (vf)_mm512_permutex2var_ps((__m512)(a), (__m512i)(masks)[1], (__m512)(b)))
    vf a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) a[j] = ADD_PERMUTED(v[2 * j], v[2 * j + 1], halves);
    for (int j = 0; j < 4; j++) b[j] = ADD_PERMUTED(a[2 * j], a[2 * j + 1], quarters);
    for (int j = 0; j < 2; j++) c[j] = ADD_PERMUTED(b[2 * j], b[2 * j + 1], pairs);
    vf d = ADD_PERMUTED(c[0], c[1], lanes);
#undef ADD_PERMUTED
    return (vf)_mm512_permutexvar_ps((__m512i)bitrev, (__m512)d);
#else
    vf out;
    for (int j = 0; j < 16; j++) {
        float s = 0;
        for (int l = 0; l < 16; l++) s += v[j][l];
        out[j] = s;
    }
    return out;
#endif
}

/* tanh(x) = 1 - 2 / (1 + exp(2x)): 1 and -1 where exp overflows or vanishes; absolute error about 1e-7 */
static inline vf vtanh(vf x) { return 1.0f - 2.0f / (1.0f + vexp(2.0f * x)); }

/* -- integer decoders (the prompt GEMM) -------------------------------------------------------------------------
 * ichunk_<TYPE>(block, c, &scale, &offset): the c-th 16 values of a block as integers q (16 int32 lanes), value =
 * scale * q + offset. Chunks 2g and 2g + 1 share their scale: where a type scales 16 values apart (Q2_K, Q3_K,
 * Q6_K) that scale is folded into q, so every 32 values have one float scale. |q| <= 4096 (Q6_K), <= 128 otherwise.
 * OFFSETS_<TYPE>: 0 no offset, 1 one per 32 values, 2 one per 16 (Q2_K). */
#if defined(__AVX512F__)
static inline vi ints(vb v) { return (vi)_mm512_cvtepu8_epi32((__m128i)v); }
static inline vi signed_ints(vsb v) { return (vi)_mm512_cvtepi8_epi32((__m128i)v); }
static inline vi ilookup(vsb table, vb index) { return signed_ints((vsb)_mm_shuffle_epi8((__m128i)table, (__m128i)index)); }
#else
static inline vi ints(vb v) { return __builtin_convertvector(v, vi); }
static inline vi signed_ints(vsb v) { return __builtin_convertvector(v, vi); }
static inline vi ilookup(vsb table, vb index) { return signed_ints(bytes_lookup(table, index)); }
#endif
enum { OFFSETS_q4_0 = 0, OFFSETS_q5_0 = 0, OFFSETS_q8_0 = 0, OFFSETS_mxfp4 = 0, OFFSETS_iq4_nl = 0, OFFSETS_q3_k = 0 };
enum { OFFSETS_q6_k = 0, OFFSETS_iq4_xs = 0, OFFSETS_q4_1 = 1, OFFSETS_q5_1 = 1, OFFSETS_q4_k = 1, OFFSETS_q5_k = 1 };
enum { OFFSETS_q2_k = 2 };

static inline vi ichunk_q4_0(const uint8_t *b, int c, float *s, float *o) {
    *s = f16(b), *o = 0;
    return ints((bytes(b + 2) >> (4 * c)) & 15) - 8;
}
static inline vi ichunk_q4_1(const uint8_t *b, int c, float *s, float *o) {
    *s = f16(b), *o = f16(b + 2);
    return ints((bytes(b + 4) >> (4 * c)) & 15);
}
static inline vi ichunk_q5_0(const uint8_t *b, int c, float *s, float *o) {
    *s = f16(b), *o = 0;
    return (ints((bytes(b + 6) >> (4 * c)) & 15) | (bits16(u32(b + 2), 16 * c) << 4)) - 16;
}
static inline vi ichunk_q5_1(const uint8_t *b, int c, float *s, float *o) {
    *s = f16(b), *o = f16(b + 2);
    return ints((bytes(b + 8) >> (4 * c)) & 15) | (bits16(u32(b + 4), 16 * c) << 4);
}
static inline vi ichunk_q8_0(const uint8_t *b, int c, float *s, float *o) {
    *s = f16(b), *o = 0;
    return signed_ints((vsb)bytes(b + 2 + 16 * c));
}
static inline vi ichunk_mxfp4(const uint8_t *b, int c, float *s, float *o) {
    uint32_t bits = b[0] < 2 ? 0x00200000u << b[0] : (uint32_t)(b[0] - 1) << 23;
    memcpy(s, &bits, 4);
    *o = 0;
    return ilookup(KVALUES_MXFP4, (bytes(b + 1) >> (4 * c)) & 15);
}
static inline vi ichunk_iq4_nl(const uint8_t *b, int c, float *s, float *o) {
    *s = f16(b), *o = 0;
    return ilookup(KVALUES_IQ4NL, (bytes(b + 2) >> (4 * c)) & 15);
}
static inline vi ichunk_q2_k(const uint8_t *b, int c, float *s, float *o) {
    int h = c / 8, shift = (c % 8) / 2, half = c % 2;
    *s = f16(b + 80), *o = -(f16(b + 82) * (float)(b[c] >> 4));
    return ints((bytes(b + 16 + h * 32 + half * 16) >> (2 * shift)) & 3) * (b[c] & 15);
}
static inline vi ichunk_q3_k(const uint8_t *b, int c, float *s, float *o) {
    int h = c / 8, shift = (c % 8) / 2, half = c % 2;
    const uint8_t *sc = b + 96;
    int scale = (((sc[c % 8] >> (4 * (c / 8))) & 15) | (((sc[8 + c % 4] >> (2 * (c / 4))) & 3) << 4)) - 32;
    vb low = (bytes(b + 32 + h * 32 + half * 16) >> (2 * shift)) & 3;
    vb high = (bytes(b + half * 16) >> (4 * h + shift)) & 1;
    *s = f16(b + 108), *o = 0;
    return (ints(low) - 4 * (1 - ints(high))) * scale;
}
static inline vi ichunk_q4_k(const uint8_t *b, int c, float *s, float *o) {
    int p = c / 4, shift = (c / 2) % 2, half = c % 2;
    float sc, mn;
    scale_min_k4(b + 4, 2 * p + shift, &sc, &mn);
    *s = f16(b) * sc, *o = -(f16(b + 2) * mn);
    return ints((bytes(b + 16 + p * 32 + half * 16) >> (4 * shift)) & 15);
}
static inline vi ichunk_q5_k(const uint8_t *b, int c, float *s, float *o) {
    int p = c / 4, shift = (c / 2) % 2, half = c % 2, g = 2 * p + shift;
    float sc, mn;
    scale_min_k4(b + 4, g, &sc, &mn);
    *s = f16(b) * sc, *o = -(f16(b + 2) * mn);
    return ints(((bytes(b + 48 + p * 32 + half * 16) >> (4 * shift)) & 15) | (((bytes(b + 16 + half * 16) >> g) & 1) << 4));
}
static inline vi ichunk_q6_k(const uint8_t *b, int c, float *s, float *o) {
    int h = c / 8, shift = (c % 8) / 2, half = c % 2;
    vb low = (bytes(b + h * 64 + (shift & 1) * 32 + half * 16) >> (4 * (shift >> 1))) & 15;
    vb high = (bytes(b + 128 + h * 32 + half * 16) >> (2 * shift)) & 3;
    *s = f16(b + 208), *o = 0;
    return (ints(low | (high << 4)) - 32) * (int)(int8_t)b[192 + c];
}
static inline vi ichunk_iq4_xs(const uint8_t *b, int c, float *s, float *o) {
    int g = c / 2, half = c % 2;
    int sh = b[2] | (b[3] << 8);
    int scale = (((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((sh >> (2 * g)) & 3) << 4)) - 32;
    *s = f16(b) * (float)scale, *o = 0;
    return ilookup(KVALUES_IQ4NL, (bytes(b + 8 + g * 16) >> (4 * half)) & 15);
}

/* igroup_<TYPE>(block, g, &scale, &offset0, &offset1): the g-th 32 values of a block as 16 int32 units, unit p holding
 * values p and p + 16 as two int16 (the order the prompt GEMM and the integer GEMV pair activations in): from the
 * ichunk_ decoders, or straight from the nibbles for the types of most small models. */
#define IGROUP(NAME)                                                                                                \
    static inline vi igroup_##NAME(const uint8_t *b, int g, float *s, float *o0, float *o1) {                      \
        vi q0 = ichunk_##NAME(b, 2 * g, s, o0), q1 = ichunk_##NAME(b, 2 * g + 1, s, o1);                          \
        return (q0 & 0xffff) | (q1 << 16);                                                                          \
    }
IGROUP(q5_1)
IGROUP(q8_0)
IGROUP(mxfp4)
IGROUP(iq4_nl)
IGROUP(q2_k)
IGROUP(q3_k)
IGROUP(q4_k)
IGROUP(q5_k)
IGROUP(q6_k)
IGROUP(iq4_xs)

typedef int16_t vs __attribute__((vector_size(64)));
/* byte p of 16 nibble bytes (low nibble value p, high p + 16) as the unit (low, high) */
static inline vi nibble_units(const uint8_t *q) {
    vi v = ints(bytes(q));
    return (v | (v << 12)) & 0x000f000f;
}
static inline vi igroup_q4_0(const uint8_t *b, int g, float *s, float *o0, float *o1) {
    (void)g;
    *s = f16(b), *o0 = *o1 = 0;
    return (vi)((vs)nibble_units(b + 2) - 8);
}
static inline vi igroup_q4_1(const uint8_t *b, int g, float *s, float *o0, float *o1) {
    (void)g;
    *s = f16(b), *o0 = *o1 = f16(b + 2);
    return nibble_units(b + 4);
}
static inline vi igroup_q5_0(const uint8_t *b, int g, float *s, float *o0, float *o1) {
    (void)g;
    *s = f16(b), *o0 = *o1 = 0;
    vi high = (((vi){0} + (int32_t)u32(b + 2)) >> IOTA) & 0x00010001; /* bits p and p + 16 */
    return (vi)((vs)(nibble_units(b + 6) | (high << 4)) - 16);
}

/* -- threads --------------------------------------------------------------------------------------------------
 * A job is `total` items cut into chunks that the caller and up to threads - 1 workers take from one atomic counter.
 * The counter's high 32 bits are the job's generation, so a worker late for a job takes nothing from the next one
 * (and, taking by compare-and-swap, leaves its counter alone);
 * the caller returns when every chunk is done, without waiting for workers that took none (on a busy machine a
 * worker may not be scheduled at all during a short product). Idle workers spin for a while, then sleep. */
#define MAX_THREADS 64
#define SPINS 20000 /* pauses (about 0.5 ms) before an idle worker sleeps */
#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

typedef void (*range_fn)(const void *ctx, int64_t first, int64_t last);

/* A spin-wait's step: a pause, and every 64th a yield, so that on a busy machine the thread being waited for (or
 * BLAS's, or another process's) gets the core. */
static inline void spin_wait(int spin) {
    RELAX();
    if (spin % 64 == 63) sched_yield();
}

static struct {
    pthread_mutex_t busy; /* one job at a time: a second caller meanwhile runs its job alone */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int started;                 /* workers running */
    _Atomic uint64_t next;       /* generation << 32 | next item */
    _Atomic int64_t done;        /* items finished in the current job */
    _Atomic uint32_t generation; /* the current job */
    range_fn fn;
    const void *ctx;
    int64_t total, chunk;
    int threads;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void take_chunks(uint32_t generation) {
    for (;;) {
        /* compare-and-swap, not fetch-add: a worker late from a finished job must not move the next job's counter */
        uint64_t ticket = atomic_load(&pool.next);
        int64_t first = (int64_t)(ticket & 0xffffffffu);
        if ((uint32_t)(ticket >> 32) != generation || first >= pool.total) return;
        if (!atomic_compare_exchange_weak(&pool.next, &ticket, ticket + (uint64_t)pool.chunk)) continue;
        int64_t last = first + pool.chunk < pool.total ? first + pool.chunk : pool.total;
        pool.fn(pool.ctx, first, last);
        atomic_fetch_add(&pool.done, last - first);
    }
}

static void *worker(void *arg) {
    int index = (int)(intptr_t)arg; /* 1-based: the caller is thread 0 */
    uint32_t seen = 0;
    for (;;) {
        uint32_t generation = atomic_load(&pool.generation);
        for (int spin = 0; generation == seen && spin < SPINS; spin++) {
            spin_wait(spin);
            generation = atomic_load(&pool.generation);
        }
        if (generation == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((generation = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = generation;
        if (index < pool.threads) take_chunks(generation);
    }
    return NULL;
}

static void run(int threads, int64_t total, range_fn fn, const void *ctx) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || total < 2 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, total);
        return;
    }
    while (pool.started < threads - 1) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, (void *)(intptr_t)(pool.started + 1)) != 0) break;
        pthread_detach(thread);
        pool.started++;
    }
    uint32_t generation = atomic_load(&pool.generation) + 1;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.total = total;
    pool.threads = threads;
    int64_t chunk = total / (threads * 8); /* small chunks: a descheduled worker holds up little */
    pool.chunk = chunk < 1 ? 1 : chunk;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.next, (uint64_t)generation << 32);
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.generation, generation);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_chunks(generation);
    for (int spin = 0; atomic_load(&pool.done) < total; spin++) spin_wait(spin);
    pthread_mutex_unlock(&pool.busy);
}

/* -- entry points ----------------------------------------------------------------------------------------------- */
typedef struct {
    const uint8_t *w;
    int64_t rows, k, n;
    const float *x;
    float *y;
    const int64_t *ids;
} job;


/* -- prompt GEMM: 16-bit integer activations, integer dot products ----------------------------------------------
 * x [n][k] is rounded per 32 values to int16: s = max|x| / xmax, q = rint(x / s) (xmax 32767, or less where the
 * weight's |q| is large enough for 32 products to overflow int32: the caller's choice). Weights are decoded to int16
 * (ichunk_) a panel of 16 rows at a time, laid out so that one AVX-512 VNNI vpdpwssd multiplies pairs of values of
 * one 32-value group of 16 rows (one per lane) by a broadcast pair of one token's values: units[g][p][row] holds the
 * row's values p and p + 16 of group g as two int16. A group's 16 instructions sum 32 products per lane in int32,
 * exactly; then the lane's float sum gains that int * (weight scale * x scale), plus offset * s * sum(q) for types
 * with offsets. Each decoded panel is reused by every token, TILE tokens at a time (their sums held in registers).
 * So y[t][r] is exactly the float product of the rounded x with the weight's values, summed group by group in
 * float32, and does not depend on the other tokens. */
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__)
#define GEMM 1
typedef struct {
    const uint8_t *w;
    int64_t rows, k, n, row_bytes;
    const int32_t *xu;    /* [n rounded up to TILE][k / 2] pairs of int16 */
    const float *xs, *xo; /* [n][k / 32] scales; [n][2][k / 32] s * sum(q) of each group's first and second half */
    float *y;
    void (*panel)(const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k, int32_t *units, float *scales,
                  float *offsets);
    int offsets;
} gemm_job;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TILE 12
static void quantize_x(const float *x, int64_t n, int64_t k, float xmax, int32_t *xu, float *xs, float *xo) {
    int64_t groups = k / 32;
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < groups; g++) {
            __m512 v0 = _mm512_loadu_ps(x + t * k + 32 * g), v1 = _mm512_loadu_ps(x + t * k + 32 * g + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            /* inf or nan in x (vmaxps passes over nan): the scale is nan, so y is nan, as a float product gives */
            __m512i exponent = _mm512_set1_epi32(0x7f800000);
            int finite = !(_mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v0), exponent), exponent) |
                           _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v1), exponent), exponent));
            float inverse = amax > 0 && finite ? xmax / amax : 0;
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
            __m512i pairs = _mm512_or_si512(_mm512_and_si512(q0, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(q1, 16));
            _mm512_storeu_si512(xu + t * (k / 2) + 16 * g, pairs);
            float s = finite ? amax / xmax : NAN;
            xs[t * groups + g] = s;
            xo[t * 2 * groups + g] = s * (float)_mm512_reduce_add_epi32(q0);
            xo[(t * 2 + 1) * groups + g] = s * (float)_mm512_reduce_add_epi32(q1);
        }
}

static inline __attribute__((always_inline)) void gemm_tile(const gemm_job *j, const int32_t *units, const float *scales,
                                                            const float *offsets, int64_t t0, int64_t r0, int offs) {
    int64_t groups = j->k / 32, stride = j->k / 2;
    const int32_t *xu = j->xu + t0 * stride;
    const float *xs = j->xs + t0 * groups, *xo = j->xo + t0 * groups * 2;
    __m512 sums[TILE];
    for (int t = 0; t < TILE; t++) sums[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[TILE];
        for (int t = 0; t < TILE; t++) acc[t] = _mm512_setzero_si512();
        _Pragma("GCC unroll 16") for (int p = 0; p < 16; p++) {
            __m512i w = _mm512_load_si512(units + (g * 16 + p) * 16);
            for (int t = 0; t < TILE; t++)
                acc[t] = _mm512_dpwssd_epi32(acc[t], w, _mm512_set1_epi32(xu[t * stride + g * 16 + p]));
        }
        __m512 a = _mm512_load_ps(scales + g * 16);
        for (int t = 0; t < TILE; t++)
            sums[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), _mm512_mul_ps(a, _mm512_set1_ps(xs[t * groups + g])), sums[t]);
        if (offs == 1) {
            __m512 o = _mm512_load_ps(offsets + g * 32);
            for (int t = 0; t < TILE; t++) {
                const float *h = xo + t * 2 * groups + g;
                sums[t] = _mm512_fmadd_ps(o, _mm512_set1_ps(h[0] + h[groups]), sums[t]);
            }
        } else if (offs == 2) {
            __m512 lo = _mm512_load_ps(offsets + g * 32), hi = _mm512_load_ps(offsets + g * 32 + 16);
            for (int t = 0; t < TILE; t++) {
                const float *h = xo + t * 2 * groups + g;
                sums[t] = _mm512_fmadd_ps(hi, _mm512_set1_ps(h[groups]), _mm512_fmadd_ps(lo, _mm512_set1_ps(h[0]), sums[t]));
            }
        }
    }
    __mmask16 mask = j->rows - r0 >= 16 ? 0xffff : (__mmask16)((1u << (j->rows - r0)) - 1);
    for (int t = 0; t < TILE && t0 + t < j->n; t++) _mm512_mask_storeu_ps(j->y + (t0 + t) * j->rows + r0, mask, sums[t]);
}

/* igemv's 32 products of one group: pairs of int16 in 16 lanes, summed exactly in int32 */
static inline vi dot_pairs(vi acc, vi w, vi x) {
    return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
}
static inline float sum_lanes(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
/* AVX2: the same products, the same rounding of x and the same int32 sums (vpmaddwd over each half of a 16-lane
 * vector is vpdpwssd's pairs), in two 256-bit registers a vector; 4 tokens a tile (16 registers) */
#define TILE 4
static inline vi dot_pairs(vi acc, vi w, vi x) {
    __m256i a[2], wv[2], xv[2];
    memcpy(a, &acc, 64);
    memcpy(wv, &w, 64);
    memcpy(xv, &x, 64);
    a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(wv[0], xv[0]));
    a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(wv[1], xv[1]));
    memcpy(&acc, a, 64);
    return acc;
}
static inline float sum_lanes(vf v) {
    float total = 0;
    for (int i = 0; i < 16; i++) total += v[i];
    return total;
}
static inline int32_t sum_ints(vi v) {
    int32_t total = 0;
    for (int i = 0; i < 16; i++) total += v[i];
    return total;
}
/* to the nearest integer, ties to even (vcvtps2dq, as the AVX-512 path rounds; an added 1.5 * 2^23 would fuse with
 * the product before it into one rounding) */
static inline vi round_ints(vf v) {
    __m256 h[2];
    __m256i r[2];
    memcpy(h, &v, 64);
    r[0] = _mm256_cvtps_epi32(h[0]);
    r[1] = _mm256_cvtps_epi32(h[1]);
    vi out;
    memcpy(&out, r, 64);
    return out;
}

static void quantize_x(const float *x, int64_t n, int64_t k, float xmax, int32_t *xu, float *xs, float *xo) {
    int64_t groups = k / 32;
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < groups; g++) {
            vf v0 = load(x + t * k + 32 * g), v1 = load(x + t * k + 32 * g + 16);
            vi special = (((vi)v0 & 0x7f800000) == 0x7f800000) | (((vi)v1 & 0x7f800000) == 0x7f800000);
            vf a0 = (vf)((vi)v0 & 0x7fffffff), a1 = (vf)((vi)v1 & 0x7fffffff), m = pick(a0 > a1, a0, a1);
            float amax = 0;
            int finite = 1;
            for (int i = 0; i < 16; i++) {
                amax = m[i] > amax ? m[i] : amax;
                finite &= !special[i];
            }
            /* inf or nan in x: the scale is nan, so y is nan, as a float product gives */
            float inverse = amax > 0 && finite ? xmax / amax : 0;
            vi q0 = round_ints(v0 * inverse), q1 = round_ints(v1 * inverse);
            vi pairs = (q0 & 0xffff) | (q1 << 16);
            memcpy(xu + t * (k / 2) + 16 * g, &pairs, 64);
            float s = finite ? amax / xmax : NAN;
            xs[t * groups + g] = s;
            xo[t * 2 * groups + g] = s * (float)sum_ints(q0);
            xo[(t * 2 + 1) * groups + g] = s * (float)sum_ints(q1);
        }
}

static inline __attribute__((always_inline)) void gemm_tile(const gemm_job *j, const int32_t *units, const float *scales,
                                                            const float *offsets, int64_t t0, int64_t r0, int offs) {
    int64_t groups = j->k / 32, stride = j->k / 2;
    const int32_t *xu = j->xu + t0 * stride;
    const float *xs = j->xs + t0 * groups, *xo = j->xo + t0 * groups * 2;
    vf sums[TILE] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        vi acc[TILE] = {{0}};
        _Pragma("GCC unroll 16") for (int p = 0; p < 16; p++) {
            vi w;
            memcpy(&w, units + (g * 16 + p) * 16, 64);
            for (int t = 0; t < TILE; t++) acc[t] = dot_pairs(acc[t], w, (vi){0} + xu[t * stride + g * 16 + p]);
        }
        vf a = load(scales + g * 16);
        for (int t = 0; t < TILE; t++) sums[t] += __builtin_convertvector(acc[t], vf) * (a * xs[t * groups + g]);
        if (offs == 1) {
            vf o = load(offsets + g * 32);
            for (int t = 0; t < TILE; t++) {
                const float *h = xo + t * 2 * groups + g;
                sums[t] += o * (h[0] + h[groups]);
            }
        } else if (offs == 2) {
            vf lo = load(offsets + g * 32), hi = load(offsets + g * 32 + 16);
            for (int t = 0; t < TILE; t++) {
                const float *h = xo + t * 2 * groups + g;
                sums[t] = hi * h[groups] + (lo * h[0] + sums[t]);
            }
        }
    }
    int64_t rows = j->rows - r0 >= 16 ? 16 : j->rows - r0;
    for (int t = 0; t < TILE && t0 + t < j->n; t++) memcpy(j->y + (t0 + t) * j->rows + r0, &sums[t], sizeof(float) * (size_t)rows);
}
#endif

/* panels first..last-1 (16 rows each): decode, then every token */
static void gemm_panels(const void *arg, int64_t first, int64_t last) {
    const gemm_job *j = arg;
    int64_t groups = j->k / 32;
    int32_t *units = aligned_alloc(64, (size_t)groups * 1024);
    float *scales = aligned_alloc(64, (size_t)groups * 64), *offsets = aligned_alloc(64, (size_t)groups * 128);
    for (int64_t panel = first; panel < last; panel++) {
        int64_t r0 = panel * 16, rows = j->rows - r0 < 16 ? j->rows - r0 : 16;
        j->panel(j->w + r0 * j->row_bytes, j->row_bytes, rows, j->k, units, scales, offsets);
        for (int64_t t0 = 0; t0 < j->n; t0 += TILE) switch (j->offsets) {
            case 0: gemm_tile(j, units, scales, offsets, t0, r0, 0); break;
            case 1: gemm_tile(j, units, scales, offsets, t0, r0, 1); break;
            default: gemm_tile(j, units, scales, offsets, t0, r0, 2);
            }
    }
    free(units);
    free(scales);
    free(offsets);
}

/* a panel of fewer than 16 rows: the rows past the weight's multiply zeros */
static void panel_clear(int64_t rows, int64_t k, int32_t *units, float *scales, float *offsets) {
    if (rows < 16) {
        memset(units, 0, (size_t)(k / 32) * 1024);
        memset(scales, 0, (size_t)(k / 32) * 64);
        memset(offsets, 0, (size_t)(k / 32) * 128);
    }
}
static void gemm(gemm_job *j, const float *x, float xmax, int threads) {
    int64_t groups = j->k / 32, padded = (j->n + TILE - 1) / TILE * TILE;
    int32_t *xu = calloc((size_t)(padded * j->k / 2), 4);
    float *xs = calloc((size_t)(padded * groups), 4), *xo = calloc((size_t)(padded * groups * 2), 4);
    quantize_x(x, j->n, j->k, xmax, xu, xs, xo);
    j->xu = xu, j->xs = xs, j->xo = xo;
    run(threads, (j->rows + 15) / 16, gemm_panels, j);
    free(xu);
    free(xs);
    free(xo);
}

/* -- decode GEMV with integer dot products ------------------------------------------------------------------------
 * A few activation rows (decode steps), rounded to int16 per 32 values as the prompt GEMM rounds them: each weight
 * row's 32-value groups are decoded in registers to int16 pairs (igroup_), one vpdpwssd sums a group's 32 products
 * exactly in int32 lanes, and the lanes gain them times (weight scale * x scale) in float32, plus offset * s * sum(q)
 * for types with offsets. Per 32 values that is two floating-point instructions where the float32 GEMV takes six
 * (Zen 4 issues one 512-bit of them a cycle: that GEMV's bound). y[t][r] depends on x[t] alone, as in the GEMM. */
#define IGEMV_TILE 4 /* tokens whose sums a decoded row serves at once */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* a group's weights as igroup_ gives them; 16 float lanes a token */
#define IGEMV_UNITS(NAME) igroup_##NAME
typedef vf igemv_acc;
static inline vf igemv_group(vf sum, vi units, const int32_t *xu, float scale) {
    vi x;
    memcpy(&x, xu, 64);
    return __builtin_convertvector(dot_pairs((vi){0}, units, x), vf) * scale + sum;
}
static inline float igemv_sum(vf even, vf odd) { return sum_lanes(even + odd); }
static inline void igemv_order_x(int32_t *xu, int64_t count) { (void)xu, (void)count; }
#else
/* AVX2: a group's 32 weights as int16 pairs (value p, value p + 16) in two registers, pairs 0-3 and 8-11 in the
 * first, 4-7 and 12-15 in the second (where vpunpck{l,h}wd leave them; x's pairs are stored in that order for igemv,
 * igemv_order_x), so that two vpmaddwd and one add give 8 int32 lanes of exact sums: for Q4_0, Q4_1 and Q8_0 straight
 * from the block's bytes, for the other types from igroup_'s pairs (Q4_K and Q6_K: igemvb_, a block at a time) */
#define IGEMV_UNITS(NAME) wgroup_##NAME
typedef struct {
    __m256i a, b;
} wgroup;
typedef __m256 igemv_acc;
static inline wgroup pairs_of(__m256i low, __m256i high) {
    return (wgroup){_mm256_unpacklo_epi16(low, high), _mm256_unpackhi_epi16(low, high)};
}
static inline wgroup wgroup_of(vi units) {
    __m256i u[2];
    memcpy(u, &units, 64);
    return (wgroup){_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31)};
}
static inline wgroup wgroup_q4_0(const uint8_t *b, int g, float *s, float *o0, float *o1) {
    (void)g;
    *s = f16(b), *o0 = *o1 = 0;
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 2))), eight = _mm256_set1_epi16(8);
    return pairs_of(_mm256_sub_epi16(_mm256_and_si256(w, _mm256_set1_epi16(15)), eight),
                    _mm256_sub_epi16(_mm256_srli_epi16(w, 4), eight));
}
static inline wgroup wgroup_q4_1(const uint8_t *b, int g, float *s, float *o0, float *o1) {
    (void)g;
    *s = f16(b), *o0 = *o1 = f16(b + 2);
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 4)));
    return pairs_of(_mm256_and_si256(w, _mm256_set1_epi16(15)), _mm256_srli_epi16(w, 4));
}
static inline wgroup wgroup_q8_0(const uint8_t *b, int g, float *s, float *o0, float *o1) {
    (void)g;
    *s = f16(b), *o0 = *o1 = 0;
    return pairs_of(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2))),
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18))));
}
/* Q6_K's chunk c (16 values) as int16 with its int8 scale folded in, as ichunk_q6_k (|q| <= 4096 fits int16): a
 * group's values 0-15 and 16-31 are chunks 2g and 2g + 1 (igemvb_q6_k) */
static inline __m256i q6_k_chunk(const uint8_t *b, int c) {
    int h = c / 8, shift = (c % 8) / 2, half = c % 2;
    __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + h * 64 + (shift & 1) * 32 + half * 16)));
    __m256i high = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 128 + h * 32 + half * 16)));
    low = _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (shift >> 1))), _mm256_set1_epi16(15));
    high = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * shift)), _mm256_set1_epi16(3));
    __m256i q = _mm256_sub_epi16(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi16(32));
    return _mm256_mullo_epi16(q, _mm256_set1_epi16((int16_t)(int8_t)b[192 + c]));
}
#define WGROUP(NAME)                                                                                                \
    static inline wgroup wgroup_##NAME(const uint8_t *b, int g, float *s, float *o0, float *o1) {                  \
        return wgroup_of(igroup_##NAME(b, g, s, o0, o1));                                                           \
    }
WGROUP(q5_0)
WGROUP(q5_1)
WGROUP(mxfp4)
WGROUP(iq4_nl)
WGROUP(q2_k)
WGROUP(q3_k)
WGROUP(q4_k) /* igemvb_q4_k and igemvb_q6_k are what native.py calls for these two */
WGROUP(q5_k)
WGROUP(q6_k)
WGROUP(iq4_xs)
static inline __m256 igemv_group(__m256 sum, wgroup w, const int32_t *xu, float scale) {
    __m256i x0 = _mm256_loadu_si256((const __m256i *)xu), x1 = _mm256_loadu_si256((const __m256i *)(xu + 8));
    __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w.a, x0), _mm256_madd_epi16(w.b, x1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), sum);
}
/* the 8 lanes in order, whatever the tile the row's token is in (GCC with -fassociative-math summed them in another
 * order for some tiles: a token's result then depended on its batch) */
static inline KEEP_ORDER float igemv_sum(__m256 even, __m256 odd) {
    NO_REASSOCIATION
    float lanes[8], total = 0;
    _mm256_storeu_ps(lanes, _mm256_add_ps(even, odd));
    for (int i = 0; i < 8; i++) total += lanes[i];
    return total;
}
/* each group's 16 pairs of x to the order of wgroup's lanes: 0-3, 8-11, 4-7, 12-15 */
static inline void igemv_order_x(int32_t *xu, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) {
        int32_t g[16];
        memcpy(g, xu + i, 64);
        memcpy(xu + i + 4, g + 8, 16);
        memcpy(xu + i + 8, g + 4, 16);
    }
}
#endif

static void igemv(gemm_job *j, const float *x, float xmax, int threads, range_fn rows) {
    int64_t groups = j->k / 32;
    int32_t *xu = malloc(sizeof(int32_t) * (size_t)(j->n * j->k / 2));
    float *xs = malloc(sizeof(float) * (size_t)(j->n * groups)), *xo = malloc(sizeof(float) * (size_t)(j->n * groups * 2));
    quantize_x(x, j->n, j->k, xmax, xu, xs, xo);
    igemv_order_x(xu, j->n * j->k / 2);
    j->xu = xu, j->xs = xs, j->xo = xo;
    run(threads, j->rows, rows, j);
    free(xu);
    free(xs);
    free(xo);
}
/* Entry point NAME of a decode product: rows first..last-1 (NAME_rows), IGEMV_TILE tokens at a time, then 2, then 1,
 * through TILE(job, row, r, t0, tokens); ROW_BYTES may use the entry point's k */
#define IGEMV_ENTRY(NAME, TILE, ROW_BYTES, PANEL, OFFSETS)                                                          \
    IGEMV_ROWS(NAME, TILE)                                                                                          \
    void NAME(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax,           \
              int threads) {                                                                                        \
        gemm_job j_ = {w, rows, k, n, ROW_BYTES, NULL, NULL, NULL, y, PANEL, OFFSETS};                              \
        igemv(&j_, x, xmax, threads, NAME##_rows);                                                                  \
    }
#define IGEMV_ROWS(NAME, TILE)                                                                                      \
    static void NAME##_rows(const void *arg, int64_t first, int64_t last) {                                        \
        const gemm_job *j = arg;                                                                                    \
        for (int64_t r = first; r < last; r++) {                                                                    \
            const uint8_t *row = j->w + r * j->row_bytes;                                                           \
            int64_t t = 0;                                                                                          \
            for (; t + IGEMV_TILE <= j->n; t += IGEMV_TILE) TILE(j, row, r, t, IGEMV_TILE);                         \
            if (IGEMV_TILE > 2 && t + 2 <= j->n) {                                                                  \
                TILE(j, row, r, t, 2);                                                                              \
                t += 2;                                                                                             \
            }                                                                                                       \
            for (; t < j->n; t++) TILE(j, row, r, t, 1);                                                            \
        }                                                                                                           \
    }
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* A Q4_K block's 8 groups as wgroup pairs (straight from the nibbles), their 8 scales (d * scale) and 8 mins
 * (dmin * min): d, dmin, the scales and mins unpacked once a block, as llama.cpp's kmask words do */
static inline __attribute__((always_inline)) void q4_k_block(const uint8_t *blk, wgroup w[8], __m256 *scales,
                                                              __m256 *mins) {
    uint32_t u[4];
    memcpy(u, blk + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    uint32_t mins_low = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_low;
    u[0] &= 0x3f3f3f3fu; /* bytes of u[0..1]: the 8 scales; of u[2..3]: the 8 mins */
    __m128i packed = _mm_loadu_si128((const __m128i *)u);
    *scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)), _mm256_set1_ps(f16(blk)));
    *mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))), _mm256_set1_ps(f16(blk + 2)));
    for (int c = 0; c < 4; c++) {
        __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 + 32 * c)));
        __m256i high = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 + 32 * c)));
        __m256i nibble = _mm256_set1_epi16(15);
        w[2 * c] = pairs_of(_mm256_and_si256(low, nibble), _mm256_and_si256(high, nibble));
        w[2 * c + 1] = pairs_of(_mm256_srli_epi16(low, 4), _mm256_srli_epi16(high, 4));
    }
}
/* Q4_K on AVX2, a block (8 groups) at a time: each group's weight scale times x's as one 8-lane product a token, the
 * mins' offsets one 8-lane FMA a token; the groups' int32 sums as igemv's (two vpmaddwd of the pairs). A token's
 * sums run in the same order whatever the tile it is in. Entry point igemvb_q4_k (native.py prefers it to igemv_). */
static inline __attribute__((always_inline)) void igemvb_tile_q4_k(const gemm_job *j, const uint8_t *row, int64_t r,
                                                                    int64_t t0, const int tn) {
    int64_t groups = j->k / 32, blocks = j->k / 256;
    __m256 even[IGEMV_TILE], odd[IGEMV_TILE], offset[IGEMV_TILE];
    for (int t = 0; t < tn; t++) even[t] = odd[t] = offset[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * 144;
        wgroup w[8];
        __m256 scales, mins;
        q4_k_block(blk, w, &scales, &mins);
        for (int t = 0; t < tn; t++) {
            const int32_t *xu = j->xu + (t0 + t) * (j->k / 2) + b * 128;
            const float *xs = j->xs + (t0 + t) * groups + b * 8, *xo = j->xo + (t0 + t) * 2 * groups + b * 8;
            float scale[8];
            _mm256_storeu_ps(scale, _mm256_mul_ps(scales, _mm256_loadu_ps(xs)));
            __m256 xsum = _mm256_add_ps(_mm256_loadu_ps(xo), _mm256_loadu_ps(xo + groups));
            offset[t] = _mm256_fnmadd_ps(mins, xsum, offset[t]);
            for (int g = 0; g < 8; g += 2) {
                even[t] = igemv_group(even[t], w[g], xu + 16 * g, scale[g]);
                odd[t] = igemv_group(odd[t], w[g + 1], xu + 16 * (g + 1), scale[g + 1]);
            }
        }
    }
    for (int t = 0; t < tn; t++)
        j->y[(t0 + t) * j->rows + r] = igemv_sum(_mm256_add_ps(even[t], odd[t]), offset[t]);
}
/* Q6_K the same way (igemvb_q6_k): one f16 d a block, so a group's scale is d times x's; the int8 scales of its two
 * halves folded into the pairs (q6_k_chunk), each chunk's shifts constants. The chunk loop is written here and in
 * panelb_q6_k alike: through a shared helper GCC compiled this decode loop 11% longer. */
static inline __attribute__((always_inline)) void igemvb_tile_q6_k(const gemm_job *j, const uint8_t *row, int64_t r,
                                                                    int64_t t0, const int tn) {
    int64_t groups = j->k / 32, blocks = j->k / 256;
    __m256 even[IGEMV_TILE], odd[IGEMV_TILE];
    for (int t = 0; t < tn; t++) even[t] = odd[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * 210;
        __m256 d = _mm256_set1_ps(f16(blk + 208));
        wgroup w[8];
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) w[g] = pairs_of(q6_k_chunk(blk, 2 * g), q6_k_chunk(blk, 2 * g + 1));
        for (int t = 0; t < tn; t++) {
            const int32_t *xu = j->xu + (t0 + t) * (j->k / 2) + b * 128;
            float scale[8];
            _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_loadu_ps(j->xs + (t0 + t) * groups + b * 8)));
            for (int g = 0; g < 8; g += 2) {
                even[t] = igemv_group(even[t], w[g], xu + 16 * g, scale[g]);
                odd[t] = igemv_group(odd[t], w[g + 1], xu + 16 * (g + 1), scale[g + 1]);
            }
        }
    }
    for (int t = 0; t < tn; t++) j->y[(t0 + t) * j->rows + r] = igemv_sum(even[t], odd[t]);
}
IGEMV_ENTRY(igemvb_q4_k, igemvb_tile_q4_k, k / 256 * 144, NULL, 1)
IGEMV_ENTRY(igemvb_q6_k, igemvb_tile_q6_k, k / 256 * 210, NULL, 0)

/* The prompt GEMM's panels of Q4_K and Q6_K from the same block decoders (entry points gemmb_q4_k, gemmb_q6_k, which
 * native.py prefers to gemm_): the units, scales and offsets panel_ writes through igroup_, a block at a time. A
 * wgroup's lanes hold the group's pairs 0-3, 8-11 (a) and 4-7, 12-15 (b). */
static inline void panel_units(int32_t *units, int64_t g, int64_t r, wgroup w) {
    static const int pair[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    int32_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, w.a);
    _mm256_storeu_si256((__m256i *)(lanes + 8), w.b);
    for (int i = 0; i < 16; i++) units[(g * 16 + pair[i]) * 16 + r] = lanes[i];
}
static void panelb_q4_k(const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k, int32_t *units, float *scales,
                        float *offsets) {
    panel_clear(rows, k, units, scales, offsets);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < k / 256; b++) {
            wgroup g8[8];
            __m256 s, m;
            q4_k_block(w + r * row_bytes + b * 144, g8, &s, &m);
            float sv[8], mv[8];
            _mm256_storeu_ps(sv, s);
            _mm256_storeu_ps(mv, m);
            for (int c = 0; c < 8; c++) {
                int64_t g = b * 8 + c;
                panel_units(units, g, r, g8[c]);
                scales[g * 16 + r] = sv[c];
                offsets[g * 32 + r] = offsets[g * 32 + 16 + r] = -mv[c];
            }
        }
}
static void panelb_q6_k(const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k, int32_t *units, float *scales,
                        float *offsets) {
    panel_clear(rows, k, units, scales, offsets);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < k / 256; b++) {
            const uint8_t *blk = w + r * row_bytes + b * 210;
            wgroup g8[8];
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) g8[c] = pairs_of(q6_k_chunk(blk, 2 * c), q6_k_chunk(blk, 2 * c + 1));
            float d = f16(blk + 208);
            for (int c = 0; c < 8; c++) {
                int64_t g = b * 8 + c;
                panel_units(units, g, r, g8[c]);
                scales[g * 16 + r] = d;
                offsets[g * 32 + r] = offsets[g * 32 + 16 + r] = 0;
            }
        }
}
void gemmb_q4_k(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax, int threads) {
    gemm_job j_ = {w, rows, k, n, k / 256 * 144, NULL, NULL, NULL, y, panelb_q4_k, OFFSETS_q4_k};
    gemm(&j_, x, xmax, threads);
}
void gemmb_q6_k(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax, int threads) {
    gemm_job j_ = {w, rows, k, n, k / 256 * 210, NULL, NULL, NULL, y, panelb_q6_k, OFFSETS_q6_k};
    gemm(&j_, x, xmax, threads);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
/* Q4_0, Q4_1 and Q5_0 decode products two groups a step (entry points igemvb_q4_0, igemvb_q4_1, igemvb_q5_0, which
 * native.py prefers to igemv_): one masked load takes a pair of blocks from the file's bytes, vpermb widens their 32
 * nibble bytes to int16 and picks their f16 d (and m); the low nibbles of both groups in one register and the high
 * in another (Q5_0's fifth bits added by a masked add), two vpdpwssd leave group g's exact int32 sums in lanes 0-7
 * and group g + 1's in lanes 8-15, and one conversion and one FMA (by [d_g s_g] x 8, [d_g+1 s_g+1] x 8) take both,
 * where igemv_ converts and multiplies each group alone. x is laid out for it by igemv_pairs: per pair of groups,
 * [x_g 0-15, x_g+1 0-15] and [x_g 16-31, x_g+1 16-31] as int16; the scales [s_g x 8, s_g+1 x 8]; the offsets'
 * factors (m; -8 for Q4_0's values d (q - 8), -16 for Q5_0's d (q - 16); times s sum(q)) in lanes 2 and 3, beside
 * d's 0 and 1, which they multiply by nothing. A lone last group is a pair whose second is zeros. Each step
 * prefetches the bytes PAIRS_AHEAD on (the next rows, at the end of one), which the hardware's prefetch left
 * waiting. SmolLM2-135M's 1536 x 576 Q4_1 product in L2, one thread, 40.6-46.6 us against igemv_'s 57.6-60.1; its
 * decode on one thread 97.5 tok/s against 83.5 (docs/benchmarks.md, the forty-first session). */
#define PAIRS_AHEAD 4096
static void igemv_pairs(gemm_job *j, const float *x, float xmax, int threads, range_fn rows, float factor) {
    int64_t groups = j->k / 32, pairs = (groups + 1) / 2, half = j->k / 2;
    /* one allocation a product (a step makes hundreds): x as quantize_x writes it, then its pair layout (zeros where
     * a lone last group's pair has no second) */
    int32_t *xu = calloc((size_t)(j->n * (half + 3 * groups + pairs * 52)), 4);
    float *xs = (float *)(xu + j->n * half), *xo = xs + j->n * groups;
    int32_t *x2 = (int32_t *)(xo + j->n * groups * 2);
    float *scales = (float *)(x2 + j->n * pairs * 32), *offsets = scales + j->n * pairs * 16;
    quantize_x(x, j->n, j->k, xmax, xu, xs, xo);
    for (int64_t t = 0; t < j->n; t++)
        for (int64_t g = 0; g < groups; g++) {
            __m512i u = _mm512_loadu_si512(xu + t * half + 16 * g); /* pairs (x_p, x_p+16) */
            int16_t *to = (int16_t *)(x2 + (t * pairs + g / 2) * 32) + 16 * (g % 2);
            _mm256_storeu_si256((__m256i *)to, _mm512_cvtepi32_epi16(u));
            _mm256_storeu_si256((__m256i *)(to + 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
            float *scale = scales + (t * pairs + g / 2) * 16 + 8 * (g % 2);
            for (int i = 0; i < 8; i++) scale[i] = xs[t * groups + g];
            offsets[(t * pairs + g / 2) * 4 + 2 + g % 2] = factor * (xo[t * 2 * groups + g] + xo[(t * 2 + 1) * groups + g]);
        }
    j->xu = x2, j->xs = scales, j->xo = offsets;
    run(threads, j->rows, rows, j);
    free(xu);
}
/* per type: vpermb's indices that widen a pair's nibble bytes to int16, and that pick its f16 d d (m m) */
static const uint8_t widen_q4_0[64] = {2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15, 0, 16, 0, 17, 0, 20, 0, 21, 0, 22, 0, 23, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31, 0, 32, 0, 33, 0, 34, 0, 35, 0};
static const uint8_t pick_q4_0[64] = {0, 1, 18, 19, 0, 1, 18, 19, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static const uint8_t widen_q4_1[64] = {4, 0, 5, 0, 6, 0, 7, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15, 0, 16, 0, 17, 0, 18, 0, 19, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31, 0, 32, 0, 33, 0, 34, 0, 35, 0, 36, 0, 37, 0, 38, 0, 39, 0};
static const uint8_t pick_q4_1[64] = {0, 1, 20, 21, 2, 3, 22, 23, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static const uint8_t widen_q5_0[64] = {6, 0, 7, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15, 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 28, 0, 29, 0, 30, 0, 31, 0, 32, 0, 33, 0, 34, 0, 35, 0, 36, 0, 37, 0, 38, 0, 39, 0, 40, 0, 41, 0, 42, 0, 43, 0};
static const uint8_t pick_q5_0[64] = {0, 1, 22, 23, 0, 1, 22, 23, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
/* rows rows[0..R-1] (at[]) for tokens t0 .. t0 + tn - 1, their blocks of BLOCK bytes read through the type's tables
 * (FIFTH: Q5_0's fifth bits, 32 a block from byte 2, add 16 to the values whose bit is set) */
static inline __attribute__((always_inline)) void pairs_tile(const gemm_job *j, const uint8_t *const *rows,
                                                             const int64_t *at, int64_t t0, const int tn, const int R,
                                                             const int block, const uint8_t *widen, const uint8_t *pick,
                                                             const int fifth) {
    int64_t groups = j->k / 32, pairs = (groups + 1) / 2;
    const __m512i wide = _mm512_loadu_si512(widen), take = _mm512_loadu_si512(pick);
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask64 both = (1ull << (2 * block)) - 1, one = (1ull << block) - 1;
    __m512 even[2][IGEMV_TILE], odd[2][IGEMV_TILE];
    __m128 off[2][IGEMV_TILE];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < tn; t++) even[i][t] = odd[i][t] = _mm512_setzero_ps(), off[i][t] = _mm_setzero_ps();
    for (int64_t p = 0; p < pairs; p++)
        for (int i = 0; i < R; i++) {
            const uint8_t *row = rows[i];
            _mm_prefetch((const char *)(row + 2 * p * block + PAIRS_AHEAD), _MM_HINT_T0);
            __m512i raw = _mm512_maskz_loadu_epi8(2 * p + 1 < groups ? both : one, row + 2 * p * block);
            __m512i v = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, wide, raw);
            __m512i low = _mm512_and_si512(v, _mm512_set1_epi16(15)), high = _mm512_srli_epi16(v, 4);
            if (fifth) { /* bits 0-15 of each block's 32 go with the low nibbles, 16-31 with the high */
                uint32_t bits, next = 0;
                memcpy(&bits, row + 2 * p * block + 2, 4);
                if (2 * p + 1 < groups) memcpy(&next, row + (2 * p + 1) * block + 2, 4);
                __m512i sixteen = _mm512_set1_epi16(16);
                low = _mm512_mask_add_epi16(low, (bits & 0xffff) | (next << 16), low, sixteen);
                high = _mm512_mask_add_epi16(high, (bits >> 16) | (next & 0xffff0000u), high, sixteen);
            }
            /* d_g d_g+1 m_g m_g+1 */
            __m128 dm = _mm_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi8(take, raw)));
            __m512 d = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(dm));
            for (int t = 0; t < tn; t++) {
                const int32_t *xu = j->xu + ((t0 + t) * pairs + p) * 32;
                __m512i sum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(xu));
                sum = _mm512_dpwssd_epi32(sum, high, _mm512_loadu_si512(xu + 16));
                __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(j->xs + ((t0 + t) * pairs + p) * 16));
                if (p % 2 == 0)
                    even[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, even[i][t]);
                else
                    odd[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, odd[i][t]);
                off[i][t] = _mm_fmadd_ps(dm, _mm_loadu_ps(j->xo + ((t0 + t) * pairs + p) * 4), off[i][t]);
            }
        }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < tn; t++) {
            __m128 o = off[i][t];
            j->y[(t0 + t) * j->rows + at[i]] =
                _mm512_reduce_add_ps(_mm512_add_ps(even[i][t], odd[i][t])) + ((o[0] + o[1]) + (o[2] + o[3]));
        }
}
#define PAIRS_TILE(NAME, BLOCK, FIFTH)                                                                              \
    static inline __attribute__((always_inline)) void pairs_tile_##NAME(                                            \
        const gemm_job *j, const uint8_t *const *rows, const int64_t *at, int64_t t0, const int tn, const int R) {   \
        pairs_tile(j, rows, at, t0, tn, R, BLOCK, widen_##NAME, pick_##NAME, FIFTH);                                \
    }
PAIRS_TILE(q4_0, 18, 0)
PAIRS_TILE(q4_1, 20, 0)
PAIRS_TILE(q5_0, 22, 1)
/* Q4_K and Q6_K decode products four groups a step (entry points igemvb_q4_k, igemvb_q6_k, which native.py prefers to
 * igemv_): 64 bytes of a block's nibbles are 32 int16 words, and four ALU operations on the words take out the low
 * nibble of each word's even byte (A: word & 15), of its odd byte (B: word >> 8 & 15), and the high nibbles (C: word
 * >> 4 & 15, D: word >> 12), as int16 with no shuffle. The 64 bytes hold four groups; A and B hold two of them (the
 * lower and upper 32 bytes' low nibbles), C and D the other two, each group's even values in A (C) and odd ones in B
 * (D). x is laid out to match by igemv_quads: per four groups, the 32 int16 of x that each of A, B, C and D
 * multiplies. Two vpdpwssd a pair of registers leave lanes 0-7 with one group's exact int32 sums and lanes 8-15 with
 * the other's (lanes 0-3 and 4-7 of a group its values 0-15 and 16-31), and one conversion and one FMA take both
 * groups. Offsets (Q4_K's mins, Q6_K's -32) are one FMA a block a token over x's sums per 16 values. x is rounded per
 * 32 values as the prompt GEMM rounds it. One thread, weights cached: 13-15 GB/s for Q4_K and 17-19 for Q6_K, against
 * the float32 GEMV's 2.5-2.9 (docs/benchmarks.md, the forty-second session). */
static const uint8_t lanes_of_mins[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
/* the group of register r (0: A and B, 1: C and D) and half u (its lower or upper 16 words) in four groups: Q4_K's
 * (stacked 0) r + 2u, Q6_K's (stacked 1) 2r + u */
static void igemv_quads(gemm_job *j, const float *x, float xmax, int threads, range_fn rows, int stacked) {
    int64_t groups = j->k / 32, quads = groups / 4, half = j->k / 2;
    /* x as quantize_x writes it, then per token: the quads' 4 x 32 int16, their [s_g x 8, s_g' x 8] scales a register
     * pair, and s sum(q) of each 16 values in order */
    int32_t *xu = calloc((size_t)(j->n * (half + 3 * groups + quads * 64 + quads * 32 + groups * 2)), 4);
    float *xs = (float *)(xu + j->n * half), *xo = xs + j->n * groups;
    int16_t *x4 = (int16_t *)(xo + j->n * groups * 2);
    float *s4 = (float *)(x4 + j->n * quads * 128), *c16 = s4 + j->n * quads * 32;
    quantize_x(x, j->n, j->k, xmax, xu, xs, xo);
    /* a group's 16 pairs are 32 words, value v < 16 at word 2v, v >= 16 at word 2(v - 16) + 1: its even values and its
     * odd ones picked by vpermw */
    static const uint16_t even_words[32] = {0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29}; /* 16 unused */
    static const uint16_t odd_words[32] = {2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31};
    const __m512i evens = _mm512_loadu_si512(even_words), odds = _mm512_loadu_si512(odd_words);
    for (int64_t t = 0; t < j->n; t++)
        for (int64_t g = 0; g < groups; g++) {
            int64_t q = g / 4, gi = g % 4, r = stacked ? gi / 2 : gi % 2, u = stacked ? gi % 2 : gi / 2;
            __m512i pairs = _mm512_loadu_si512(xu + t * half + 16 * g);
            int16_t *to = x4 + ((t * quads + q) * 4 + 2 * r) * 32 + 16 * u;
            _mm256_storeu_si256((__m256i *)to, _mm512_castsi512_si256(_mm512_permutexvar_epi16(evens, pairs)));
            _mm256_storeu_si256((__m256i *)(to + 32), _mm512_castsi512_si256(_mm512_permutexvar_epi16(odds, pairs)));
            for (int i = 0; i < 8; i++) s4[((t * quads + q) * 2 + r) * 16 + 8 * u + i] = xs[t * groups + g];
            c16[(t * groups + g) * 2] = xo[t * 2 * groups + g];
            c16[(t * groups + g) * 2 + 1] = xo[(t * 2 + 1) * groups + g];
        }
    j->xu = (const int32_t *)x4, j->xs = s4, j->xo = c16;
    run(threads, j->rows, rows, j);
    free(xu);
}
/* token t's sums of quad q (its 4 x 32 x words at xq): lanes 0-7 and 8-15 of the A-B and the C-D registers, scaled */
static inline __attribute__((always_inline)) void quad_sums(__m512 *ab_acc, __m512 *cd_acc, __m512i a, __m512i b,
                                                            __m512i c, __m512i d, const int32_t *xq, const float *sq,
                                                            __m512 ab_scale, __m512 cd_scale) {
    __m512i ab = _mm512_dpwssd_epi32(_mm512_setzero_si512(), a, _mm512_loadu_si512(xq));
    ab = _mm512_dpwssd_epi32(ab, b, _mm512_loadu_si512(xq + 16));
    __m512i cd = _mm512_dpwssd_epi32(_mm512_setzero_si512(), c, _mm512_loadu_si512(xq + 32));
    cd = _mm512_dpwssd_epi32(cd, d, _mm512_loadu_si512(xq + 48));
    *ab_acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ab), _mm512_mul_ps(ab_scale, _mm512_loadu_ps(sq)), *ab_acc);
    *cd_acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(cd), _mm512_mul_ps(cd_scale, _mm512_loadu_ps(sq + 16)), *cd_acc);
}
/* a Q4_K block's d sc_g (lanes 0-7) and dmin m_g (lanes 8-15): the 12 bytes of 6-bit scales and mins s unpacked in
 * one register, as gguf-py's get_scale_min_k4 reads them: sc_j = s_j & 63 and m_j = s_j+4 & 63 for j < 4; for j >= 4
 * sc_j = s_j+4 & 15 | (s_j-4 >> 6) << 4 and m_j = s_j+4 >> 4 | (s_j >> 6) << 4 */
static inline __m512 q4_k_scales_mins(const uint8_t *blk) {
    const __m128i s = _mm_loadu_si128((const __m128i *)(blk + 4)); /* bytes 12-15: the nibbles after, unused */
    const __m128i low = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i high = _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i masked = _mm_and_si128(low, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    const __m128i shifted = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(15));
    const __m128i counts = _mm_or_si128(_mm_mask_blend_epi8(0xf000, masked, shifted),
                                        _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(0x30)));
    uint32_t dm;
    memcpy(&dm, blk, 4);
    __m512 d = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                     _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm))));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(counts)), d);
}
/* the index vector [i x 8, k x 8] */
static inline __m512i two_lanes(int i, int k) {
    return _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(i), _mm512_set1_epi32(k));
}
/* block b of a row (at blk) for tokens t0 .. t0 + tn - 1: their sums into ab, cd and off */
static inline __attribute__((always_inline)) void quads_block_q4_k(const gemm_job *j, const uint8_t *blk, int64_t b,
                                                                   int64_t t0, const int tn, __m512 *ab, __m512 *cd,
                                                                   __m512 *off) {
    int64_t groups = j->k / 32, quads = groups / 4;
    const __m512i nibble = _mm512_set1_epi16(15), mins_at = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)lanes_of_mins));
    _mm_prefetch((const char *)(blk + PAIRS_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + 64 + PAIRS_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + 128 + PAIRS_AHEAD), _MM_HINT_T0);
    const __m512 sm = q4_k_scales_mins(blk), mins = _mm512_permutexvar_ps(mins_at, sm);
    for (int t = 0; t < tn; t++)
        off[t] = _mm512_fmadd_ps(mins, _mm512_loadu_ps(j->xo + ((t0 + t) * groups + 8 * b) * 2), off[t]);
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const __m512i raw = _mm512_loadu_si512(blk + 16 + 64 * h);
        const __m512i a = _mm512_and_si512(raw, nibble), bb = _mm512_and_si512(_mm512_srli_epi16(raw, 8), nibble);
        const __m512i c = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble), d = _mm512_srli_epi16(raw, 12);
        const __m512 ab_scale = _mm512_permutexvar_ps(two_lanes(4 * h, 4 * h + 2), sm);
        const __m512 cd_scale = _mm512_permutexvar_ps(two_lanes(4 * h + 1, 4 * h + 3), sm);
        for (int t = 0; t < tn; t++) {
            const int64_t q = (t0 + t) * quads + 2 * b + h;
            quad_sums(&ab[t], &cd[t], a, bb, c, d, j->xu + q * 64, j->xs + q * 32, ab_scale, cd_scale);
        }
    }
}
/* rows rows[0..R-1] (at[]) for tokens t0 .. t0 + tn - 1, through quads_block_NAME: R = 2 (one token) takes two rows'
 * blocks side by side; the offsets' sum (times OFFSET: Q6_K's 32) subtracted at the end */
#define QUADS_TILE(NAME, BYTES, OFFSET)                                                                             \
    static inline __attribute__((always_inline)) void quads_tile_##NAME(                                            \
        const gemm_job *j, const uint8_t *const *rows, const int64_t *at, int64_t t0, const int tn, const int R) {   \
        __m512 ab[2][IGEMV_TILE], cd[2][IGEMV_TILE], off[2][IGEMV_TILE];                                            \
        for (int i = 0; i < R; i++)                                                                                 \
            for (int t = 0; t < tn; t++) ab[i][t] = cd[i][t] = off[i][t] = _mm512_setzero_ps();                   \
        for (int64_t b = 0; b < j->k / 256; b++)                                                                    \
            for (int i = 0; i < R; i++) quads_block_##NAME(j, rows[i] + b * BYTES, b, t0, tn, ab[i], cd[i], off[i]); \
        for (int i = 0; i < R; i++)                                                                                 \
            for (int t = 0; t < tn; t++)                                                                            \
                j->y[(t0 + t) * j->rows + at[i]] = _mm512_reduce_add_ps(_mm512_add_ps(ab[i][t], cd[i][t])) -      \
                                                   OFFSET * _mm512_reduce_add_ps(off[i][t]);                       \
    }
QUADS_TILE(q4_k, 144, 1)
/* Q6_K: the quads are the block's halves (64 ql bytes, 32 qh bytes each): groups 4h and 4h + 1 in A-B (the low
 * nibbles), 4h + 2 and 4h + 3 in C-D; the qh bytes in both 256-bit halves of a register, each word's two bits for A, B,
 * C, D shifted to bits 4-5 by per-half counts. The int8 scales of each 16 values (d times them, in float) are a lane's:
 * lanes 0-3 a group's values 0-15, 4-7 its 16-31. Values 0..63 (the -32 an offset: -32 d sc s sum(q) per 16). */
static inline __m512i two_counts(int lower, int upper) {
    return _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16((short)lower), _mm512_set1_epi16((short)upper));
}
static inline __m512i four_lanes(int i) {
    return _mm512_set_epi32(i + 3, i + 3, i + 3, i + 3, i + 2, i + 2, i + 2, i + 2, i + 1, i + 1, i + 1, i + 1, i, i, i, i);
}
static inline __attribute__((always_inline)) void quads_block_q6_k(const gemm_job *j, const uint8_t *blk, int64_t b,
                                                                   int64_t t0, const int tn, __m512 *ab, __m512 *cd,
                                                                   __m512 *off) {
    int64_t groups = j->k / 32, quads = groups / 4;
    const __m512i nibble = _mm512_set1_epi16(15), bits = _mm512_set1_epi16(0x30);
    _mm_prefetch((const char *)(blk + PAIRS_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + 64 + PAIRS_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + 128 + PAIRS_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + 192 + PAIRS_AHEAD), _MM_HINT_T0);
    uint16_t d16;
    memcpy(&d16, blk + 208, 2);
    const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))),
                                        _mm512_set1_ps(_cvtsh_ss(d16)));
    for (int t = 0; t < tn; t++)
        off[t] = _mm512_fmadd_ps(scales, _mm512_loadu_ps(j->xo + ((t0 + t) * groups + 8 * b) * 2), off[t]);
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
        const __m512i a = _mm512_or_si512(_mm512_and_si512(ql, nibble), _mm512_and_si512(_mm512_sllv_epi16(qh, two_counts(4, 2)), bits));
        const __m512i bb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 8), nibble),
                                           _mm512_and_si512(_mm512_srlv_epi16(qh, two_counts(4, 6)), bits));
        const __m512i c = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
                                          _mm512_and_si512(_mm512_srlv_epi16(qh, two_counts(0, 2)), bits));
        const __m512i d = _mm512_or_si512(_mm512_srli_epi16(ql, 12), _mm512_and_si512(_mm512_srlv_epi16(qh, two_counts(8, 10)), bits));
        const __m512 ab_scale = _mm512_permutexvar_ps(four_lanes(8 * h), scales);
        const __m512 cd_scale = _mm512_permutexvar_ps(four_lanes(8 * h + 4), scales);
        for (int t = 0; t < tn; t++) {
            const int64_t q = (t0 + t) * quads + 2 * b + h;
            quad_sums(&ab[t], &cd[t], a, bb, c, d, j->xu + q * 64, j->xs + q * 32, ab_scale, cd_scale);
        }
    }
}
QUADS_TILE(q6_k, 210, 32)
/* rows first..last-1 of a pairs or quads product: one token two rows a step, row i beside row i + half of the range
 * (two streams of weights in flight where one left the core's loads waiting on memory); more tokens a row at a time,
 * in tiles of IGEMV_TILE, 2 and 1. A row's sums run in the same order either way. */
#define TWO_ROWS(NAME, TILE)                                                                                        \
    static void NAME##_rows(const void *arg, int64_t first, int64_t last) {                                        \
        const gemm_job *j = arg;                                                                                    \
        if (j->n == 1) {                                                                                            \
            int64_t half = (last - first) / 2;                                                                      \
            for (int64_t r = first; r < first + half; r++) {                                                        \
                const uint8_t *rows[2] = {j->w + r * j->row_bytes, j->w + (r + half) * j->row_bytes};              \
                const int64_t at[2] = {r, r + half};                                                                \
                TILE(j, rows, at, 0, 1, 2);                                                                         \
            }                                                                                                       \
            first += 2 * half;                                                                                      \
        }                                                                                                           \
        for (int64_t r = first; r < last; r++) {                                                                    \
            const uint8_t *row[1] = {j->w + r * j->row_bytes};                                                     \
            const int64_t at[1] = {r};                                                                              \
            int64_t t = 0;                                                                                          \
            for (; t + IGEMV_TILE <= j->n; t += IGEMV_TILE) TILE(j, row, at, t, IGEMV_TILE, 1);                     \
            if (t + 2 <= j->n) {                                                                                    \
                TILE(j, row, at, t, 2, 1);                                                                          \
                t += 2;                                                                                             \
            }                                                                                                       \
            for (; t < j->n; t++) TILE(j, row, at, t, 1, 1);                                                        \
        }                                                                                                           \
    }
TWO_ROWS(igemvb_q4_k, quads_tile_q4_k)
TWO_ROWS(igemvb_q6_k, quads_tile_q6_k)
void igemvb_q4_k(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax, int threads) {
    gemm_job j_ = {w, rows, k, n, k / 256 * 144, NULL, NULL, NULL, y, NULL, 0};
    igemv_quads(&j_, x, xmax, threads, igemvb_q4_k_rows, 0);
}
void igemvb_q6_k(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax, int threads) {
    gemm_job j_ = {w, rows, k, n, k / 256 * 210, NULL, NULL, NULL, y, NULL, 0};
    igemv_quads(&j_, x, xmax, threads, igemvb_q6_k_rows, 1);
}
TWO_ROWS(igemvb_q4_0, pairs_tile_q4_0)
TWO_ROWS(igemvb_q5_0, pairs_tile_q5_0)
TWO_ROWS(igemvb_q4_1, pairs_tile_q4_1)
void igemvb_q4_0(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax, int threads) {
    gemm_job j_ = {w, rows, k, n, k / 32 * 18, NULL, NULL, NULL, y, NULL, 0};
    igemv_pairs(&j_, x, xmax, threads, igemvb_q4_0_rows, -8);
}
void igemvb_q5_0(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax, int threads) {
    gemm_job j_ = {w, rows, k, n, k / 32 * 22, NULL, NULL, NULL, y, NULL, 0};
    igemv_pairs(&j_, x, xmax, threads, igemvb_q5_0_rows, -16);
}
void igemvb_q4_1(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax, int threads) {
    gemm_job j_ = {w, rows, k, n, k / 32 * 20, NULL, NULL, NULL, y, NULL, 1};
    igemv_pairs(&j_, x, xmax, threads, igemvb_q4_1_rows, 1);
}
#endif
#define GEMM_KERNELS(NAME, QK, BYTES)                                                                               \
    static void panel_##NAME(const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k, int32_t *units,         \
                             float *scales, float *offsets) {                                                      \
        panel_clear(rows, k, units, scales, offsets);                                                               \
        for (int64_t r = 0; r < rows; r++)                                                                          \
            for (int64_t b = 0; b < k / QK; b++)                                                                    \
                _Pragma("GCC unroll 8") for (int c = 0; c < QK / 32; c++) {                                         \
                    float s, lo, hi;                                                                                \
                    vi u = igroup_##NAME(w + r * row_bytes + b * BYTES, c, &s, &lo, &hi);                           \
                    int64_t g = b * (QK / 32) + c;                                                                  \
                    for (int p = 0; p < 16; p++) units[(g * 16 + p) * 16 + r] = u[p];                               \
                    scales[g * 16 + r] = s;                                                                         \
                    offsets[g * 32 + r] = lo;                                                                       \
                    offsets[g * 32 + 16 + r] = hi;                                                                  \
                }                                                                                                   \
    }                                                                                                               \
    void gemm_##NAME(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, float xmax,   \
                     int threads) {                                                                                 \
        gemm_job j_ = {w, rows, k, n, k / QK * BYTES, NULL, NULL, NULL, y, panel_##NAME, OFFSETS_##NAME};          \
        gemm(&j_, x, xmax, threads);                                                                                \
    } \
    /* a row for tokens t0 .. t0 + tn - 1, each group decoded once for them all: per token two accumulators (even     \
     * and odd groups), offsets (none for some types) apart, summed in the order the token gets alone */             \
    static inline __attribute__((always_inline)) void igemv_tile_##NAME(const gemm_job *j, const uint8_t *row,      \
                                                                         int64_t r, int64_t t0, const int tn) {     \
        int64_t groups = j->k / 32;                                                                                 \
        igemv_acc even[IGEMV_TILE], odd[IGEMV_TILE];                                                                \
        float offset[IGEMV_TILE] = {0};                                                                             \
        memset(even, 0, sizeof(even));                                                                              \
        memset(odd, 0, sizeof(odd));                                                                                \
        for (int64_t g = 0; g < groups; g++) {                                                                      \
            float s, lo, hi;                                                                                        \
            __auto_type u = IGEMV_UNITS(NAME)(row + g / (QK / 32) * BYTES, (int)(g % (QK / 32)), &s, &lo, &hi);     \
            for (int t = 0; t < tn; t++) {                                                                          \
                const int32_t *xu = j->xu + (t0 + t) * (j->k / 2);                                                  \
                const float *xs = j->xs + (t0 + t) * groups, *xo = j->xo + (t0 + t) * 2 * groups;                   \
                if (OFFSETS_##NAME) offset[t] += lo * xo[g] + hi * xo[groups + g];                                  \
                if (g % 2 == 0)                                                                                     \
                    even[t] = igemv_group(even[t], u, xu + 16 * g, s * xs[g]);                                      \
                else                                                                                                \
                    odd[t] = igemv_group(odd[t], u, xu + 16 * g, s * xs[g]);                                        \
            }                                                                                                       \
        }                                                                                                           \
        for (int t = 0; t < tn; t++) j->y[(t0 + t) * j->rows + r] = igemv_sum(even[t], odd[t]) + offset[t];       \
    }                                                                                                               \
    IGEMV_ENTRY(igemv_##NAME, igemv_tile_##NAME, k / QK * BYTES, panel_##NAME, OFFSETS_##NAME)
#else
#define GEMM 0
#define GEMM_KERNELS(NAME, QK, BYTES)
#endif
int has_gemm(void) { return GEMM; }

/* Each row's sum goes to two vector accumulators (even and odd chunks), added at the end. The chunk loops are
 * unrolled so that each chunk's shifts and scale offsets are constants (Q4_K products 2.3x faster here). A row's
 * chunks are decoded once for up to GEMV_TILE tokens (each token's sums in the same order as alone, so a token's
 * result does not depend on the batch it is in). */
/* The 16 lanes' sum by halves (8 + 8, 4 + 4, 2 + 2, 1 + 1): a fixed order, in a few vector adds. */
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
static inline KEEP_ORDER float halving_sum(vf v) {
    NO_REASSOCIATION
    vf8 a, b;
    memcpy(&a, &v, 32);
    memcpy(&b, (const char *)&v + 32, 32);
    a += b;
    vf4 c, d;
    memcpy(&c, &a, 16);
    memcpy(&d, (const char *)&a + 16, 16);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}
#ifndef GEMV_TILE
#define GEMV_TILE 4
#endif
#define KERNELS(NAME, QK, BYTES)                                                                                   \
    static inline __attribute__((always_inline)) KEEP_ORDER void gemv_tile_##NAME(                              \
        const job *j_, const uint8_t *row, int64_t r, int64_t t0, const int tn) {                                   \
        NO_REASSOCIATION                                                                                            \
        int64_t blocks = j_->k / QK;                                                                                \
        vf even[GEMV_TILE] = {0}, odd[GEMV_TILE] = {0};                                                             \
        for (int64_t b = 0; b < blocks; b++)                                                                        \
            _Pragma("GCC unroll 16") for (int c = 0; c < QK / 16; c += 2) {                                         \
                vf lo = chunk_##NAME(row + b * BYTES, c), hi = chunk_##NAME(row + b * BYTES, c + 1);               \
                for (int t = 0; t < tn; t++) {                                                                      \
                    const float *x = j_->x + (t0 + t) * j_->k + b * QK + c * 16;                                    \
                    even[t] += lo * load(x);                                                                        \
                    odd[t] += hi * load(x + 16);                                                                    \
                }                                                                                                   \
            }                                                                                                       \
        for (int t = 0; t < tn; t++) j_->y[(t0 + t) * j_->rows + r] = halving_sum(even[t] + odd[t]);              \
    }                                                                                                               \
    static KEEP_ORDER void gemv_rows_##NAME(const void *arg, int64_t first, int64_t last) {                       \
        const job *j_ = arg;                                                                                        \
        int64_t row_bytes = j_->k / QK * BYTES;                                                                     \
        for (int64_t r = first; r < last; r++) {                                                                    \
            const uint8_t *row = j_->w + r * row_bytes;                                                             \
            int64_t t = 0;                                                                                          \
            for (; t + GEMV_TILE <= j_->n; t += GEMV_TILE) gemv_tile_##NAME(j_, row, r, t, GEMV_TILE);              \
            if (GEMV_TILE > 2 && t + 2 <= j_->n) {                                                                  \
                gemv_tile_##NAME(j_, row, r, t, 2);                                                                 \
                t += 2;                                                                                             \
            }                                                                                                       \
            for (; t < j_->n; t++) gemv_tile_##NAME(j_, row, r, t, 1);                                              \
        }                                                                                                           \
    }                                                                                                               \
    static void dequant_rows_##NAME(const void *arg, int64_t first, int64_t last) {                               \
        const job *j_ = arg;                                                                                        \
        int64_t blocks = j_->k / QK, row_bytes = blocks * BYTES;                                                    \
        for (int64_t r = first; r < last; r++) {                                                                    \
            const uint8_t *row = j_->w + (j_->ids ? j_->ids[r] : r) * row_bytes;                                    \
            for (int64_t b = 0; b < blocks; b++)                                                                    \
                _Pragma("GCC unroll 16") for (int c = 0; c < QK / 16; c++) {                                       \
                    vf v = chunk_##NAME(row + b * BYTES, c);                                                        \
                    memcpy(j_->y + r * j_->k + b * QK + c * 16, &v, 64);                                            \
                }                                                                                                   \
        }                                                                                                           \
    }                                                                                                               \
    void gemv_##NAME(const uint8_t *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, int threads) { \
        job j_ = {w, rows, k, n, x, y, NULL};                                                                       \
        run(threads, rows, gemv_rows_##NAME, &j_);                                                                  \
    }                                                                                                               \
    void dequant_##NAME(const uint8_t *w, const int64_t *ids, int64_t count, int64_t k, float *out, int threads) { \
        job j_ = {w, count, k, 0, NULL, out, ids};                                                                  \
        run(threads, count, dequant_rows_##NAME, &j_);                                                              \
    }                                                                                                               \
    GEMM_KERNELS(NAME, QK, BYTES)


/* -- attention ---------------------------------------------------------------------------------------------------
 * One sequence's queries q [queries][heads][dim] at positions start.. against its cached keys and values, stored
 * as pages [pages][page_size][kv_heads][dim] (float32 or f16) and found through `table` (its row of the page table).
 * Query t sees positions start + t - window < p <= start + t (window 0: all up to its own); head h reads kv head
 * h / (heads / kv_heads). Scores are scale * q.k, soft-capped as softcap * tanh(s / softcap) when softcap > 0;
 * sinks [heads], when given, join each softmax's denominator. Out [queries][heads][value_dim] (row stride out_stride
 * floats between queries). dim and value_dim are multiples of 16. A work item is one query and one kv head: the
 * heads that share it read each cached vector once. Sums in float32. */
typedef struct {
    const float *q;
    const void *k, *v;
    const int32_t *table;
    const float *sinks;
    float *out;
    int64_t queries, heads, kv_heads, dim, value_dim, page_size, start, window, out_stride;
    float scale, softcap;
} attention_job;

static inline vf load_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
    vf v;
    memcpy(&v, halves, 64);
    return v;
#else
    vf v;
    for (int i = 0; i < 16; i++) v[i] = f16((const uint8_t *)(p + i));
    return v;
#endif
}

static inline void store_f32(float *to, const float *from, int64_t count) { memcpy(to, from, sizeof(float) * (size_t)count); }
/* float32 to f16, rounding to nearest even (as numpy's astype) */
static inline void store_f16(uint16_t *to, const float *from, int64_t count) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= count; i += 16)
        _mm256_storeu_si256((__m256i *)(to + i), _mm512_cvtps_ph(_mm512_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; i + 8 <= count; i += 8)
        _mm_storeu_si128((__m128i *)(to + i), _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < count; i++) {
#if defined(__F16C__)
        to[i] = _cvtss_sh(from[i], _MM_FROUND_TO_NEAREST_INT);
#else
        uint32_t bits, magnitude;
        memcpy(&bits, from + i, 4);
        uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
        magnitude = bits & 0x7fffffff;
        if (magnitude > 0x7f800000) /* nan */
            to[i] = sign | 0x7e00;
        else if (magnitude >= 0x477ff000) /* rounds past 65504: inf */
            to[i] = sign | 0x7c00;
        else if (magnitude < 0x38800000) { /* a subnormal half: a multiple of 2^-24, rounded to nearest even */
            float scaled;
            memcpy(&scaled, &magnitude, 4);
            to[i] = sign | (uint16_t)nearbyintf(scaled * 16777216.0f);
        } else /* rebias the exponent, round the mantissa's 13 dropped bits to nearest even */
            to[i] = sign | (uint16_t)((magnitude + 0xc8000fffu + ((magnitude >> 13) & 1)) >> 13);
#endif
    }
}

/* Keys are read 16 at a time, each page's run of positions from its first slot on (no division per key); the 16
 * keys' vectors are decoded to float32 once (at most 256 values a head) and read by every head of the group. */
#define ATTENTION(NAME, T, LOAD, STORE)                                                                              \
    static inline const T *kv_at_##NAME(const attention_job *a, const void *base, int64_t p, int64_t g,             \
                                        int64_t dim) {                                                               \
        int64_t slot = (int64_t)a->table[p / a->page_size] * a->page_size + p % a->page_size;                         \
        return (const T *)base + (slot * a->kv_heads + g) * dim;                                                      \
    }                                                                                                                 \
    static void attend_items_##NAME(const void *arg, int64_t first, int64_t last) {                                 \
        const attention_job *a = arg;                                                                                 \
        int64_t group = a->heads / a->kv_heads, length = a->start + a->queries, vectors = a->dim / 16;               \
        int64_t kstride = a->kv_heads * a->dim, vstride = a->kv_heads * a->value_dim;                                \
        float *scores = malloc(sizeof(float) * (size_t)(group * length));                                            \
        vf *mixed = aligned_alloc(64, sizeof(vf) * (size_t)(group * a->value_dim / 16));                             \
        vf *decoded = a->dim <= 256 ? aligned_alloc(64, sizeof(vf) * 16 * (size_t)vectors) : NULL;                   \
        for (int64_t item = first; item < last; item++) {                                                             \
            int64_t t = item / a->kv_heads, g = item % a->kv_heads;                                                  \
            int64_t end = a->start + t + 1, begin = a->window > 0 && end > a->window ? end - a->window : 0;           \
            const float *qg = a->q + (t * a->heads + g * group) * a->dim;                                            \
            float peak[group], total[group];                                                                          \
            for (int64_t h = 0; h < group; h++) peak[h] = a->sinks ? a->sinks[g * group + h] : -INFINITY;            \
            int64_t p = begin;                                                                                        \
            for (; p + 16 <= end; p += 16) { /* 16 keys at a time: their 16 dot products reduced together */         \
                const T *kp[16];                                                                                      \
                if (p % a->page_size + 16 <= a->page_size) { /* one page */                                          \
                    kp[0] = kv_at_##NAME(a, a->k, p, g, a->dim);                                                      \
                    for (int j = 1; j < 16; j++) kp[j] = kp[0] + j * kstride;                                        \
                } else                                                                                                \
                    for (int j = 0; j < 16; j++) kp[j] = kv_at_##NAME(a, a->k, p + j, g, a->dim);                    \
                if (decoded)                                                                                          \
                    for (int j = 0; j < 16; j++)                                                                      \
                        for (int64_t i = 0; i < vectors; i++) decoded[j * vectors + i] = LOAD(kp[j] + 16 * i);       \
                for (int64_t h = 0; h < group; h++) {                                                                 \
                    vf acc[16] = {{0}};                                                                               \
                    for (int64_t i = 0; i < vectors; i++) {                                                           \
                        vf qv = load(qg + h * a->dim + 16 * i);                                                       \
                        if (decoded)                                                                                  \
                            for (int j = 0; j < 16; j++) acc[j] += qv * decoded[j * vectors + i];                    \
                        else                                                                                          \
                            for (int j = 0; j < 16; j++) acc[j] += qv * LOAD(kp[j] + 16 * i);                        \
                    }                                                                                                 \
                    vf s = sum16(acc) * a->scale;                                                                     \
                    if (a->softcap > 0) s = a->softcap * vtanh(s / a->softcap);                                       \
                    memcpy(scores + h * length + p, &s, 64);                                                          \
                    for (int l = 0; l < 16; l++) peak[h] = s[l] > peak[h] ? s[l] : peak[h];                           \
                }                                                                                                     \
            }                                                                                                         \
            for (; p < end; p++) {                                                                                    \
                const T *kp = kv_at_##NAME(a, a->k, p, g, a->dim);                                                    \
                for (int64_t h = 0; h < group; h++) {                                                                 \
                    vf acc = {0};                                                                                     \
                    for (int64_t i = 0; i < a->dim; i += 16) acc += load(qg + h * a->dim + i) * LOAD(kp + i);        \
                    float s = 0;                                                                                      \
                    for (int l = 0; l < 16; l++) s += acc[l];                                                         \
                    s *= a->scale;                                                                                    \
                    if (a->softcap > 0) s = a->softcap * tanhf(s / a->softcap);                                       \
                    scores[h * length + p] = s;                                                                       \
                    peak[h] = s > peak[h] ? s : peak[h];                                                              \
                }                                                                                                     \
            }                                                                                                         \
            for (int64_t h = 0; h < group; h++) {                                                                     \
                total[h] = a->sinks ? expf(a->sinks[g * group + h] - peak[h]) : 0;                                    \
                float *row = scores + h * length;                                                                     \
                p = begin;                                                                                            \
                vf sum = {0};                                                                                         \
                for (; p + 16 <= end; p += 16) {                                                                      \
                    vf weight = vexp(load(row + p) - peak[h]);                                                        \
                    memcpy(row + p, &weight, 64);                                                                     \
                    sum += weight;                                                                                    \
                }                                                                                                     \
                for (int l = 0; l < 16; l++) total[h] += sum[l];                                                      \
                for (; p < end; p++) {                                                                                \
                    row[p] = expf(row[p] - peak[h]);                                                                  \
                    total[h] += row[p];                                                                               \
                }                                                                                                     \
            }                                                                                                         \
            memset(mixed, 0, sizeof(vf) * (size_t)(group * a->value_dim / 16));                                      \
            for (p = begin; p < end;) { /* a page's run of positions at a time */                                    \
                int64_t stop = (p / a->page_size + 1) * a->page_size;                                                 \
                const T *vp = kv_at_##NAME(a, a->v, p, g, a->value_dim);                                              \
                for (stop = stop < end ? stop : end; p < stop; p++, vp += vstride)                                    \
                    for (int64_t i = 0; i < a->value_dim / 16; i++) {                                                 \
                        vf value = LOAD(vp + 16 * i);                                                                 \
                        for (int64_t h = 0; h < group; h++) mixed[h * a->value_dim / 16 + i] += scores[h * length + p] * value; \
                    }                                                                                                 \
            }                                                                                                         \
            for (int64_t h = 0; h < group; h++) {                                                                     \
                float *o = a->out + t * a->out_stride + (g * group + h) * a->value_dim;                              \
                for (int64_t i = 0; i < a->value_dim / 16; i++) {                                                     \
                    vf mean = mixed[h * a->value_dim / 16 + i] / total[h];                                            \
                    memcpy(o + 16 * i, &mean, 64);                                                                    \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
        free(scores);                                                                                                 \
        free(mixed);                                                                                                  \
        free(decoded);                                                                                                \
    }                                                                                                                 \
    void attend_##NAME(const float *q, const float *knew, const float *vnew, void *k, void *v, const int32_t *table,   \
                       const float *sinks, float *out, int64_t queries, int64_t heads, int64_t kv_heads, int64_t dim,  \
                       int64_t value_dim, int64_t page_size, int64_t start, int64_t window, int64_t out_stride,       \
                       float scale, float softcap, int threads) {                                                     \
        for (int64_t t = 0; t < queries; t++) { /* the queries' own keys and values into their pages first */          \
            int64_t p = start + t, slot = (int64_t)table[p / page_size] * page_size + p % page_size;                  \
            STORE((T *)k + slot * kv_heads * dim, knew + t * kv_heads * dim, kv_heads * dim);                         \
            STORE((T *)v + slot * kv_heads * value_dim, vnew + t * kv_heads * value_dim, kv_heads * value_dim);       \
        }                                                                                                             \
        attention_job a = {q,         k,        v,   table,     sinks, out,   queries,    heads, kv_heads,           \
                           dim,       value_dim, page_size, start, window, out_stride, scale, softcap};             \
        run(threads, queries * kv_heads, attend_items_##NAME, &a);                                                    \
    }

ATTENTION(f32, float, load, store_f32)
ATTENTION(f16, uint16_t, load_f16, store_f16)

/* glibc maps every allocation of 128 KiB or more afresh and hands it back on free, and trims the heap's top past
 * 128 KiB: so each of a prompt's activations (numpy's, and the GEMM's int16 copies) was new pages, faulted in one by
 * one (a fifth of SmolLM2's 128-token prompt here). With keep, allocations up to 32 MiB come from the heap instead,
 * and up to 64 MiB of freed heap is kept for the next. Without, both stay at 128 KiB (glibc's defaults, less its
 * raising of them as mapped blocks are freed): while a model loads, its transient arrays are handed back rather than
 * left in a heap that the tokenizer's objects then pin (1.3-1.6 MiB of `leat generate`'s peak RSS). Before keeping,
 * malloc_trim hands back the whole free pages inside the heap once (the load's, and the compiler's where Python has no
 * bytecode caches: 0.9 MiB of that peak then, 0.2 with them). Process-wide. */
void keep_freed_memory(int keep) {
#if defined(__GLIBC__)
    if (keep) malloc_trim(0);
    mallopt(M_MMAP_THRESHOLD, keep ? 32 << 20 : 128 << 10);
    mallopt(M_TRIM_THRESHOLD, keep ? 64 << 20 : 128 << 10);
#endif
}

/* -- small ops (one pass each, in place of numpy's several) ------------------------------------------------------- */
/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight (weight NULL: no scale), for rows of cols values */
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t cols, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *o = out + r * cols, sum = 0;
        for (int64_t i = 0; i < cols; i++) sum += xr[i] * xr[i];
        float inverse = 1.0f / sqrtf(sum / (float)cols + eps);
        if (weight)
            for (int64_t i = 0; i < cols; i++) o[i] = xr[i] * inverse * weight[i];
        else
            for (int64_t i = 0; i < cols; i++) o[i] = xr[i] * inverse;
    }
}

/* out = silu(gate) * up = gate / (1 + exp(-gate)) * up (gelu 0: SiLU), or the tanh GELU of gate times up (gelu 1):
 * 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3); 16 values at a time, the tail alone */
void gated(const float *gate, const float *up, float *out, int64_t size, int gelu) {
    int64_t i = 0;
    for (; i + 16 <= size; i += 16) {
        vf g = load(gate + i), e = gelu ? -1.5957691216057308f * (g + 0.044715f * g * g * g) : -g;
        vf v = g / (1.0f + vexp(e)) * load(up + i);
        memcpy(out + i, &v, 64);
    }
    for (; i < size; i++) {
        float g = gate[i], e = gelu ? -1.5957691216057308f * (g + 0.044715f * g * g * g) : -g;
        out[i] = g / (1.0f + expf(e)) * up[i];
    }
}

/* x [n][heads][head_dim] rotated into out by cos, sin [n][dims / 2]: pairs (i, i + dims/2) when neox, else
 * (2i, 2i + 1); values past dims are copied. */
void rope(const float *x, const float *cos, const float *sin, float *out, int64_t n, int64_t heads, int64_t head_dim,
          int64_t dims, int neox) {
    int64_t half = dims / 2;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + (t * heads + h) * head_dim, *c = cos + t * half, *s = sin + t * half;
            float *o = out + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
                o[a] = xh[a] * c[i] - xh[b] * s[i];
                o[b] = xh[a] * s[i] + xh[b] * c[i];
            }
            for (int64_t i = dims; i < head_dim; i++) o[i] = xh[i];
        }
}

/* The KERNELS(name, values per block, bytes per block) lines for each type are appended by native.py, from gguf-py's
 * GGML_QUANT_SIZES. */
