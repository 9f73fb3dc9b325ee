/* Products with GGUF blocks as stored: blocks are decoded in vector registers and multiplied in float32.
 *
 * Every type has one decoder, chunk_<TYPE>(block, c): the c-th 16 values of a block as a vector of 16 floats,
 * written from gguf-py's dequantize_blocks (the tests compare it with gguf.quants.dequantize). Vectors are GCC
 * vector extensions: 16 floats are one AVX-512 register, two AVX2 ones. From the decoder come two entry points:
 *   gemv_<TYPE>(w, rows, k, x, n, y, threads): y[t][r] = dot(row r of w, x[t]) for n activation rows x [n][k];
 *       y[t][r] does not depend on n (each activation row's sum runs alone, in the same order), so a batch of
 *       decode steps equals the steps one by one;
 *   dequant_<TYPE>(w, ids, count, k, out, threads): rows ids[0..count-1] (ids NULL: the first count rows) into
 *       out [count][k], float32 (embedding lookups, and a prompt's products: rows decoded, then BLAS).
 * Rows are split over `threads` threads (the caller's and a pool's, below).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
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
static inline vf lookup(vsb table, vb index) { return signed_floats(__builtin_shuffle(table, (vsb)index)); }
#endif
static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, 64);
    return v;
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
static inline void pause(int spin) {
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
            pause(spin);
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
    for (int spin = 0; atomic_load(&pool.done) < total; spin++) pause(spin);
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

/* Each row's sum goes to two vector accumulators (even and odd chunks), added at the end. The chunk loops are
 * unrolled so that each chunk's shifts and scale offsets are constants (Q4_K products 2.3x faster here). */
#define KERNELS(NAME, QK, BYTES)                                                                                   \
    static void gemv_rows_##NAME(const void *arg, int64_t first, int64_t last) {                                  \
        const job *j_ = arg;                                                                                        \
        int64_t blocks = j_->k / QK, row_bytes = blocks * BYTES;                                                    \
        for (int64_t r = first; r < last; r++)                                                                      \
            for (int64_t t = 0; t < j_->n; t++) {                                                                   \
                const uint8_t *row = j_->w + r * row_bytes;                                                         \
                const float *x = j_->x + t * j_->k;                                                                 \
                vf even = {0}, odd = {0};                                                                           \
                for (int64_t b = 0; b < blocks; b++)                                                                \
                    _Pragma("GCC unroll 16") for (int c = 0; c < QK / 16; c += 2) {                                 \
                        even += chunk_##NAME(row + b * BYTES, c) * load(x + b * QK + c * 16);                       \
                        odd += chunk_##NAME(row + b * BYTES, c + 1) * load(x + b * QK + c * 16 + 16);               \
                    }                                                                                               \
                vf sum = even + odd;                                                                                \
                float s = 0;                                                                                        \
                for (int l = 0; l < 16; l++) s += sum[l];                                                           \
                j_->y[t * j_->rows + r] = s;                                                                        \
            }                                                                                                       \
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
    }


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
#else
    vf v;
    for (int i = 0; i < 16; i++) v[i] = (float)((const _Float16 *)p)[i];
    return v;
#endif
}

#define ATTENTION(NAME, T, LOAD)                                                                                     \
    static void attend_items_##NAME(const void *arg, int64_t first, int64_t last) {                                 \
        const attention_job *a = arg;                                                                                 \
        int64_t group = a->heads / a->kv_heads, length = a->start + a->queries;                                      \
        float *scores = malloc(sizeof(float) * (size_t)(group * length));                                            \
        vf *mixed = aligned_alloc(64, sizeof(vf) * (size_t)(group * a->value_dim / 16));                             \
        for (int64_t item = first; item < last; item++) {                                                             \
            int64_t t = item / a->kv_heads, g = item % a->kv_heads;                                                  \
            int64_t end = a->start + t + 1, begin = a->window > 0 && end > a->window ? end - a->window : 0;           \
            const float *qg = a->q + (t * a->heads + g * group) * a->dim;                                            \
            float peak[group], total[group];                                                                          \
            for (int64_t h = 0; h < group; h++) peak[h] = a->sinks ? a->sinks[g * group + h] : -INFINITY;            \
            for (int64_t p = begin; p < end; p++) {                                                                   \
                int64_t slot = (int64_t)a->table[p / a->page_size] * a->page_size + p % a->page_size;                \
                const T *kp = (const T *)a->k + (slot * a->kv_heads + g) * a->dim;                                    \
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
                for (int64_t p = begin; p < end; p++) {                                                               \
                    float weight = expf(scores[h * length + p] - peak[h]);                                            \
                    scores[h * length + p] = weight;                                                                  \
                    total[h] += weight;                                                                               \
                }                                                                                                     \
            }                                                                                                         \
            memset(mixed, 0, sizeof(vf) * (size_t)(group * a->value_dim / 16));                                      \
            for (int64_t p = begin; p < end; p++) {                                                                   \
                int64_t slot = (int64_t)a->table[p / a->page_size] * a->page_size + p % a->page_size;                \
                const T *vp = (const T *)a->v + (slot * a->kv_heads + g) * a->value_dim;                              \
                for (int64_t i = 0; i < a->value_dim / 16; i++) {                                                     \
                    vf value = LOAD(vp + 16 * i);                                                                     \
                    for (int64_t h = 0; h < group; h++) mixed[h * a->value_dim / 16 + i] += scores[h * length + p] * value; \
                }                                                                                                     \
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
    }                                                                                                                 \
    void attend_##NAME(const float *q, const void *k, const void *v, const int32_t *table, const float *sinks,       \
                       float *out, int64_t queries, int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim, \
                       int64_t page_size, int64_t start, int64_t window, int64_t out_stride, float scale,            \
                       float softcap, int threads) {                                                                  \
        attention_job a = {q,         k,        v,   table,     sinks, out,   queries,    heads, kv_heads,           \
                           dim,       value_dim, page_size, start, window, out_stride, scale, softcap};             \
        run(threads, queries * kv_heads, attend_items_##NAME, &a);                                                    \
    }

ATTENTION(f32, float, load)
ATTENTION(f16, uint16_t, load_f16)

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

/* out = silu(gate) * up = gate / (1 + exp(-gate)) * up */
void silu_mul(const float *gate, const float *up, float *out, int64_t size) {
    for (int64_t i = 0; i < size; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
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
