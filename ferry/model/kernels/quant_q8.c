/* q8 activation mode, one activation row (a decode step): y[N] = x[K] @ w[N, K]^T with x quantized
 * per block of 32 to int8 (scale amax / 127, rounded to nearest, as llama.cpp's q8_0) and integer
 * dot products. More rows take the rounded activations (quant_q8_round) through the float product
 * (quant_gemm.c), faster measured there.
 *
 * A weight block is int8 levels q plus, per 16 weights, a float scale a and offset b (w = a * q + b:
 * Q4_1's m, the K-quants' -dmin * min), so a 16-group adds dx * a * sum(q * qx) + b * dx * sum(qx).
 * With AVX2 the common types' levels are built in registers from the file's blocks and used at once
 * (fused_*); the portable code and the other types unpack a row into an L1 buffer first. The
 * integer sums run per instruction set: portable C, AVX2 (maddubs + madd), AVX-512BW (the same
 * code with AVX-512's encodings and registers), AVX-VNNI / AVX-512-VNNI (dpbusd); each gives, per
 * 32 weights, eight int32 sums of 4 products, scaled and added in eight float lanes in the order
 * the portable code spells out lane by lane, so every variant returns the portable one's bits. The
 * variant is picked at first use from the CPU's features (quant_q8_isa overrides it). This file is
 * built for plain x86-64-v2 with each variant's instructions enabled by target attributes, so the
 * AVX2 variant holds no AVX-512 instruction.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_types.h"

/* Variant ids, in the order quant_q8_isa names them. */
enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512BW, ISA_AVXVNNI, ISA_AVX512VNNI, ISA_COUNT };

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
        static const int order[] = {ISA_AVX512VNNI, ISA_AVXVNNI, ISA_AVX512BW, ISA_AVX2, ISA_PORTABLE};
        for (int i = 0; i < 5; i++)
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
            const float d = qt_f16(bl), dmin = qt_f16(bl + 2);
            const uint8_t *s = bl + 4, *qh = bl + 16, *qs = bl + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                qt_scale_min_k4(s, j, &sc, &m);
                a[2 * j] = a[2 * j + 1] = d * (float)sc;
                b[2 * j] = b[2 * j + 1] = -(dmin * (float)m);
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
            const float d = qt_f16(bl + 208);
            for (int g = 0; g < 16; g++) {
                a[g] = d * (float)(int8_t)bl[192 + g];
                b[g] = 0.f;
            }
            for (int e = 0; e < 256; e++) {
                const int half = e / 128, r = e % 128;
                const int lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
                const int hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
                q[e] = (int8_t)((lo | (hi << 4)) - 32);
            }
            return;
        }
        case QT_IQ4_XS: {
            const float d = qt_f16(bl);
            const uint16_t sh = (uint16_t)(bl[2] | (bl[3] << 8));
            for (int j = 0; j < 8; j++) {
                const int ls = (((bl[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
                a[2 * j] = a[2 * j + 1] = d * (float)ls;
                b[2 * j] = b[2 * j + 1] = 0.f;
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
static inline int has_offset(int64_t type) {
    return type == QT_Q4_1 || type == QT_Q5_1 || type == QT_Q2_K || type == QT_Q4_K || type == QT_Q5_K;
}

/* With AVX2, the common types' levels are built 32 at a time in a register (used at once by the
 * fused one-row products, or stored by unpack_block_avx2); levels are integers, so they equal
 * unpack_block's, and the scales are the same float operations. */

/* Every AVX2 CPU has F16C: one instruction per float16 scale (qt_f16's portable form is a loop). */
__attribute__((target("f16c"))) static inline float f16(const uint8_t *p) {
    return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8)));
}

/* The types these serve: a 32-block's (levels32) or a super-block's, chunk by chunk (levels_k). */
static inline int fast32(int64_t type) {
    return type == QT_Q4_0 || type == QT_Q4_1 || type == QT_Q5_0 || type == QT_Q5_1 || type == QT_Q8_0 ||
           type == QT_IQ4_NL;
}
static inline int fast_k(int64_t type) {
    return type == QT_Q4_K || type == QT_Q5_K || type == QT_Q6_K || type == QT_IQ4_XS;
}

/* 16 nibbles -> 32 levels: the low nibbles first, then the high ones (IQ4: through the table). */
__attribute__((target("avx2"), always_inline)) static inline __m256i nibbles(const uint8_t *qs, int iq4) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_and_si256(_mm256_setr_m128i(raw, _mm_srli_epi16(raw, 4)), _mm256_set1_epi8(15));
    if (!iq4) return v;
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4)), v);
}

