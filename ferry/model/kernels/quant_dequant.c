/* Dequantization of every GGUF type in quant_types.h, bit for bit as gguf.quants.dequantize:
 * the same float32 operations in the same order. This file is compiled without -ffast-math and
 * with -ffp-contract=off (kernels/__init__.py), so no multiply-add is fused and no sum reordered.
 * Block layouts are the file's own (ggml's block_q4_0 ... block_iq4_xs). */
#include <stdint.h>
#include <string.h>

#include "ferry_kernels.h"
#include "quant_types.h"

#if defined(__AVX2__)
/* With AVX2 each type's levels are built 8 at a time as int32 lanes (gcc does not vectorize the
 * nibble loops with 8 float lanes: 7x slower), then scaled by the same float operations as the
 * scalar code below, one multiply and one add or subtract, unfused, so the bits are the same. */
#include <immintrin.h>

/* 8 bytes at p as int32 lanes, unsigned or signed. */
static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i i8x8(const void *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
/* (p[l] >> shift) & mask for l < 8. */
static inline __m256i field(const uint8_t *p, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi32(u8x8(p), _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
}
static inline __m256i plus(__m256i q, int c) { return _mm256_add_epi32(q, _mm256_set1_epi32(c)); }
static inline void put(float *y, __m256i q, float d) {
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q)));
}
static inline void put_add(float *y, __m256i q, float d, float m) {
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q)), _mm256_set1_ps(m)));
}
static inline void put_sub(float *y, __m256i q, float d, float m) {
    _mm256_storeu_ps(y, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q)), _mm256_set1_ps(m)));
}
/* Bit i + 4 of a 32-bit mask for lanes i = first .. first + 7, at bit 4: Q5's fifth bits. */
static inline __m256i bit5(uint32_t qh, int first) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i b = _mm256_srlv_epi32(_mm256_set1_epi32((int)qh), plus(idx, first));
    return _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(1)), 4);
}
/* The IQ4 levels of 16 nibbles (lo: the low ones) as int8, by one table shuffle. */
static inline __m128i iq4_levels(const uint8_t *qs, int hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    const __m128i nib = _mm_and_si128(hi ? _mm_srli_epi16(raw, 4) : raw, m);
    return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)KVALUES_IQ4), nib);
}
static inline void put_iq4(float *y, const uint8_t *qs, float d) {
    for (int h = 0; h < 2; h++) {
        int8_t lv[16];
        _mm_storeu_si128((__m128i *)lv, iq4_levels(qs, h));
        put(y + 16 * h, i8x8(lv), d);
        put(y + 16 * h + 8, i8x8(lv + 8), d);
    }
}

static void q4_0(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    for (int c = 0; c < 16; c += 8) {
        put(y + c, plus(field(b + 2 + c, 0, 15), -8), d);
        put(y + 16 + c, plus(field(b + 2 + c, 4, 15), -8), d);
    }
}
static void q4_1(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), m = qt_f16(b + 2);
    for (int c = 0; c < 16; c += 8) {
        put_add(y + c, field(b + 4 + c, 0, 15), d, m);
        put_add(y + 16 + c, field(b + 4 + c, 4, 15), d, m);
    }
}
static void q5_0(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int c = 0; c < 16; c += 8) {
        put(y + c, plus(_mm256_or_si256(field(b + 6 + c, 0, 15), bit5(qh, c)), -16), d);
        put(y + 16 + c, plus(_mm256_or_si256(field(b + 6 + c, 4, 15), bit5(qh, 16 + c)), -16), d);
    }
}
static void q5_1(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), m = qt_f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int c = 0; c < 16; c += 8) {
        put_add(y + c, _mm256_or_si256(field(b + 8 + c, 0, 15), bit5(qh, c)), d, m);
        put_add(y + 16 + c, _mm256_or_si256(field(b + 8 + c, 4, 15), bit5(qh, 16 + c)), d, m);
    }
}
static void q8_0(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    for (int c = 0; c < 32; c += 8) put(y + c, i8x8(b + 2 + c), d);
}
static void iq4_nl(const uint8_t *restrict b, float *restrict y) { put_iq4(y, b + 2, qt_f16(b)); }

