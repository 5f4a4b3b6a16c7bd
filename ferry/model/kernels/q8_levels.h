/* A block's int8 levels built in an AVX2 register straight from the file's bytes (the common
 * types: 32 at a time), with their scales a and offsets b (w = a * q + b): what the q8 products
 * (quant_q8.c, quant_q8_tiles.c) multiply. Levels are integers, so they equal unpack_block's, and
 * the scales are the same float operations. */
#ifndef FERRY_Q8_LEVELS_H
#define FERRY_Q8_LEVELS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_types.h"

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

/* A K-quant or IQ4_XS super-block's per-16 scales a and offsets b from its float16 scales, already
 * converted: d (and dmin for Q4_K / Q5_K). Plain C: unpack_block's portable path uses it too. */
static inline void k_scales(const uint8_t *bl, const int64_t type, float d, float dmin, float *a, float *b) {
    if (type == QT_Q4_K || type == QT_Q5_K) {
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            qt_scale_min_k4(bl + 4, j, &sc, &mn);
            a[2 * j] = a[2 * j + 1] = d * (float)sc;
            b[2 * j] = b[2 * j + 1] = -(dmin * (float)mn);
        }
    } else if (type == QT_Q6_K) {
        for (int g = 0; g < 16; g++) {
            a[g] = d * (float)(int8_t)bl[192 + g];
            b[g] = 0.f;
        }
    } else { /* IQ4_XS */
        const uint16_t sh = (uint16_t)(bl[2] | (bl[3] << 8));
        for (int j = 0; j < 8; j++) {
            const int ls = (((bl[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
            a[2 * j] = a[2 * j + 1] = d * (float)ls;
            b[2 * j] = b[2 * j + 1] = 0.f;
        }
    }
}

/* The same with F16C converting d and dmin. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void block_scales_k(const uint8_t *bl, const int64_t type,
                                                                                         float *a, float *b) {
    const int mins = type == QT_Q4_K || type == QT_Q5_K;
    k_scales(bl, type, f16(bl + (type == QT_Q6_K ? 208 : 0)), mins ? f16(bl + 2) : 0.f, a, b);
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

#endif