/* Byte i = 16 where bit i of the 32 bits at p is set, else 0: Q5's fifth bits. */
__attribute__((target("avx2"), always_inline)) static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

/* A 32-block's 32 levels, its scale a and offset b. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256i levels32(const uint8_t *bl, const int64_t type,
                                                                                      float *a, float *b) {
    if (type == QT_Q4_1 || type == QT_Q5_1) {  /* d and m side by side: one conversion for both */
        uint32_t dm;
        memcpy(&dm, bl, 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        *a = _mm_cvtss_f32(f);
        *b = _mm_cvtss_f32(_mm_movehdup_ps(f));
    } else {
        *a = f16(bl);
        *b = 0.f;
    }
    switch (type) {
        case QT_Q8_0: return _mm256_loadu_si256((const __m256i *)(bl + 2));
        case QT_Q4_0: return _mm256_sub_epi8(nibbles(bl + 2, 0), _mm256_set1_epi8(8));
        case QT_Q4_1: return nibbles(bl + 4, 0);
        case QT_IQ4_NL: return nibbles(bl + 2, 1);
        case QT_Q5_0: return _mm256_sub_epi8(_mm256_or_si256(nibbles(bl + 6, 0), fifth_bits(bl + 2)), _mm256_set1_epi8(16));
        default: return _mm256_or_si256(nibbles(bl + 8, 0), fifth_bits(bl + 4)); /* Q5_1 */
    }
}

/* A super-block's per-16 scales a and offsets b. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void block_scales_k(const uint8_t *bl, const int64_t type,
                                                                                         float *a, float *b) {
    if (type == QT_Q4_K || type == QT_Q5_K) {
        const float d = f16(bl), dmin = f16(bl + 2);
        const uint8_t *s = bl + 4;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            qt_scale_min_k4(s, j, &sc, &mn);
            a[2 * j] = a[2 * j + 1] = d * (float)sc;
            b[2 * j] = b[2 * j + 1] = -(dmin * (float)mn);
        }
    } else if (type == QT_Q6_K) {
        const float d = f16(bl + 208);
        for (int g = 0; g < 16; g++) {
            a[g] = d * (float)(int8_t)bl[192 + g];
            b[g] = 0.f;
        }
    } else { /* IQ4_XS */
        const float d = f16(bl);
        const uint16_t sh = (uint16_t)(bl[2] | (bl[3] << 8));
        for (int j = 0; j < 8; j++) {
            const int ls = (((bl[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
            a[2 * j] = a[2 * j + 1] = d * (float)ls;
            b[2 * j] = b[2 * j + 1] = 0.f;
        }
    }
}

/* Chunk c (of 8) of a super-block's levels. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256i levels_k(const uint8_t *bl, const int64_t type, int c) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (type == QT_IQ4_XS) return nibbles(bl + 8 + 16 * c, 1);
    if (type == QT_Q4_K || type == QT_Q5_K) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(bl + (type == QT_Q5_K ? 48 : 16) + (c / 2) * 32));
        const __m256i v = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(raw, 4) : raw, m4);
        if (type == QT_Q4_K) return v;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(bl + 16));  /* bit c of byte l: element 32c + l */
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
        return _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
    }
    /* Q6_K: element half * 128 + s * 32 + l */
    const int half = c / 4, sh = c % 4;
    const __m256i l = _mm256_loadu_si256((const __m256i *)(bl + half * 64 + (sh % 2) * 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(bl + 128 + half * 32));
    const __m256i lo = _mm256_and_si256(sh < 2 ? l : _mm256_srli_epi16(l, 4), m4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * sh)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
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

/* Lane sets and offset sums -> the row's result, in the order dot_portable + offsets spell out. */
__attribute__((target("avx2,fma"), always_inline)) static inline float finish_row(__m256 acc0, __m256 acc1, const float *o,
                                                                                 int offset) {
    float l[8], s = 0.f;
    _mm256_storeu_ps(l, _mm256_add_ps(acc0, acc1));
    for (int i = 0; i < 8; i++) s += l[i];
    return s + (offset ? (o[0] + o[1]) + (o[2] + o[3]) : 0.f);
}


/* roundf's rounding (half away from zero) by truncation, which vectorizes: v - trunc(v) is exact. */
static inline float round_away(float v) {
    const float t = truncf(v);
    return fabsf(v - t) >= 0.5f ? t + copysignf(1.f, v) : t;
}

/* One row of K activations -> int8 q, a scale per 32 (dx[K / 32]) and, per 16, scale times the
 * levels' sum (xs[K / 16]). */
static void quant_q8_activations(const float *x, int64_t K, int8_t *q, float *dx, float *xs) {
    for (int64_t blk = 0; blk < K / 32; blk++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[blk * 32 + i]));
        const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
        dx[blk] = dd;
        for (int h = 0; h < 2; h++) {
            int32_t s = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) {
                const int v = (int)round_away(x[blk * 32 + i] * id);
                q[blk * 32 + i] = (int8_t)v;
                s += v;
            }
            xs[2 * blk + h] = dd * (float)s;
        }
    }
}