static void q2_k(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = qt_f16(b + 80), dmin = qt_f16(b + 82);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < 2; h++) {
                const int g = half * 8 + 2 * s + h;
                const float dl = d * (float)(sc[g] & 15), ml = dmin * (float)(sc[g] >> 4);
                const uint8_t *q = qs + half * 32 + 16 * h;
                float *out = y + half * 128 + s * 32 + 16 * h;
                for (int c = 0; c < 16; c += 8) put_sub(out + c, field(q + c, 2 * s, 3), dl, ml);
            }
}
static void q3_k(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = qt_f16(b + 108);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < 2; h++) {
                const int g = half * 8 + 2 * s + h;
                const int lo = (sc[g % 8] >> (4 * (g / 8))) & 15, hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                const float dl = d * (float)((lo | (hi << 4)) - 32);
                const uint8_t *q = qs + half * 32 + 16 * h, *m = hm + 16 * h;
                float *out = y + half * 128 + s * 32 + 16 * h;
                for (int c = 0; c < 16; c += 8) {
                    const __m256i low = _mm256_slli_epi32(_mm256_xor_si256(field(m + c, half * 4 + s, 1),
                                                                           _mm256_set1_epi32(1)), 2);
                    put(out + c, _mm256_sub_epi32(field(q + c, 2 * s, 3), low), dl);
                }
            }
}
static void q4_k(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), dmin = qt_f16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        qt_scale_min_k4(b + 4, j, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t *qs = b + 16 + (j / 2) * 32;
        for (int c = 0; c < 32; c += 8) put_sub(y + j * 32 + c, field(qs + c, 4 * (j % 2), 15), ds, dm);
    }
}
static void q5_k(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), dmin = qt_f16(b + 2);
    const uint8_t *qh = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        qt_scale_min_k4(b + 4, j, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t *qs = b + 48 + (j / 2) * 32;
        for (int c = 0; c < 32; c += 8) {
            const __m256i v = _mm256_or_si256(field(qs + c, 4 * (j % 2), 15), _mm256_slli_epi32(field(qh + c, j, 1), 4));
            put_sub(y + j * 32 + c, v, ds, dm);
        }
    }
}
static void q6_k(const uint8_t *restrict b, float *restrict y) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = qt_f16(b + 208);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < 2; h++) {
                const float dl = d * (float)sc[half * 8 + 2 * s + h];
                const uint8_t *ql = b + half * 64 + (s % 2) * 32 + 16 * h, *qh = b + 128 + half * 32 + 16 * h;
                float *out = y + half * 128 + s * 32 + 16 * h;
                for (int c = 0; c < 16; c += 8) {
                    const __m256i v = _mm256_or_si256(field(ql + c, 4 * (s / 2), 15),
                                                      _mm256_slli_epi32(field(qh + c, 2 * s, 3), 4));
                    put(out + c, plus(v, -32), dl);
                }
            }
}
static void iq4_xs(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    const uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
    const uint8_t *sl = b + 4;
    for (int j = 0; j < 8; j++) {
        const int ls = (((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
        put_iq4(y + j * 32, b + 8 + j * 16, d * (float)ls);
    }
}
#else
/* Loops are written so the compiler vectorizes them: element i < 16 of a 32-block is the low
 * nibble of qs[i], element 16 + i its high nibble. */
static void q4_0(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    const uint8_t *qs = b + 2;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((qs[i] & 15) - 8);
        y[i + 16] = d * (float)((qs[i] >> 4) - 8);
    }
}
static void q4_1(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), m = qt_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(qs[i] & 15) + m;
        y[i + 16] = d * (float)(qs[i] >> 4) + m;
    }
}
static void q5_0(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(((qs[i] & 15) | (int)(((qh >> i) & 1) << 4)) - 16);
        y[i + 16] = d * (float)(((qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4)) - 16);
    }
}
static void q5_1(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), m = qt_f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((qs[i] & 15) | (int)(((qh >> i) & 1) << 4)) + m;
        y[i + 16] = d * (float)((qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4)) + m;
    }
}
static void q8_0(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
}
static void iq4_nl(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    const uint8_t *qs = b + 2;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)KVALUES_IQ4[qs[i] & 15];
        y[i + 16] = d * (float)KVALUES_IQ4[qs[i] >> 4];
    }
}

/* Super-blocks of 256: element half * 128 + s * 32 + l takes bits 2s of byte half * 32 + l (2-bit
 * fields), in sub-block (of 16) half * 8 + 2s + l / 16. */
