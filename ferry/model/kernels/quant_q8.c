/* q8 activation mode: y[M, N] = x[M, K] @ w[N, K]^T with x quantized per block of 32 to int8
 * (scale amax / 127, rounded to nearest, as llama.cpp's q8_0) and integer dot products.
 *
 * Each weight row is unpacked once into int8 levels q plus, per 16 weights, a float scale a and
 * offset b (w = a * q + b: Q4_1's m, the K-quants' -dmin * min), so one 16-group contributes
 * dx * (a * sum(q * qx) + b * sum(qx)). Only sum(q * qx) runs per instruction set: portable C,
 * AVX2 (maddubs + madd), AVX-512BW (the same on 64 bytes), AVX-VNNI / AVX-512-VNNI (dpbusd); they
 * give the same int32 sums, and the float combination is one shared scalar loop, so every variant
 * returns the portable one's bits. The variant is picked at first use from the CPU's features
 * (quant_q8_isa overrides it). This file is built for plain x86-64-v2 with each variant's
 * instructions enabled by target attributes, so the AVX2 variant holds no AVX-512 instruction.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_types.h"

/* s[g] = sum of the 16 products of group g, for n32 blocks of 32 (2 groups each). */
typedef void (*dots_fn)(const int8_t *w, const int8_t *x, int64_t n32, int32_t *s);

static void dots_portable(const int8_t *w, const int8_t *x, int64_t n32, int32_t *s) {
    for (int64_t g = 0; g < 2 * n32; g++) {
        int32_t acc = 0;
        for (int i = 0; i < 16; i++) acc += (int32_t)w[g * 16 + i] * x[g * 16 + i];
        s[g] = acc;
    }
}

/* 8 int32 (4 per 16-group) -> the two group sums. */
__attribute__((target("avx2"))) static inline void store_pairs(__m256i p, int32_t *s) {
    __m256i h = _mm256_hadd_epi32(p, p);
    h = _mm256_hadd_epi32(h, h);
    s[0] = _mm256_extract_epi32(h, 0);
    s[1] = _mm256_extract_epi32(h, 4);
}

/* maddubs multiplies unsigned by signed bytes: |w| times x with w's sign (at most 2 * 128 * 127
 * per int16 pair, no saturation). */
__attribute__((target("avx2"))) static void dots_avx2(const int8_t *w, const int8_t *x, int64_t n32, int32_t *s) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < n32; i++) {
        const __m256i vw = _mm256_loadu_si256((const __m256i *)(w + 32 * i));
        const __m256i vx = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(vw, vw), _mm256_sign_epi8(vx, vw));
        store_pairs(_mm256_madd_epi16(p, ones), s + 2 * i);
    }
}

__attribute__((target("avx512f,avx512bw"))) static void dots_avx512bw(const int8_t *w, const int8_t *x, int64_t n32,
                                                                       int32_t *s) {
    const __m512i ones = _mm512_set1_epi16(1);
    int64_t i = 0;
    for (; i + 2 <= n32; i += 2) {
        const __m512i vw = _mm512_loadu_si512(w + 32 * i), vx = _mm512_loadu_si512(x + 32 * i);
        const __m512i aw = _mm512_abs_epi8(vw);
        /* x with w's sign: negate where w < 0, zero where w == 0 */
        const __mmask64 neg = _mm512_movepi8_mask(vw), zero = _mm512_testn_epi8_mask(vw, vw);
        __m512i sx = _mm512_mask_sub_epi8(vx, neg, _mm512_setzero_si512(), vx);
        sx = _mm512_maskz_mov_epi8(~zero, sx);
        const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), ones);
        int32_t t[16];
        _mm512_storeu_si512(t, p);
        for (int g = 0; g < 4; g++) s[2 * i + g] = t[4 * g] + t[4 * g + 1] + t[4 * g + 2] + t[4 * g + 3];
    }
    if (i < n32) dots_portable(w + 32 * i, x + 32 * i, n32 - i, s + 2 * i);
}