/* The same with AVX2, 8 at a time (the same operations, so the same bits for finite inputs). */
__attribute__((target("avx2,fma"))) static void quant_q8_activations_avx2(const float *x, int64_t K, int8_t *q, float *dx,
                                                                          float *xs) {
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
        const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
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
        for (int h = 0; h < 2; h++) {
            const __m256i s8 = _mm256_add_epi32(lv[2 * h], lv[2 * h + 1]);
            int32_t t[8], s = 0;
            _mm256_storeu_si256((__m256i *)t, s8);
            for (int j = 0; j < 8; j++) s += t[j];
            xs[2 * blk + h] = dd * (float)s;
        }
    }
}

/* One row of K activations, quantized once per product. */
typedef struct {
    const int8_t *q;
    const float *dx, *xs;
    int64_t K;
} acts_t;

/* The lanes' sum in one fixed order. */
static inline float hsum8(const float *l) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += l[i];
    return s;
}

/* The order of the float sums, which every variant keeps: 32-chunk i of a row adds its eight lane
 * products to lane set i % 2 and its two offset terms b[2i + h] * xs[2i + h] to offset sum
 * 2 * (i % 2) + h (two chains each, so no variant waits on one add after another); at the end the
 * two lane sets are added lane by lane and summed (hsum8), the four offset sums added as
 * ((o0 + o1) + (o2 + o3)), and the two results added. */
__attribute__((always_inline)) static inline float offsets(const float *b, const float *xs, int64_t nc) {
    float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;  /* o[2 * (i % 2) + h], in registers */
    int64_t g = 0;
    for (; g + 4 <= 2 * nc; g += 4) {
        o0 = fmaf(b[g], xs[g], o0);
        o1 = fmaf(b[g + 1], xs[g + 1], o1);
        o2 = fmaf(b[g + 2], xs[g + 2], o2);
        o3 = fmaf(b[g + 3], xs[g + 3], o3);
    }
    if (g < 2 * nc) {
        o0 = fmaf(b[g], xs[g], o0);
        o1 = fmaf(b[g + 1], xs[g + 1], o1);
    }
    return (o0 + o1) + (o2 + o3);
}
/* The same, as a call (fmaf is a library call without FMA) and with the FMA instruction. */
static float offsets_portable(const float *b, const float *xs, int64_t nc) { return offsets(b, xs, nc); }
__attribute__((target("avx2,fma"))) static float offsets_fma(const float *b, const float *xs, int64_t nc) {
    return offsets(b, xs, nc);
}

/* One unpacked weight row (levels q, scales a and offsets b per 16) times activation row m, over
 * nc chunks of 32; without the offsets. */
typedef float (*dot_fn)(const int8_t *q, const float *a, const acts_t *x, int per16);

static float dot_portable(const int8_t *q, const float *a, const acts_t *x, int per16) {
    (void)per16;
    const int64_t K = x->K;
    const int8_t *qx = x->q;
    const float *dx = x->dx;
    float acc[2][8] = {{0}};
    for (int64_t i = 0; i < K / 32; i++)
        for (int l = 0; l < 8; l++) {
            int32_t p = 0;
            for (int j = 32 * i + 4 * l; j < 32 * i + 4 * l + 4; j++) p += (int32_t)q[j] * qx[j];
            const float t = a[2 * i + l / 4] * dx[i];
            acc[i % 2][l] = fmaf((float)p, t, acc[i % 2][l]);
        }
    float l[8];
    for (int i = 0; i < 8; i++) l[i] = acc[0][i] + acc[1][i];
    return hsum8(l);
}

