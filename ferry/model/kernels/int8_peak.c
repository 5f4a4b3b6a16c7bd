/* The int8 multiply-add peak of the instruction a q8 variant multiplies with, measured now: the
 * bound `ferry bench kernels` holds the q8 products to (the float32 FMA peak is not theirs).
 *
 * AVX-512 VNNI (and AMX's vector pass): vpdpbusd on 64 bytes; AVX-VNNI: vpdpbusd on 32; AVX2 and
 * AVX-512BW: vpmaddubsw on 32 (the kernels' madd and add after it are not counted). Twelve
 * independent accumulators on each thread, written as inline assembly so the compiler cannot fold
 * the repeated products into one (it knows vpdpbusd's arithmetic).
 *
 * And the memory read bandwidth a decode step is bound by (read_bandwidth), measured the same way:
 * by the thread team the products run on.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "ferry_kernels.h"
#include "quant_q8.h"

#define X12(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* One runner per instruction: DECL_, STEP_ and SUM_name give its accumulators, step and sum. */
#define RUNNER(name, isa, T, SET8, SET32)                                     \
    __attribute__((target(isa))) static int32_t name(int64_t iters) {                       \
        T b = SET8(3), c = SET8(5);                                                         \
        X12(DECL_##name)                                                                    \
        for (int64_t k = 0; k < iters; k++) { X12(STEP_##name) }                            \
        T s = SET32(0);                                                                     \
        X12(SUM_##name)                                                                     \
        int32_t out[sizeof(T) / 4];                                                         \
        __builtin_memcpy(out, &s, sizeof s);                                                \
        return out[0];                                                                      \
    }
#define DECL_run_512(i) __m512i a##i = _mm512_set1_epi32(i);
#define STEP_run_512(i) __asm__("vpdpbusd %2, %1, %0" : "+v"(a##i) : "v"(b), "v"(c));
#define SUM_run_512(i) s = _mm512_add_epi32(s, a##i);
RUNNER(run_512, "avx2,avx512f,avx512bw,avx512vnni", __m512i, _mm512_set1_epi8, _mm512_set1_epi32)
#define DECL_run_vnni256(i) __m256i a##i = _mm256_set1_epi32(i);
#define STEP_run_vnni256(i) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(a##i) : "x"(b), "x"(c));
#define SUM_run_vnni256(i) s = _mm256_add_epi32(s, a##i);
RUNNER(run_vnni256, "avx2,avxvnni", __m256i, _mm256_set1_epi8, _mm256_set1_epi32)
/* vpmaddubsw writes its result (no accumulator): b is "changed" between them so none is merged. */
#define DECL_run_avx2(i) __m256i a##i = _mm256_set1_epi32(i);
#define STEP_run_avx2(i) __asm__("vpmaddubsw %2, %1, %0" : "=x"(a##i) : "x"(b), "x"(c)); __asm__("" : "+x"(b));
#define SUM_run_avx2(i) s = _mm256_add_epi16(s, a##i);
RUNNER(run_avx2, "avx2", __m256i, _mm256_set1_epi8, _mm256_set1_epi32)

/* Multiply-adds per second over all OpenMP threads with variant isa's instruction (0 for the
 * portable variant, which has none); iters loops of 12 instructions on each thread. */
double int8_peak(int64_t isa, int64_t iters) {
    const int bytes = isa == ISA_AVX512VNNI || isa == ISA_AMX ? 64 : isa == ISA_PORTABLE ? 0 : 32;
    if (!bytes) return 0.0;
    int nth = 1;
    volatile int32_t sink = 0;
    const double t = now();
    #pragma omp parallel
    {
        #pragma omp single
        nth = omp_get_num_threads();
        const int32_t s = bytes == 64 ? run_512(iters) : isa == ISA_AVXVNNI ? run_vnni256(iters) : run_avx2(iters);
        #pragma omp atomic
        sink += s;
    }
    return (double)nth * iters * 12 * bytes / (now() - t);
}

/* A 32-byte vector (gcc's vector extension: one AVX2 load where the target has it). */
typedef uint8_t v32u8 __attribute__((vector_size(32), aligned(32)));

/* Reads bytes (a multiple of 128) from p in order, four vectors a step; returns their or, so the
 * loads cannot be dropped. */
static uint8_t read_span(const uint8_t *p, int64_t bytes) {
    v32u8 a = {0}, b = {0}, c = {0}, d = {0};
    for (int64_t off = 0; off < bytes; off += 128) {
        const v32u8 *v = (const v32u8 *)(p + off);
        a |= v[0], b |= v[1], c |= v[2], d |= v[3];
    }
    a |= b | c | d;
    uint8_t out = 0;
    for (int i = 0; i < 32; i++) out |= a[i];
    return out;
}

/* Bytes per second the OpenMP team reads from memory, the way a decode step streams its weights:
 * one buffer of `bytes` (far larger than the caches), each thread a contiguous share of it, read in
 * order with 32-byte loads, in the same kind of pages as the weights (anonymous, huge pages advised).
 * The buffer is written first, so every page is backed (untouched pages would all read the one zero
 * page); the best of `reps` passes, after one that wakes the threads. 0 when out of memory. */
double read_bandwidth(int64_t bytes, int64_t reps) {
    bytes -= bytes % 4096;
    if (bytes <= 0) return 0.0;
    uint8_t *buf = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return 0.0;
    madvise(buf, (size_t)bytes, MADV_HUGEPAGE);
    double best = 0.0, t0 = 0.0;
    volatile uint8_t sink = 0;
    #pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t a = bytes / 128 * t / nt * 128, b = bytes / 128 * (t + 1) / nt * 128;
        memset(buf + a, (int)(t + 1), (size_t)(b - a)); /* each thread backs the pages it reads */
        for (int64_t r = 0; r <= reps; r++) {
            #pragma omp barrier
            #pragma omp master
            t0 = now();
            #pragma omp barrier
            const uint8_t got = read_span(buf + a, b - a);
            #pragma omp barrier
            #pragma omp master
            {
                const double s = now() - t0;
                if (r > 0 && (double)bytes / s > best) best = (double)bytes / s;
                sink |= got;
            }
        }
    }
    munmap(buf, (size_t)bytes);
    return best;
}
