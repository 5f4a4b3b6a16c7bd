/* What the q8 products (quant_q8_tiles.c) start from: the variant of the instruction set in use,
 * picked at first use from the CPU's features (quant_q8_isa overrides it); activations quantized per
 * block of 32 to int8 (scale amax / 127, rounded to nearest, as llama.cpp's q8_0); and a weight
 * row unpacked to int8 levels q plus, per 16 weights, a float scale a and offset b (w = a * q + b:
 * Q4_1's m, the K-quants' -dmin * min). The common types' levels are built with AVX2 from the
 * file's blocks (q8_levels.h), the others (and the portable variant) block by block in C; levels
 * are integers and scales the same float operations, so both give the same values. This file is
 * built for plain x86-64-v2 with each variant's instructions enabled by target attributes, so the
 * AVX2 variant holds no AVX-512 instruction.
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "quant_types.h"
#include "quant_q8.h"
#include "q8_levels.h"


/* AMX-INT8 runs only where the CPU has it (CPUID 7.0 EDX bits 24, 25) and Linux lets this process
 * use the tile registers (ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once for the whole process). */
static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        usable = ((d >> 24) & 3) == 3 && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return usable;
}

static int isa_supported(int64_t isa) {
    __builtin_cpu_init();
    /* Every vector variant uses AVX2, FMA and F16C (all AVX2 CPUs have the other two). */
    const int base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const int avx512 = base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    switch (isa) {
        case ISA_PORTABLE: return 1;
        case ISA_AVX2: return base;
        case ISA_AVX512BW: return avx512;
        case ISA_AVXVNNI: return base && __builtin_cpu_supports("avxvnni");
        case ISA_AVX512VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
        case ISA_AMX: return avx512 && __builtin_cpu_supports("avx512vnni") && amx_usable();
        default: return 0;
    }
}

static int64_t current_isa = -1;

/* Which variant runs: isa >= 0 picks one (returns -1 when this CPU lacks it), -1 picks the best
 * this CPU has; returns the variant in use. */
int64_t quant_q8_isa(int64_t isa) {
    if (isa >= 0) {
        if (!isa_supported(isa)) return -1;
        current_isa = isa;
    } else if (isa == -1 || current_isa < 0) {
        static const int order[] = {ISA_AMX, ISA_AVX512VNNI, ISA_AVXVNNI, ISA_AVX512BW, ISA_AVX2, ISA_PORTABLE};
        for (int i = 0; i < 6; i++)
            if (isa_supported(order[i])) { current_isa = order[i]; break; }
    }
    return current_isa;
}