/* A vector variant: P32(vw, vx) gives the eight int32 sums of 32 weights. */
#define Q8_CHUNK(P32, i, accv)                                                                                  \
        do {                                                                                                 \
            const __m256i vw = _mm256_loadu_si256((const __m256i *)(q + 32 * (i)));                          \
            const __m256i vx = _mm256_loadu_si256((const __m256i *)(qx + 32 * (i)));                         \
            const float d = dx[i];                                                                           \
            const __m256 t = per16 ? _mm256_setr_m128(_mm_set1_ps(a[2 * (i)] * d), _mm_set1_ps(a[2 * (i) + 1] * d)) \
                                   : _mm256_set1_ps(a[2 * (i)] * d);                                         \
            accv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P32(vw, vx)), t, accv);                   \
        } while (0)
#define DOT_VARIANT(name, isa, P32)                                                                          \
    __attribute__((target(isa))) static float name(const int8_t *q, const float *a, const acts_t *x,          \
                                                   int per16) {                                             \
        const int64_t K = x->K, nc = K / 32;                                                                 \
        const int8_t *qx = x->q;                                                                             \
        const float *dx = x->dx;                                                                             \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                                            \
        int64_t i = 0;                                                                                       \
        for (; i + 1 < nc; i += 2) {                                                                         \
            Q8_CHUNK(P32, i, acc[0]);                                                                           \
            Q8_CHUNK(P32, i + 1, acc[1]);                                                                       \
        }                                                                                                    \
        if (i < nc) Q8_CHUNK(P32, i, acc[0]);                                                                   \
        float l[8];                                                                                          \
        _mm256_storeu_ps(l, _mm256_add_ps(acc[0], acc[1]));                                                   \
        return hsum8(l);                                                                                     \
    }

/* maddubs multiplies unsigned by signed bytes: |w| times x with w's sign (at most 2 * 128 * 127
 * per int16 pair, no saturation). */
#define P32_MADDUBS(vw, vx) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(vw, vw), _mm256_sign_epi8(vx, vw)), _mm256_set1_epi16(1))
/* Levels that are never negative (the offset types) go to maddubs / dpbusd as they are: the
 * same integer sums without the two sign instructions. */
#define P32U_MADDUBS(vw, vx) _mm256_madd_epi16(_mm256_maddubs_epi16(vw, vx), _mm256_set1_epi16(1))
#define P32U_AVXVNNI(vw, vx) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), vw, vx)
#define P32U_AVX512VNNI(vw, vx) _mm256_dpbusd_epi32(_mm256_setzero_si256(), vw, vx)
/* dpbusd: 4 unsigned-by-signed byte products added into each int32, no saturation. */
#define P32_AVXVNNI(vw, vx) \
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(vw, vw), _mm256_sign_epi8(vx, vw))
#define P32_AVX512VNNI(vw, vx) \
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(vw, vw), _mm256_sign_epi8(vx, vw))
DOT_VARIANT(dot_avx2, "avx2,fma,f16c", P32_MADDUBS)
DOT_VARIANT(dot_avx512bw, "avx2,fma,f16c,avx512f,avx512bw,avx512vl", P32_MADDUBS)
DOT_VARIANT(dot_avxvnni, "avx2,fma,f16c,avxvnni", P32_AVXVNNI)
DOT_VARIANT(dot_avx512vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", P32_AVX512VNNI)
static const dot_fn DOTS[ISA_COUNT] = {dot_portable, dot_avx2, dot_avx512bw, dot_avxvnni, dot_avx512vnni};


/* One activation row (M = 1, a decode step): the levels are built in a register from the block
 * and used at once, with no unpacked copy; the same sums in the same order. */

/* Chunk i's lane products into accv and its offsets into o[0], o[1] (the order of finish_row). */
#define FUSED_CHUNK(P32, P32U, vw, a0, a1, b0, b1, i, accv, o)                                              \
    do {                                                                                           \
        const __m256i vx = _mm256_loadu_si256((const __m256i *)(qx + 32 * (i)));                   \
        const float d = dx[i];                                                                     \
        const __m256 t = per16 ? _mm256_setr_m128(_mm_set1_ps((a0) * d), _mm_set1_ps((a1) * d))   \
                               : _mm256_set1_ps((a0) * d);                                         \
        accv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset ? P32U(vw, vx) : P32(vw, vx)), t, accv);    \
        if (offset) {                                                                              \
            (o)[0] = fmaf(b0, xs[2 * (i)], (o)[0]);                                                  \
            (o)[1] = fmaf(b1, xs[2 * (i) + 1], (o)[1]);                                              \
        }                                                                                          \
    } while (0)