static void q2_k(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = qt_f16(b + 80), dmin = qt_f16(b + 82);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < 2; h++) {
                const int g = half * 8 + 2 * s + h;
                const float dl = d * (float)(sc[g] & 15), ml = dmin * (float)(sc[g] >> 4);
                const uint8_t *q = qs + half * 32 + 16 * h;
                float *out = y + half * 128 + s * 32 + 16 * h;
                for (int l = 0; l < 16; l++) out[l] = dl * (float)((q[l] >> (2 * s)) & 3) - ml;
            }
}
static void q3_k(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = qt_f16(b + 108);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < 2; h++) {
                const int g = half * 8 + 2 * s + h;
                const int lo = (sc[g % 8] >> (4 * (g / 8))) & 15, hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                const float dl = d * (float)((lo | (hi << 4)) - 32);
                const uint8_t *q = qs + half * 32 + 16 * h, *m = hm + 16 * h;
                const int bit = half * 4 + s;
                float *out = y + half * 128 + s * 32 + 16 * h;
                for (int l = 0; l < 16; l++)
                    out[l] = dl * (float)(((q[l] >> (2 * s)) & 3) - ((((m[l] >> bit) & 1) ^ 1) << 2));
            }
}
static void q4_k(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), dmin = qt_f16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        qt_scale_min_k4(b + 4, j, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t *qs = b + 16 + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) y[j * 32 + l] = ds * (float)((qs[l] >> shift) & 15) - dm;
    }
}
static void q5_k(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b), dmin = qt_f16(b + 2);
    const uint8_t *qh = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        qt_scale_min_k4(b + 4, j, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t *qs = b + 48 + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++)
            y[j * 32 + l] = ds * (float)(((qs[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4)) - dm;
    }
}
/* Q6_K: element half * 128 + s * 32 + l: low 4 bits from ql[half * 64 + (s % 2) * 32 + l] (nibble
 * s / 2), high 2 bits from qh[half * 32 + l] (bits 2s). */
static void q6_k(const uint8_t *restrict b, float *restrict y) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = qt_f16(b + 208);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < 2; h++) {
                const float dl = d * (float)sc[half * 8 + 2 * s + h];
                const uint8_t *ql = b + half * 64 + (s % 2) * 32 + 16 * h, *qh = b + 128 + half * 32 + 16 * h;
                float *out = y + half * 128 + s * 32 + 16 * h;
                for (int l = 0; l < 16; l++)
                    out[l] = dl * (float)((((ql[l] >> (4 * (s / 2))) & 15) | (((qh[l] >> (2 * s)) & 3) << 4)) - 32);
            }
}
static void iq4_xs(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_f16(b);
    const uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
    const uint8_t *sl = b + 4;
    for (int j = 0; j < 8; j++) {
        const int ls = (((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
        const float dl = d * (float)ls;
        const uint8_t *qs = b + 8 + j * 16;
        for (int i = 0; i < 16; i++) {
            y[j * 32 + i] = dl * (float)KVALUES_IQ4[qs[i] & 15];
            y[j * 32 + 16 + i] = dl * (float)KVALUES_IQ4[qs[i] >> 4];
        }
    }
}

#endif

/* MXFP4: an E8M0 scale byte, then 16 bytes of E2M1 codes (low nibbles the first 16 weights). */
static void mxfp4(const uint8_t *restrict b, float *restrict y) {
    const float d = qt_e8m0_half(b[0]);
    const uint8_t *qs = b + 1;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)KVALUES_MXFP4[qs[i] & 15];
        y[i + 16] = d * (float)KVALUES_MXFP4[qs[i] >> 4];
    }
}

/* Row of K weights, block by block: fn per block, the block's size and bytes from the type's traits. */
#define ROW(fn, type) \
    for (int64_t k = 0; k < K; k += qt_block(type), row += qt_bytes(type)) fn(row, out + k); \
    return;
void quant_dequant_row(const uint8_t *row, float *out, int64_t K, int64_t type) {
    switch (type) {
        case QT_Q4_0: ROW(q4_0, QT_Q4_0)
        case QT_Q4_1: ROW(q4_1, QT_Q4_1)
        case QT_Q5_0: ROW(q5_0, QT_Q5_0)
        case QT_Q5_1: ROW(q5_1, QT_Q5_1)
        case QT_Q8_0: ROW(q8_0, QT_Q8_0)
        case QT_Q2_K: ROW(q2_k, QT_Q2_K)
        case QT_Q3_K: ROW(q3_k, QT_Q3_K)
        case QT_Q4_K: ROW(q4_k, QT_Q4_K)
        case QT_Q5_K: ROW(q5_k, QT_Q5_K)
        case QT_Q6_K: ROW(q6_k, QT_Q6_K)
        case QT_IQ4_NL: ROW(iq4_nl, QT_IQ4_NL)
        case QT_IQ4_XS: ROW(iq4_xs, QT_IQ4_XS)
        case QT_MXFP4: ROW(mxfp4, QT_MXFP4)
        default: memset(out, 0, sizeof(float) * K);  /* unreachable: quant.py checks types at load */
    }
}

/* Row i of the table for quant.py's load-time check (ferry_kernels.h); returns the row count, and
 * fills nothing when i is past the end. */
int64_t quant_type_traits(int64_t i, ferry_qt_traits_t *out) {
    static const int64_t ids[] = {
#define FERRY_QT_ID(nm, id, ...) id,
        FERRY_QUANT_TYPES(FERRY_QT_ID)
#undef FERRY_QT_ID
    };
    const int64_t n = (int64_t)(sizeof(ids) / sizeof(ids[0]));
    if (i >= 0 && i < n) *out = *qt_traits(ids[i]);
    return n;
}
