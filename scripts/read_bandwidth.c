/* How fast this machine's cores read memory: the limit a CPU decode step's products (which read every weight byte
 * once) are measured against in docs/benchmarks.md. Reads 256 MiB with 64-byte loads, on one thread and on two.
 *
 *     cc -O2 -march=native -pthread scripts/read_bandwidth.c -o /tmp/read_bandwidth && /tmp/read_bandwidth
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BYTES (256ull << 20)
typedef uint64_t line __attribute__((vector_size(64)));

static const uint8_t *memory;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *read_part(void *arg) { /* arg: [first byte, last byte, out] */
    uint64_t *part = arg;
    line a = {0}, b = {0}, c = {0}, d = {0}; /* four chains, so that loads, not the xors, set the pace */
    for (uint64_t i = part[0]; i < part[1]; i += 256) {
        a ^= *(const line *)(memory + i), b ^= *(const line *)(memory + i + 64);
        c ^= *(const line *)(memory + i + 128), d ^= *(const line *)(memory + i + 192);
    }
    line sum = a ^ b ^ c ^ d;
    part[2] = sum[0] ^ sum[7]; /* used, so the loads stay */
    return NULL;
}

int main(void) {
    uint8_t *buffer = aligned_alloc(64, BYTES);
    for (uint64_t i = 0; i < BYTES; i++) buffer[i] = (uint8_t)i;
    memory = buffer;
    for (int threads = 1; threads <= 2; threads++)
        for (int round = 0; round < 3; round++) {
            pthread_t workers[2];
            uint64_t parts[2][3];
            double started = now();
            for (int t = 0; t < threads; t++) {
                parts[t][0] = BYTES / threads * t, parts[t][1] = BYTES / threads * (t + 1);
                pthread_create(&workers[t], NULL, read_part, parts[t]);
            }
            for (int t = 0; t < threads; t++) pthread_join(workers[t], NULL);
            printf("%d thread%s: %.1f GB/s\n", threads, threads > 1 ? "s" : "", BYTES / (now() - started) / 1e9);
        }
    free(buffer);
    return 0;
}
