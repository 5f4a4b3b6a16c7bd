/* The KV cache's element types (``--kv-cache-dtype``): float32, or 16 bits widened to float32 as
 * read and rounded to nearest even as written, as torch converts, or q8_0 (llama.cpp's: per 32
 * values a float16 scale and 32 int8 levels, 34 bytes; ferry/model/kv_format.py writes the same
 * bytes). One table for every kernel.
 * No _Float16: gcc before 12 has none on x86 (the kernels must still build there). */
#ifndef FERRY_KV_TYPES_H
#define FERRY_KV_TYPES_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant_types.h"
#include "vec.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_Q8_0 = 3 };

typedef uint16_t vu16 __attribute__((vector_size(V * 2)));
typedef uint32_t vu32 __attribute__((vector_size(V * 4)));

/* Bytes of n values (n a multiple of 32 for q8_0: every offset into a cache is, as head_dim is). */
static inline int64_t kv_bytes(int64_t n, int64_t kv) {
    return kv == KV_F32 ? 4 * n : kv == KV_Q8_0 ? n / 32 * 34 : 2 * n;
}

static inline float kv_at(const void *base, int64_t i, int64_t kv) {
    if (kv == KV_F32) return ((const float *)base)[i];
    if (kv == KV_Q8_0) {
        const uint8_t *b = (const uint8_t *)base + i / 32 * 34;
        return qt_f16(b) * (float)((const int8_t *)b)[2 + i % 32];
    }
    const uint16_t h = ((const uint16_t *)base)[i];
    if (kv == KV_F16) return qt_f16((const uint8_t *)&h);
    const uint32_t w = (uint32_t)h << 16;
    float x;
    memcpy(&x, &w, sizeof x);
    return x;
}

/* V values from element i of a row of type kv. */
static inline vf load_kv(const void *row, int64_t i, const int kv) {
    if (kv == KV_F32) return loadv((const float *)row + i);
    vf out;
    if (kv == KV_Q8_0) {  /* V <= 32 values, all in one block (i is a multiple of V) */
        const uint8_t *b = (const uint8_t *)row + i / 32 * 34;
        const int8_t *q = (const int8_t *)b + 2 + i % 32;
        /* Widened by intrinsics: gcc's convertvector from int8 lanes goes one lane at a time. */
#if defined(__AVX512F__) && V == 16
        const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        memcpy(&out, &x, sizeof out);
#elif defined(__AVX2__) && V == 8
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
        memcpy(&out, &x, sizeof out);
#else
        for (int j = 0; j < V; j++) out[j] = (float)q[j];
#endif
        return out * qt_f16(b);
    }
    if (kv == KV_BF16) {
        vu16 h;
        memcpy(&h, (const uint16_t *)row + i, sizeof h);
        const vu32 w = __builtin_convertvector(h, vu32) << 16;
        memcpy(&out, &w, sizeof out);
        return out;
    }
#if defined(__AVX512F__)
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    memcpy(&out, &x, sizeof out);
#elif defined(__F16C__) && V == 8
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    memcpy(&out, &x, sizeof out);
#else
    for (int j = 0; j < V; j++) out[j] = kv_at(row, i + j, KV_F16);
#endif
    return out;
}

/* A float as an IEEE half, rounded to nearest even (overflow to infinity, NaN stays NaN). */
static inline uint16_t kv_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t a = x & 0x7fffffff;
    if (a > 0x7f800000) return sign | 0x7e00;               /* NaN */
    if (a >= 0x477ff000) return sign | 0x7c00;              /* rounds past 65504: infinity */
    if (a < 0x38800000) {                                   /* below the smallest normal half */
        if (a < 0x33000000) return sign;                    /* under half the smallest subnormal */
        const uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - e;                     /* to units of 2^-24 */
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1))) h++;
        return sign | (uint16_t)h;
    }
    uint32_t h = ((a >> 13) - (112u << 10));                 /* rebias the exponent */
    const uint32_t rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;  /* a carry into the exponent is right */
    return sign | (uint16_t)h;
}

/* 32 floats as a q8_0 block: d = amax * (1 / 127) stored as float16, levels x * (1 / d) rounded
 * half away from zero (kv_format.quantize_q8_0 spells out the same operations). */
static inline void store_q8_0(uint8_t *dst, const float *x) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float d = amax * (1.0f / 127.0f), inv = d > 0.f ? 1.0f / d : 0.f;
    const uint16_t h = kv_half(d);
    memcpy(dst, &h, 2);
    for (int i = 0; i < 32; i++) {
        const float v = x[i] * inv, t = truncf(v);
        ((int8_t *)dst)[2 + i] = (int8_t)(t + (fabsf(v - t) >= 0.5f ? (v < 0.f ? -1.f : 1.f) : 0.f));
    }
}

/* n floats into a row of type kv (round to nearest even; NaN stays NaN; q8_0: n a multiple of 32). */
static inline void store_kv(void *dst, const float *src, int64_t n, int64_t kv) {
    if (kv == KV_F32) { memcpy(dst, src, sizeof(float) * n); return; }
    if (kv == KV_Q8_0) {
        for (int64_t i = 0; i < n; i += 32) store_q8_0((uint8_t *)dst + i / 32 * 34, src + i);
        return;
    }
    uint16_t *out = (uint16_t *)dst;
    int64_t i0 = 0;
#if defined(__F16C__)
    /* F16C rounds to nearest even as kv_half does (NaN stays a NaN): 8 at a time, not one by one. */
    if (kv == KV_F16)
        for (; i0 + 8 <= n; i0 += 8)
            _mm_storeu_si128((__m128i *)(out + i0),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i0), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (int64_t i = i0; i < n; i++) {
        if (kv == KV_F16) {
            out[i] = kv_half(src[i]);
            continue;
        }
        uint32_t w;
        memcpy(&w, src + i, 4);
        out[i] = (w & 0x7fffffff) > 0x7f800000 ? (uint16_t)((w >> 16) | 0x40)
                                                : (uint16_t)((w + 0x7fff + ((w >> 16) & 1)) >> 16);
    }
}
#endif