/* dpbusd: 4 unsigned-by-signed byte products added into each int32, no saturation. */
__attribute__((target("avx2,avxvnni"))) static void dots_avxvnni(const int8_t *w, const int8_t *x, int64_t n32,
                                                                  int32_t *s) {
    for (int64_t i = 0; i < n32; i++) {
        const __m256i vw = _mm256_loadu_si256((const __m256i *)(w + 32 * i));
        const __m256i vx = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
        const __m256i p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(vw, vw),
                                                  _mm256_sign_epi8(vx, vw));
        store_pairs(p, s + 2 * i);
    }
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) static void dots_avx512vnni(
        const int8_t *w, const int8_t *x, int64_t n32, int32_t *s) {
    for (int64_t i = 0; i < n32; i++) {
        const __m256i vw = _mm256_loadu_si256((const __m256i *)(w + 32 * i));
        const __m256i vx = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(vw, vw),
                                              _mm256_sign_epi8(vx, vw));
        store_pairs(p, s + 2 * i);
    }
}

/* Variant ids, in the order quant_q8_isa names them. */
enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512BW, ISA_AVXVNNI, ISA_AVX512VNNI, ISA_COUNT };
static const dots_fn DOTS[ISA_COUNT] = {dots_portable, dots_avx2, dots_avx512bw, dots_avxvnni, dots_avx512vnni};

static int isa_supported(int64_t isa) {
    __builtin_cpu_init();
    switch (isa) {
        case ISA_PORTABLE: return 1;
        case ISA_AVX2: return __builtin_cpu_supports("avx2");
        case ISA_AVX512BW: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
        case ISA_AVXVNNI: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
        case ISA_AVX512VNNI:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni");
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
                if (j < 4) { sc = s[j] & 63; m = s[j + 4] & 63; }
                else { sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30); m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30); }
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

/* One row of K activations -> int8 q, a scale per 32 and the level sum per 16. */
void quant_q8_activations(const float *x, int64_t K, int8_t *q, float *d, int32_t *sums) {
    for (int64_t blk = 0; blk < K / 32; blk++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[blk * 32 + i]));
        const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
        d[blk] = dd;
        for (int h = 0; h < 2; h++) {
            int32_t s = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) {
                const int v = (int)roundf(x[blk * 32 + i] * id);
                q[blk * 32 + i] = (int8_t)v;
                s += v;
            }
            sums[2 * blk + h] = s;
        }
    }
}

void quant_gemm_q8(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type) {
    const dots_fn dots = DOTS[quant_q8_isa(-2)];
    const int64_t G = K / 16, block = qt_block(type), bytes = qt_bytes(type), row_bytes = K / block * bytes;
    int8_t *qx = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * K / 32));
    int32_t *sx = malloc(sizeof(int32_t) * (size_t)(M * G));
    #pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) quant_q8_activations(x + m * K, K, qx + m * K, dx + m * K / 32, sx + m * G);
    #pragma omp parallel
    {
        int8_t *qw = malloc((size_t)K);
        float *a = malloc(sizeof(float) * (size_t)G), *b = malloc(sizeof(float) * (size_t)G);
        int32_t *s = malloc(sizeof(int32_t) * (size_t)G);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = w + n * row_bytes;
            for (int64_t k = 0; k < K; k += block) unpack_block(row + k / block * bytes, type, qw + k, a + k / 16, b + k / 16);
            for (int64_t m = 0; m < M; m++) {
                dots(qw, qx + m * K, K / 32, s);
                const float *dm = dx + m * K / 32;
                const int32_t *sm = sx + m * G;
                float acc = 0.f;
                for (int64_t g = 0; g < G; g++) acc += dm[g / 2] * (a[g] * (float)s[g] + b[g] * (float)sm[g]);
                y[m * N + n] = acc;
            }
        }
        free(qw); free(a); free(b); free(s);
    }
    free(qx); free(dx); free(sx);
}