/* fused_<sfx>(row, type, x, y): 1 when it served the type (y set), else 0. */
#define FUSED_VARIANT(sfx, isa, P32, P32U)                                                                          \
    __attribute__((target(isa), always_inline)) static inline float fused32_##sfx(                            \
            const uint8_t *row, const int64_t type, const int8_t *qx, const float *dx, const float *xs, int64_t nc) { \
        const int64_t bytes = qt_bytes(type);                                                                 \
        const int per16 = 0, offset = has_offset(type);                                                       \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                        \
        float o[4] = {0.f, 0.f, 0.f, 0.f}, a, b, a2, b2;                                                      \
        int64_t i = 0;                                                                                        \
        for (; i + 1 < nc; i += 2) {                                                                          \
            const __m256i v0 = levels32(row + i * bytes, type, &a, &b);                                       \
            const __m256i v1 = levels32(row + (i + 1) * bytes, type, &a2, &b2);                               \
            FUSED_CHUNK(P32, P32U, v0, a, a, b, b, i, acc0, o);                                                     \
            FUSED_CHUNK(P32, P32U, v1, a2, a2, b2, b2, i + 1, acc1, o + 2);                                         \
        }                                                                                                     \
        if (i < nc) {                                                                                         \
            const __m256i v0 = levels32(row + i * bytes, type, &a, &b);                                       \
            FUSED_CHUNK(P32, P32U, v0, a, a, b, b, i, acc0, o);                                                     \
        }                                                                                                     \
        return finish_row(acc0, acc1, o, offset);                                                         \
    }                                                                                                         \
    __attribute__((target(isa), always_inline)) static inline float fusedk_##sfx(                             \
            const uint8_t *row, const int64_t type, const int8_t *qx, const float *dx, const float *xs, int64_t nc) { \
        const int64_t bytes = qt_bytes(type);                                                                 \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                        \
        const int per16 = type == QT_Q6_K, offset = has_offset(type);                                           \
        float o[4] = {0.f, 0.f, 0.f, 0.f}, a[16], b[16];                                                      \
        for (int64_t i = 0; i < nc; i += 8, row += bytes) {                                                   \
            block_scales_k(row, type, a, b);                                                            \
            for (int c = 0; c < 8; c += 2) {                                                                  \
                const __m256i v0 = levels_k(row, type, c), v1 = levels_k(row, type, c + 1);                   \
                FUSED_CHUNK(P32, P32U, v0, a[2 * c], a[2 * c + 1], b[2 * c], b[2 * c + 1], i + c, acc0, o);         \
                FUSED_CHUNK(P32, P32U, v1, a[2 * c + 2], a[2 * c + 3], b[2 * c + 2], b[2 * c + 3], i + c + 1, acc1, o + 2); \
            }                                                                                                 \
        }                                                                                                     \
        return finish_row(acc0, acc1, o, offset);                                                         \
    }                                                                                                         \
    __attribute__((target(isa))) static int fused_##sfx(const uint8_t *row, int64_t type, const acts_t *x,    \
                                                       float *y) {                                            \
        const int64_t K = x->K, nc = K / 32;                                                                  \
        const int8_t *qx = x->q;                                                                              \
        const float *dx = x->dx, *xs = x->xs;                                                                 \
        switch (type) {                                                                                       \
            case QT_Q4_0: *y = fused32_##sfx(row, QT_Q4_0, qx, dx, xs, nc); return 1;                         \
            case QT_Q4_1: *y = fused32_##sfx(row, QT_Q4_1, qx, dx, xs, nc); return 1;                         \
            case QT_Q5_0: *y = fused32_##sfx(row, QT_Q5_0, qx, dx, xs, nc); return 1;                         \
            case QT_Q5_1: *y = fused32_##sfx(row, QT_Q5_1, qx, dx, xs, nc); return 1;                         \
            case QT_Q8_0: *y = fused32_##sfx(row, QT_Q8_0, qx, dx, xs, nc); return 1;                         \
            case QT_IQ4_NL: *y = fused32_##sfx(row, QT_IQ4_NL, qx, dx, xs, nc); return 1;                     \
            case QT_Q4_K: *y = fusedk_##sfx(row, QT_Q4_K, qx, dx, xs, nc); return 1;                          \
            case QT_Q5_K: *y = fusedk_##sfx(row, QT_Q5_K, qx, dx, xs, nc); return 1;                          \
            case QT_Q6_K: *y = fusedk_##sfx(row, QT_Q6_K, qx, dx, xs, nc); return 1;                          \
            case QT_IQ4_XS: *y = fusedk_##sfx(row, QT_IQ4_XS, qx, dx, xs, nc); return 1;                      \
            default: return 0;                                                                                \
        }                                                                                                     \
    }