/* One block of weights -> int8 levels q[block] and per 16 weights a scale a and offset b. */
static void unpack_block(const uint8_t *bl, int64_t type, int8_t *q, float *a, float *b) {
    switch (type) {
        case QT_Q4_0: case QT_Q4_1: case QT_IQ4_NL: {
            const float d = qt_f16(bl), m = type == QT_Q4_1 ? qt_f16(bl + 2) : 0.f;
            const uint8_t *qs = bl + (type == QT_Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                const int lo = qs[i] & 15, hi = qs[i] >> 4;
                q[i] = (int8_t)(type == QT_IQ4_NL ? KVALUES_IQ4[lo] : type == QT_Q4_0 ? lo - 8 : lo);
                q[i + 16] = (int8_t)(type == QT_IQ4_NL ? KVALUES_IQ4[hi] : type == QT_Q4_0 ? hi - 8 : hi);
            }
            a[0] = a[1] = d;
            b[0] = b[1] = m;
            return;
        }
        case QT_Q5_0: case QT_Q5_1: {
            const int one = type == QT_Q5_1;
            const float d = qt_f16(bl), m = one ? qt_f16(bl + 2) : 0.f;
            uint32_t qh;
            memcpy(&qh, bl + (one ? 4 : 2), 4);
            const uint8_t *qs = bl + (one ? 8 : 6);
            for (int i = 0; i < 32; i++) {
                const int v = (i < 16 ? qs[i] & 15 : qs[i - 16] >> 4) | (int)(((qh >> i) & 1) << 4);
                q[i] = (int8_t)(one ? v : v - 16);
            }
            a[0] = a[1] = d;
            b[0] = b[1] = m;
            return;
        }
        case QT_Q8_0: {
            const float d = qt_f16(bl);
            memcpy(q, bl + 2, 32);
            a[0] = a[1] = d;
            b[0] = b[1] = 0.f;
            return;
        }
        case QT_Q2_K: {
            const float d = qt_f16(bl + 80), dmin = qt_f16(bl + 82);
            for (int g = 0; g < 16; g++) {
                a[g] = d * (float)(bl[g] & 15);
                b[g] = -(dmin * (float)(bl[g] >> 4));
            }
            for (int e = 0; e < 256; e++) q[e] = (int8_t)((bl[16 + (e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3);
            return;
        }
        case QT_Q3_K: {
            const uint8_t *hm = bl, *qs = bl + 32, *s = bl + 96;
            const float d = qt_f16(bl + 108);
            for (int g = 0; g < 16; g++) {
                const int lo = (s[g % 8] >> (4 * (g / 8))) & 15, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
                a[g] = d * (float)((lo | (hi << 4)) - 32);
                b[g] = 0.f;
            }
            for (int e = 0; e < 256; e++) {
                const int ql = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
                q[e] = (int8_t)(ql - ((((hm[e % 32] >> (e / 32)) & 1) ^ 1) << 2));
            }
            return;
        }
        case QT_Q4_K: case QT_Q5_K: {
            const int five = type == QT_Q5_K;
            const uint8_t *qh = bl + 16, *qs = bl + (five ? 48 : 16);
            k_scales(bl, type, qt_f16(bl), qt_f16(bl + 2), a, b);
            for (int j = 0; j < 8; j++) {
                for (int l = 0; l < 32; l++) {
                    int v = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 15;
                    if (five) v |= ((qh[l] >> j) & 1) << 4;
                    q[j * 32 + l] = (int8_t)v;
                }
            }
            return;
        }
        case QT_Q6_K: {
            const uint8_t *ql = bl, *qh = bl + 128;
            k_scales(bl, type, qt_f16(bl + 208), 0.f, a, b);
            for (int e = 0; e < 256; e++) {
                const int half = e / 128, r = e % 128;
                const int lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
                const int hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
                q[e] = (int8_t)((lo | (hi << 4)) - 32);
            }
            return;
        }
        case QT_IQ4_XS: {
            k_scales(bl, type, qt_f16(bl), 0.f, a, b);
            for (int j = 0; j < 8; j++) {
                const uint8_t *qs = bl + 8 + 16 * j;
                for (int i = 0; i < 16; i++) {
                    q[j * 32 + i] = KVALUES_IQ4[qs[i] & 15];
                    q[j * 32 + 16 + i] = KVALUES_IQ4[qs[i] >> 4];
                }
            }
            return;
        }
        default: memset(q, 0, (size_t)qt_block(type)); /* unreachable: quant.py checks types at load */
    }
}

/* The types whose weights carry an offset b (w = a * q + b); their levels are never negative. */
int q8_has_offset(int64_t type) {
    return type == QT_Q4_1 || type == QT_Q5_1 || type == QT_Q2_K || type == QT_Q4_K || type == QT_Q5_K;
}

/* One block unpacked to q, a, b as unpack_block does; 0 for a type left to it. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline int unpack_block_avx2(const uint8_t *bl, int64_t type,
                                                                                          int8_t *q, float *a, float *b) {
    if (fast32(type)) {
        _mm256_storeu_si256((__m256i *)q, levels32(bl, type, a, b));
        a[1] = a[0];
        b[1] = b[0];
        return 1;
    }
    if (!fast_k(type)) return 0;
    block_scales_k(bl, type, a, b);
    for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)(q + 32 * c), levels_k(bl, type, c));
    return 1;
}

/* roundf's rounding (half away from zero) by truncation, which vectorizes: v - trunc(v) is exact. */
static inline float round_away(float v) {
    const float t = truncf(v);
    return fabsf(v - t) >= 0.5f ? t + copysignf(1.f, v) : t;
}

/* One row of K activations -> int8 q and a scale per 32 (dx[K / 32]). A block whose scale is
 * below FLT_MIN is all zeros: 1 / dd would overflow, and with it the levels' |q| <= 127. */
static void quant_q8_activations(const float *x, int64_t K, int8_t *q, float *dx) {
    for (int64_t blk = 0; blk < K / 32; blk++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[blk * 32 + i]));
        const float dd = amax / 127.f, id = dd >= FLT_MIN ? 1.f / dd : 0.f;
        dx[blk] = dd;
        for (int i = 0; i < 32; i++) q[blk * 32 + i] = (int8_t)(int)round_away(x[blk * 32 + i] * id);
    }
}

/* The same with AVX2, 8 at a time (the same operations, so the same bits for finite inputs). */
__attribute__((target("avx2,fma"))) static void quant_q8_activations_avx2(const float *x, int64_t K, int8_t *q, float *dx) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), half = _mm256_set1_ps(0.5f);
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const float *xb = x + blk * 32;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            m = _mm256_max_ps(m, _mm256_and_ps(v[j], absmask));
        }
        float l[8], amax = 0.f;
        _mm256_storeu_ps(l, m);
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, l[j]);
        const float dd = amax / 127.f, id = dd >= FLT_MIN ? 1.f / dd : 0.f;
        dx[blk] = dd;
        __m256i lv[4];
        for (int j = 0; j < 4; j++) {
            const __m256 y = _mm256_mul_ps(v[j], _mm256_set1_ps(id));
            const __m256 t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m256 up = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(y, t), absmask), half, _CMP_GE_OQ);
            const __m256 step = _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(y, sign)));
            lv[j] = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
        }
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
        const __m256i w01 = _mm256_packs_epi32(lv[0], lv[1]), w23 = _mm256_packs_epi32(lv[2], lv[3]);
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + blk * 32), b);
    }
}

/* Row n of w -> levels q[K], and per 16 weights the scale a and offset b. */
__attribute__((target("avx2,fma,f16c"))) static void unpack_row_avx2(const uint8_t *bl, int64_t type, int64_t K, int8_t *q,
                                                                  float *a, float *b) {
    const int64_t block = qt_block(type), bytes = qt_bytes(type);
    for (int64_t k = 0; k < K; k += block, bl += bytes, q += block, a += block / 16, b += block / 16)
        if (!unpack_block_avx2(bl, type, q, a, b)) unpack_block(bl, type, q, a, b);
}
static void unpack_row(const uint8_t *bl, int64_t type, int64_t K, int8_t *q, float *a, float *b) {
    const int64_t block = qt_block(type), bytes = qt_bytes(type);
    for (int64_t k = 0; k < K; k += block, bl += bytes, q += block, a += block / 16, b += block / 16)
        unpack_block(bl, type, q, a, b);
}

/* Shared with quant_q8_tiles.c (quant_q8.h): one activation row quantized, one weight row unpacked. */
void q8_quantize_row(const float *x, int64_t K, int8_t *q, float *dx, int portable) {
    (portable ? quant_q8_activations : quant_q8_activations_avx2)(x, K, q, dx);
}
void q8_unpack_row(const uint8_t *row, int64_t type, int64_t K, int8_t *q, float *a, float *b, int portable) {
    (portable ? unpack_row : unpack_row_avx2)(row, type, K, q, a, b);
}
