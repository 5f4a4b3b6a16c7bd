/* The q8 products' front: the variant of the instruction set in use, picked at first use from the
 * CPU's features (quant_q8_isa overrides it); activations quantized per block of 32 to int8 (scale
 * amax / 127, rounded to nearest, as llama.cpp's q8_0); and quant_q8_gemm, which sends weights
 * packed by 16 rows (what a model's q8 weights are, every type: quant_q8_packed.c) to the packed
 * products, and weights in the file's layout (tests' references) to the portable products below.
 *
 * The portable products define every output's order, which each packed variant follows op for op,
 * so every variant returns their bits: each weight row unpacked to int8 levels q plus, per 16
 * weights, a float scale a and offset b (w = a * q + b: Q4_1's m, the K-quants' -dmin * min), then
 * over the scale groups g of its row (qt_group: 16 weights or 32), in order,
 *     acc = fmaf((float)isum_g, a_g * dx_g, acc)    isum_g: the group's levels times x's (exact)
 *     o   = fmaf(b_g, xsum_g, o)                    offset types; xsum_g = dx_g * (float)sum of x's
 * and y = acc + o (offset types) or acc. A row's outputs therefore never depend on the batch it
 * runs in. This file is built for plain x86-64-v2 with each variant's instructions enabled by
 * target attributes (the AVX2 variant holds no AVX-512 instruction), no fused or fast float math
 * outside the spelled-out fmaf.
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ferry_kernels.h"
#include "quant_types.h"
#include "quant_q8.h"

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

/* A K-quant or IQ4_XS super-block's per-16 scales a and offsets b from its float16 scales, already
 * converted: d (and dmin for Q4_K / Q5_K). */
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
        case QT_MXFP4: { /* IQ4_NL's layout with E2M1 levels (doubled) and a power-of-two scale */
            const uint8_t *qs = bl + 1;
            for (int i = 0; i < 16; i++) {
                q[i] = KVALUES_MXFP4[qs[i] & 15];
                q[i + 16] = KVALUES_MXFP4[qs[i] >> 4];
            }
            a[0] = a[1] = qt_e8m0_half(bl[0]);
            b[0] = b[1] = 0.f;
            return;
        }
        default: memset(q, 0, (size_t)qt_block(type)); /* unreachable: quant.py checks types at load */
    }
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
static void unpack_row(const uint8_t *bl, int64_t type, int64_t K, int8_t *q, float *a, float *b) {
    const int64_t block = qt_block(type), bytes = qt_bytes(type);
    for (int64_t k = 0; k < K; k += block, bl += bytes, q += block, a += block / 16, b += block / 16)
        unpack_block(bl, type, q, a, b);
}

/* M activation rows quantized (quant_q8.h). */
void q8_quantize_rows(const float *x, int64_t M, int64_t K, int gs, int portable, int want_u, int want_sum,
                      int bsum_gs, xrows_t *r) {
    r->K = K, r->nb = K / 32, r->ng = K / gs;
    r->q = ferry_alloc((size_t)(M * K), "q8 activation levels");
    r->u = ferry_alloc((size_t)(M * K), "q8 activation levels");
    r->dx = ferry_alloc(sizeof(float) * (size_t)(M * r->nb), "q8 activation scales");
    r->xsum = ferry_alloc(sizeof(float) * (size_t)(M * r->ng), "q8 activation sums");
    r->bsum = bsum_gs ? ferry_alloc(sizeof(int32_t) * (size_t)(M * (K / bsum_gs)), "q8 activation sums") : NULL;
    #pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        int8_t *q = r->q + m * K;
        (portable ? quant_q8_activations : quant_q8_activations_avx2)(x + m * K, K, q, r->dx + m * r->nb);
        if (want_u)
            for (int64_t k = 0; k < K; k++) r->u[m * K + k] = (uint8_t)(q[k] ^ 0x80);
        for (int64_t g = 0; want_sum && g < r->ng; g++) {
            int32_t s = 0;
            for (int i = 0; i < gs; i++) s += q[g * gs + i];
            r->xsum[m * r->ng + g] = r->dx[m * r->nb + g * gs / 32] * (float)s;
        }
        for (int64_t blk = 0; bsum_gs && blk < K / bsum_gs; blk++) {
            int32_t s = 0;
            for (int i = 0; i < bsum_gs; i++) s += q[blk * bsum_gs + i];
            r->bsum[m * (K / bsum_gs) + blk] = s;
        }
    }
}

void q8_free_rows(xrows_t *r) { free(r->q); free(r->u); free(r->dx); free(r->xsum); free(r->bsum); }

/* The order above, one weight row and one activation row at a time. */
void q8_rows_portable(const uint8_t *w, int64_t row_bytes, int64_t type, const xrows_t *x, float *y,
                      int64_t M, int64_t N) {
    const int64_t K = x->K, G16 = K / 16;
    const int gs = qt_group(type), offset = qt_offset(type);
    #pragma omp parallel
    {
        int8_t *q = ferry_alloc((size_t)K, "a weight row's levels");
        float *a = ferry_alloc(sizeof(float) * (size_t)G16, "a weight row's scales");
        float *b = ferry_alloc(sizeof(float) * (size_t)G16, "a weight row's offsets");
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            unpack_row(w + n * row_bytes, type, K, q, a, b);
            for (int64_t m = 0; m < M; m++) {
                const int8_t *xq = x->q + m * K;
                float acc = 0.f, o = 0.f;
                for (int64_t g = 0; g < x->ng; g++) {
                    int32_t s = 0;
                    for (int i = 0; i < gs; i++) s += (int32_t)q[g * gs + i] * xq[g * gs + i];
                    const float t = a[g * gs / 16] * x->dx[m * x->nb + g * gs / 32];
                    acc = fmaf((float)s, t, acc);
                    if (offset) o = fmaf(b[g * gs / 16], x->xsum[m * x->ng + g], o);
                }
                y[m * N + n] = offset ? acc + o : acc;
            }
        }
        free(q); free(a); free(b);
    }
}

/* y[M, N] = x[M, K] @ w[N, K]^T in q8 mode (quant_gemm's FERRY_QT_Q8 products, any M). */
void quant_q8_gemm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type) {
    const int64_t isa = quant_q8_isa(-2), packed = type & FERRY_QT_PACKED;
    type &= ~(int64_t)FERRY_QT_PACKED;
    if (M == 0 || (packed && q8_packed_index(type, NULL) < 0)) return; /* Python packs only the table's types */
    xrows_t xr;
    if (packed) {
        int want_u, want_sum, bsum_gs;
        q8_packed_needs(type, isa, &want_u, &want_sum, &bsum_gs);
        q8_quantize_rows(x, M, K, qt_group(type), isa == ISA_PORTABLE, want_u, want_sum, bsum_gs, &xr);
        q8_packed_gemm(w, type, &xr, y, M, N, isa);
    } else { /* the file's layout: the portable products, the reference the packed ones are held to */
        q8_quantize_rows(x, M, K, qt_group(type), isa == ISA_PORTABLE, 0, qt_offset(type), 0, &xr);
        q8_rows_portable(w, K / qt_block(type) * qt_bytes(type), type, &xr, y, M, N);
    }
    q8_free_rows(&xr);
}
