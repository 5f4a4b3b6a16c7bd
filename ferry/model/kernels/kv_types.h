/* The KV cache's element types (``--kv-cache-dtype``): float32, or 16 bits widened to float32 as
 * read and rounded to nearest even as written, as torch converts. One table for every kernel. */
#ifndef FERRY_KV_TYPES_H
#define FERRY_KV_TYPES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

typedef uint16_t vu16 __attribute__((vector_size(V * 2)));
typedef uint32_t vu32 __attribute__((vector_size(V * 4)));
typedef _Float16 vh __attribute__((vector_size(V * 2)));

static inline int64_t kv_size(int64_t kv) { return kv == KV_F32 ? 4 : 2; }

/* V values from element i of a row of type kv. */
static inline vf load_kv(const void *row, int64_t i, const int kv) {
    if (kv == KV_F32) return loadv((const float *)row + i);
    vu16 h;
    memcpy(&h, (const uint16_t *)row + i, sizeof h);
    if (kv == KV_BF16) {
        const vu32 w = __builtin_convertvector(h, vu32) << 16;
        vf x;
        memcpy(&x, &w, sizeof x);
        return x;
    }
    /* F16C's conversion: gcc turns a _Float16 vector's conversion into one per lane. */
#if defined(__AVX512F__)
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
#elif defined(__F16C__)
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
#else
    vh f;
    memcpy(&f, &h, sizeof f);
    const vf x = __builtin_convertvector(f, vf);
#endif
    vf out;
    memcpy(&out, &x, sizeof out);
    return out;
}

static inline float kv_at(const void *base, int64_t i, int64_t kv) {
    if (kv == KV_F32) return ((const float *)base)[i];
    const uint16_t h = ((const uint16_t *)base)[i];
    if (kv == KV_BF16) {
        const uint32_t w = (uint32_t)h << 16;
        float x;
        memcpy(&x, &w, sizeof x);
        return x;
    }
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}

/* n floats into a row of type kv (round to nearest even; NaN stays NaN). */
static inline void store_kv(void *dst, const float *src, int64_t n, int64_t kv) {
    if (kv == KV_F32) { memcpy(dst, src, sizeof(float) * n); return; }
    uint16_t *out = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) {
        if (kv == KV_F16) {
            const _Float16 f = (_Float16)src[i];
            memcpy(out + i, &f, 2);
            continue;
        }
        uint32_t w;
        memcpy(&w, src + i, 4);
        out[i] = (w & 0x7fffffff) > 0x7f800000 ? (uint16_t)((w >> 16) | 0x40)
                                                : (uint16_t)((w + 0x7fff + ((w >> 16) & 1)) >> 16);
    }
}
#endif