FUSED_VARIANT(avx2, "avx2,fma,f16c", P32_MADDUBS, P32U_MADDUBS)
FUSED_VARIANT(avx512bw, "avx2,fma,f16c,avx512f,avx512bw,avx512vl", P32_MADDUBS, P32U_MADDUBS)
FUSED_VARIANT(avxvnni, "avx2,fma,f16c,avxvnni", P32_AVXVNNI, P32U_AVXVNNI)
FUSED_VARIANT(avx512vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", P32_AVX512VNNI, P32U_AVX512VNNI)
typedef int (*fused_fn)(const uint8_t *row, int64_t type, const acts_t *x, float *y);
static const fused_fn FUSED[ISA_COUNT] = {NULL, fused_avx2, fused_avx512bw, fused_avxvnni, fused_avx512vnni};

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

/* y[N] = x[K] @ w[N, K]^T for one activation row (quant_gemm calls this for one row only). */
void quant_gemv_q8(const float *x, const uint8_t *w, float *y, int64_t N, int64_t K, int64_t type) {
    const int64_t isa = quant_q8_isa(-2);
    const dot_fn dot = DOTS[isa];
    const fused_fn fused = FUSED[isa];
    const int64_t row_bytes = K / qt_block(type) * qt_bytes(type), G = K / 16;
    const int offset = has_offset(type), per16 = type == QT_Q2_K || type == QT_Q3_K || type == QT_Q6_K;
    int8_t *qx = malloc((size_t)K);
    float *dx = malloc(sizeof(float) * (size_t)(K / 32)), *xs = malloc(sizeof(float) * (size_t)G);
    (isa == ISA_PORTABLE ? quant_q8_activations : quant_q8_activations_avx2)(x, K, qx, dx, xs);
    const acts_t acts = {qx, dx, xs, K};
    #pragma omp parallel
    {
        int8_t *q = malloc((size_t)K);
        float *a = malloc(sizeof(float) * (size_t)G), *b = malloc(sizeof(float) * (size_t)G);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (fused && fused(w + n * row_bytes, type, &acts, y + n)) continue;
            if (isa == ISA_PORTABLE) unpack_row(w + n * row_bytes, type, K, q, a, b);
            else unpack_row_avx2(w + n * row_bytes, type, K, q, a, b);
            y[n] = dot(q, a, &acts, per16) + (offset ? (isa == ISA_PORTABLE ? offsets_portable : offsets_fma)(b, xs, K / 32) : 0.f);
        }
        free(q); free(a); free(b);
    }
    free(qx); free(dx); free(xs);
}

/* out[M, K] = x rounded as the q8 products see it (level times block scale): products with many
 * rows multiply these floats with BLAS, which equals the integer products up to the order of sums. */
void quant_q8_round(const float *x, float *out, int64_t M, int64_t K) {
    const int portable = quant_q8_isa(-2) == ISA_PORTABLE;
    #pragma omp parallel if (M > 4)
    {
        int8_t *q = malloc((size_t)K);
        float *dx = malloc(sizeof(float) * (size_t)(K / 32)), *xs = malloc(sizeof(float) * (size_t)(K / 16));
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            (portable ? quant_q8_activations : quant_q8_activations_avx2)(x + m * K, K, q, dx, xs);
            for (int64_t k = 0; k < K; k++) out[m * K + k] = dx[k / 32] * (float)q[k];
        }
        free(q); free(dx); free(xs);
    }
}
