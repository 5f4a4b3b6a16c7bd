/* q8 products at every number of rows: y[M, N] = x[M, K] @ w[N, K]^T with x quantized per block of
 * 32 to int8 (q8_quantize_row) and integer dot products, a vector lane per weight row, for weights
 * in the file's layout: a model's q8 weights are packed by 16 rows at load (quant_q8_packed.c, every
 * type), whose products these define and match bit for bit.
 *
 * TR weight rows (a tile: 8, or 16 with AVX-512 VNNI) are unpacked to int8 levels (q8_unpack_row) and
 * turned so that dword d of the tile holds levels 4d..4d+3 of each of its rows side by side. One
 * broadcast of four activation bytes then multiplies all TR rows at once (dpbusd, or maddubs +
 * madd), and everything after it (scales, offsets, sums) is lane by lane. So an output is made by
 * the same operations in the same order whatever M, N, the tile or the instruction set: over the
 * scale groups g of its row (16 weights for Q2_K, Q3_K and Q6_K, else 32), in order,
 *     acc = fmaf((float)isum_g, a_g * dx_g, acc)    isum_g: the group's levels times x's (exact)
 *     o   = fmaf(b_g, xsum_g, o)                    offset types; xsum_g = dx_g * (float)sum of x's
 * and y = acc + o (offset types) or acc. One activation row (a decode step of one request) of the
 * types q8_levels.h builds in registers (all but Q2_K and Q3_K) skips the tile: direct8 multiplies
 * 8 weight rows' levels straight from registers and sums each row's lanes into lane r, then takes
 * the same lane-wise steps. A row's outputs therefore never depend on the batch it runs in, and
 * every variant returns the portable code's bits. Built like quant_q8.c: plain x86-64-v2, each
 * variant's instructions enabled by target attributes, no fused or fast float math
 * outside the spelled-out fmaf.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q8_levels.h"
#include "quant_q8.h"
#include "quant_types.h"

static inline int group_size(int64_t type) { return type == QT_Q2_K || type == QT_Q3_K || type == QT_Q6_K ? 16 : 32; }

/* Four activation bytes of row m at k, as a dword (the broadcast's source). */
static inline int32_t dword_at(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* M activation rows quantized (quant_q8.h). */
void q8_quantize_rows(const float *x, int64_t M, int64_t K, int gs, int portable, int want_u, int want_sum,
                      int bsum_gs, xrows_t *r) {
    r->K = K, r->nb = K / 32, r->ng = K / gs;
    r->q = malloc((size_t)(M * K));
    r->u = malloc((size_t)(M * K));
    r->dx = malloc(sizeof(float) * (size_t)(M * r->nb));
    r->xsum = malloc(sizeof(float) * (size_t)(M * r->ng));
    r->bsum = bsum_gs ? malloc(sizeof(int32_t) * (size_t)(M * (K / bsum_gs))) : NULL;
    #pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        int8_t *q = r->q + m * K;
        q8_quantize_row(x + m * K, K, q, r->dx + m * r->nb, portable);
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
    const int gs = group_size(type);
    const int offset = q8_has_offset(type);
    #pragma omp parallel
    {
        int8_t *q = malloc((size_t)K);
        float *a = malloc(sizeof(float) * (size_t)G16), *b = malloc(sizeof(float) * (size_t)G16);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            q8_unpack_row(w + n * row_bytes, type, K, q, a, b, 1);
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

/* TR weight rows turned for the lanes: t[d * TR + r] = levels 4d..4d+3 of row r; a, b and w128
 * (128 times the levels' sum, for dpbusd's unsigned activations) per scale group g at g * TR + r. */
typedef struct {
    int32_t *t, *w128;
    float *a, *b;
} tile_t;

/* 8 x 8 dwords: out[j] lane i = in[i] lane j. */
__attribute__((target("avx2"), always_inline)) static inline void transpose8(__m256i *v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
        v[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
    }
}

/* The 32-block types' float16 d (and Q4_1 / Q5_1's m) of 8 rows' blocks at bl + i * row_bytes,
 * converted together (rows past nr: 0). */
__attribute__((target("avx2,f16c"), always_inline)) static inline void scales8(const uint8_t *bl, int64_t row_bytes, int nr,
                                                                             __m256 *a, __m256 *b) {
    /* built in registers: eight scalar stores then one vector load would stall store forwarding */
    int32_t d[8];
    for (int i = 0; i < 8; i++) d[i] = i < nr ? dword_at(bl + i * row_bytes) : 0;
    const __m256i v = _mm256_setr_epi32(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
    /* per 128-bit lane: the four low halves, then the four high ones */
    const __m256i s = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i q = _mm256_permute4x64_epi64(s, 0xD8); /* d0-3 d4-7 m0-3 m4-7 */
    *a = _mm256_cvtph_ps(_mm256_castsi256_si128(q));
    *b = _mm256_cvtph_ps(_mm256_extracti128_si256(q, 1));
}

/* Eight dwords at p + i * row_bytes (rows past nr: 0) in lanes, built in registers. */
__attribute__((target("avx2"), always_inline)) static inline __m256i dwords8(const uint8_t *p, int64_t row_bytes, int nr) {
    int32_t d[8];
    for (int i = 0; i < 8; i++) d[i] = i < nr ? dword_at(p + i * row_bytes) : 0;
    return _mm256_setr_epi32(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
}

/* k_scales of 8 rows' super-blocks at bl + i * row_bytes at once: A[g], B[g] lane i = row i's
 * a, b of 16-group g (rows past nr: 0). The same float operations as k_scales (one product of
 * the converted scale and the integer, or its negation), so the same bits. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void kscales8(
        const uint8_t *bl, int64_t row_bytes, int nr, const int64_t type, __m256 *A, __m256 *B) {
    const __m256i ff = _mm256_set1_epi32(0xff);
    if (type == QT_Q4_K || type == QT_Q5_K) {
        __m256 D, DMIN;
        scales8(bl, row_bytes, nr, &D, &DMIN);
        /* the 12 scale bytes of each row as 3 dwords; qt_scale_min_k4's bytes, 4 at a time */
        const __m256i u0 = dwords8(bl + 4, row_bytes, nr), u1 = dwords8(bl + 8, row_bytes, nr);
        const __m256i u2 = dwords8(bl + 12, row_bytes, nr);
        const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
        const __m256i sc[2] = {_mm256_and_si256(u0, m6),
                               _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), m30))};
        const __m256i mn[2] = {_mm256_and_si256(u1, m6),
                               _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi32(u1, 2), m30))};
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int j = 0; j < 8; j++) {
            const __m256 fs = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(sc[j / 4], 8 * (j % 4)), ff));
            const __m256 fm = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn[j / 4], 8 * (j % 4)), ff));
            A[2 * j] = A[2 * j + 1] = _mm256_mul_ps(D, fs);
            B[2 * j] = B[2 * j + 1] = _mm256_xor_ps(_mm256_mul_ps(DMIN, fm), sign);
        }
    } else if (type == QT_Q6_K) {
        uint16_t h[8];
        for (int i = 0; i < 8; i++) h[i] = i < nr ? (uint16_t)(bl[i * row_bytes + 208] | (bl[i * row_bytes + 209] << 8)) : 0;
        const __m256 D = _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3],
                                                        (short)h[4], (short)h[5], (short)h[6], (short)h[7]));
        for (int k = 0; k < 4; k++) {
            const __m256i w = dwords8(bl + 192 + 4 * k, row_bytes, nr);
            for (int b = 0; b < 4; b++) {
                const __m256i v = _mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * b), 24); /* int8 -> int32 */
                A[4 * k + b] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(v));
                B[4 * k + b] = _mm256_setzero_ps();
            }
        }
    } else { /* IQ4_XS: row by row */
        float a[8][16] = {{0}}, b[8][16] = {{0}};
        for (int i = 0; i < nr && i < 8; i++) block_scales_k(bl + i * row_bytes, type, a[i], b[i]);
        for (int g = 0; g < 16; g++) {
            A[g] = _mm256_setr_ps(a[0][g], a[1][g], a[2][g], a[3][g], a[4][g], a[5][g], a[6][g], a[7][g]);
            B[g] = _mm256_setr_ps(b[0][g], b[1][g], b[2][g], b[3][g], b[4][g], b[5][g], b[6][g], b[7][g]);
        }
    }
}

/* 8 rows' levels of 32-chunk C, v[i] row r0 + i, turned and stored into the tile. */
__attribute__((target("avx2"), always_inline)) static inline void turn8(__m256i *v, tile_t *t, int64_t C, int TR, int r0) {
    transpose8(v);
    for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(t->t + (C * 8 + j) * TR + r0), v[j]);
}

/* How many of the 8 rows from r0 are real (of nr). */
static inline int rows_from(int nr, int r0) { return nr - r0 < 0 ? 0 : nr - r0 < 8 ? nr - r0 : 8; }

/* Rows [0, nr) of w as a tile of TR (the rest zero). The types q8_levels.h builds: 8 rows' levels
 * of one 32-chunk in registers, turned there (8 x 8 dwords); the 32-block types' scales of 8 rows
 * converted together. Q2_K and Q3_K: each row unpacked into lev (unpack_block), then turned from L1. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void build_tile_of(
        const uint8_t *w, int64_t row_bytes, const int64_t type, int64_t K, int nr, int TR, int gs, int8_t *lev,
        float *ra, float *rb, tile_t *t) {
    const int64_t G16 = K / 16, nc = K / 32, bytes = qt_bytes(type);
    const int per_chunk = 32 / gs, step = gs / 16;
    if (fast32(type)) {
        const int off = q8_has_offset(type);
        for (int r0 = 0; r0 < TR; r0 += 8) {
            const uint8_t *rows = w + r0 * row_bytes;
            const int n8 = rows_from(nr, r0);
            for (int64_t c = 0; c < nc; c++) {
                __m256i v[8];
                float a, b;
                for (int i = 0; i < 8; i++)
                    v[i] = i < n8 ? levels32(rows + i * row_bytes + c * bytes, type, &a, &b) : _mm256_setzero_si256();
                turn8(v, t, c, TR, r0);
                __m256 A, B;
                scales8(rows + c * bytes, row_bytes, n8, &A, &B);
                _mm256_storeu_ps(t->a + c * TR + r0, A);
                _mm256_storeu_ps(t->b + c * TR + r0, off ? B : _mm256_setzero_ps());
            }
        }
        return;
    }
    if (fast_k(type)) {
        const int gpb = 256 / gs; /* scale groups per super-block */
        for (int r0 = 0; r0 < TR; r0 += 8) {
            const uint8_t *rows = w + r0 * row_bytes;
            const int n8 = rows_from(nr, r0);
            for (int64_t sb = 0; sb < nc / 8; sb++) {
                __m256 A[16], B[16];
                kscales8(rows + sb * bytes, row_bytes, n8, type, A, B);
                for (int g = 0; g < gpb; g++) {
                    _mm256_storeu_ps(t->a + (sb * gpb + g) * TR + r0, A[g * step]);
                    _mm256_storeu_ps(t->b + (sb * gpb + g) * TR + r0, B[g * step]);
                }
                for (int c = 0; c < 8; c++) {
                    __m256i v[8];
                    for (int i = 0; i < 8; i++)
                        v[i] = i < n8 ? levels_k(rows + i * row_bytes + sb * bytes, type, c) : _mm256_setzero_si256();
                    turn8(v, t, sb * 8 + c, TR, r0);
                }
            }
        }
        return;
    }
    for (int r = 0; r < TR; r++) {
        const uint8_t *row = w + r * row_bytes;
        float *a = ra + r * G16, *b = rb + r * G16;
        if (r >= nr) {
            memset(lev + r * K, 0, (size_t)K);
            memset(a, 0, sizeof(float) * (size_t)G16);
            memset(b, 0, sizeof(float) * (size_t)G16);
        } else {
            q8_unpack_row(row, type, K, lev + r * K, a, b, 0);
        }
        for (int64_t g = 0; g < nc * per_chunk; g++) {
            t->a[g * TR + r] = a[g * step];
            t->b[g * TR + r] = b[g * step];
        }
    }
    for (int r0 = 0; r0 < TR; r0 += 8)
        for (int64_t c = 0; c < nc; c++) {
            __m256i v[8];
            for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_si256((const __m256i *)(lev + (r0 + i) * K + 32 * c));
            turn8(v, t, c, TR, r0);
        }
}

/* build_tile_of with the type a constant, so the level builders' switches fold away; then, for
 * dpbusd on unsigned activations, 128 times each group's levels' sum. */
__attribute__((target("avx2,fma,f16c"))) static void build_tile(const uint8_t *w, int64_t row_bytes, int64_t type,
                                                              int64_t K, int nr, int TR, int gs, int sums, int8_t *lev,
                                                              float *ra, float *rb, tile_t *t) {
    const int64_t ng = K / gs;
    switch (type) {
#define BUILD_CASE(name, id, block, bytes) \
        case id: build_tile_of(w, row_bytes, id, K, nr, TR, gs, lev, ra, rb, t); break;
        FERRY_QUANT_TYPES(BUILD_CASE)
#undef BUILD_CASE
        default: return;
    }
    if (!sums) return;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < ng; g++)
        for (int r0 = 0; r0 < TR; r0 += 8) {
            __m256i s = _mm256_setzero_si256();
            for (int j = 0; j < gs / 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(t->t + (g * gs / 4 + j) * TR + r0));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16));
            }
            _mm256_storeu_si256((__m256i *)(t->w128 + g * TR + r0), _mm256_slli_epi32(s, 7));
        }
}

#define R 4 /* activation rows per pass over a tile's groups: their accumulators stay in registers */

/* The largest |level| of a type: how many maddubs results an int16 lane can add before madd. */
static int max_level(int64_t type) {
    switch (type) {
        case QT_Q8_0: case QT_IQ4_NL: case QT_IQ4_XS: return 128;
        case QT_Q5_1: case QT_Q5_K: case QT_Q6_K: return 32;
        default: return 16; /* Q4_0, Q4_1, Q4_K, Q5_0 (-16..15), Q2_K, Q3_K */
    }
}

/* Every (rows, group size, offset) a tile pass is compiled for: each count a constant, so the
 * loops unroll and the rows' accumulators stay in registers. */
#define TILE_CASES(BODY)                                                                         \
    switch (mr + 8 * offset + 16 * (gs == 16)) {                                                 \
        case 1: BODY(1, 32, 0); break; case 2: BODY(2, 32, 0); break;                            \
        case 3: BODY(3, 32, 0); break; case 4: BODY(4, 32, 0); break;                            \
        case 9: BODY(1, 32, 1); break; case 10: BODY(2, 32, 1); break;                           \
        case 11: BODY(3, 32, 1); break; case 12: BODY(4, 32, 1); break;                          \
        case 17: BODY(1, 16, 0); break; case 18: BODY(2, 16, 0); break;                          \
        case 19: BODY(3, 16, 0); break; case 20: BODY(4, 16, 0); break;                          \
        case 25: BODY(1, 16, 1); break; case 26: BODY(2, 16, 1); break;                          \
        case 27: BODY(3, 16, 1); break; default: BODY(4, 16, 1); break;                          \
    }

/* One tile's outputs for rows [m0, m0 + MR) with 8 lanes: offset types' levels are never negative,
 * so they are dpbusd's / maddubs's unsigned operand against the activations as they are; other
 * types take dpbusd on the activations plus 128 (less 128 times the levels' sum), or maddubs on
 * |w| and the activations with w's sign (at most 2 * 128 * 127 per int16 pair, no saturation).
 * maddubs's int16 pairs add up `flush` dwords at a time, as many as an int16 holds, before madd
 * widens them. Integer sums are exact, so they may run in two chains per row. */
#define TILE8(name, isa, VNNI, DPBUSD)                                                                          \
    __attribute__((target(isa), always_inline)) static inline void name##_of(                                   \
            const tile_t *t, const xrows_t *x, float *y, int64_t m0, const int MR, int64_t N, int nr,            \
            const int GS, const int OFF, int flush) {                                                           \
        const int64_t K = x->K;                                                                                \
        const int DPG = GS / 4;                                                                                \
        const __m256i ones16 = _mm256_set1_epi16(1);                                                           \
        __m256 acc[R], o[R];                                                                                   \
        for (int r = 0; r < MR; r++) acc[r] = o[r] = _mm256_setzero_ps();                                     \
        for (int64_t g = 0; g < x->ng; g++) {                                                                  \
            const int32_t *tg = t->t + g * DPG * 8;                                                            \
            __m256i s[R][2], s16[R];                                                                           \
            for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = s16[r] = _mm256_setzero_si256();                  \
            _Pragma("GCC unroll 8") for (int j = 0; j < DPG; j++) {                                            \
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(tg + j * 8));                          \
                const __m256i wa = _mm256_abs_epi8(wv);                                                        \
                for (int r = 0; r < MR; r++) {                                                                 \
                    const int64_t at = (m0 + r) * K + g * GS + 4 * j;                                          \
                    if (VNNI && OFF) {                                                                         \
                        s[r][j & 1] = DPBUSD(s[r][j & 1], wv, _mm256_set1_epi32(dword_at(x->q + at)));         \
                    } else if (VNNI) {                                                                         \
                        s[r][j & 1] = DPBUSD(s[r][j & 1], _mm256_set1_epi32(dword_at(x->u + at)), wv);         \
                    } else {                                                                                   \
                        const __m256i xb = _mm256_set1_epi32(dword_at(x->q + at));                             \
                        s16[r] = _mm256_add_epi16(s16[r], OFF ? _mm256_maddubs_epi16(wv, xb)                   \
                                                              : _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xb, wv))); \
                        if ((j + 1) % flush == 0) {                                                            \
                            s[r][j & 1] = _mm256_add_epi32(s[r][j & 1], _mm256_madd_epi16(s16[r], ones16));    \
                            s16[r] = _mm256_setzero_si256();                                                   \
                        }                                                                                      \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            if (!VNNI && DPG % flush)                                                                          \
                for (int r = 0; r < MR; r++) s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(s16[r], ones16)); \
            const __m256 A = _mm256_loadu_ps(t->a + g * 8), B = _mm256_loadu_ps(t->b + g * 8);               \
            for (int r = 0; r < MR; r++) {                                                                     \
                const int64_t m = m0 + r;                                                                      \
                __m256i si = _mm256_add_epi32(s[r][0], s[r][1]);                                               \
                if (VNNI && !OFF) si = _mm256_sub_epi32(si, _mm256_loadu_si256((const __m256i *)(t->w128 + g * 8))); \
                const __m256 sc = _mm256_mul_ps(A, _mm256_set1_ps(x->dx[m * x->nb + g * GS / 32]));           \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), sc, acc[r]);                                  \
                if (OFF) o[r] = _mm256_fmadd_ps(B, _mm256_set1_ps(x->xsum[m * x->ng + g]), o[r]);             \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++) {                                                                         \
            float out[8];                                                                                      \
            _mm256_storeu_ps(out, OFF ? _mm256_add_ps(acc[r], o[r]) : acc[r]);                                 \
            memcpy(y + (m0 + r) * N, out, sizeof(float) * (size_t)nr);                                         \
        }                                                                                                      \
    }                                                                                                          \
    __attribute__((target(isa))) static void name(const tile_t *t, const xrows_t *x, float *y, int64_t m0,      \
                                                  int mr, int64_t N, int nr, int gs, int offset, int flush) {   \
        (void)flush;                                                                                           \
        TILE_CASES(name##_CALL)                                                                                \
    }
#define DPBUSD_AVXVNNI(s, a, b) _mm256_dpbusd_avx_epi32(s, a, b)
#define NO_DPBUSD(s, a, b) ((void)(a), (void)(b), (s))
#define tile8_avx2_CALL(MR, GS, OFF) tile8_avx2_of(t, x, y, m0, MR, N, nr, GS, OFF, flush)
#define tile8_avx512bw_CALL(MR, GS, OFF) tile8_avx512bw_of(t, x, y, m0, MR, N, nr, GS, OFF, flush)
#define tile8_avxvnni_CALL(MR, GS, OFF) tile8_avxvnni_of(t, x, y, m0, MR, N, nr, GS, OFF, flush)
TILE8(tile8_avx2, "avx2,fma,f16c", 0, NO_DPBUSD)
TILE8(tile8_avx512bw, "avx2,fma,f16c,avx512f,avx512bw,avx512vl", 0, NO_DPBUSD)
TILE8(tile8_avxvnni, "avx2,fma,f16c,avxvnni", 1, DPBUSD_AVXVNNI)

/* The same with 16 lanes and AVX-512 VNNI's dpbusd. */
#define ISA_512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
__attribute__((target(ISA_512), always_inline)) static inline void tile16_of(
        const tile_t *t, const xrows_t *x, float *y, int64_t m0, const int MR, int64_t N, int nr, const int GS,
        const int OFF) {
    const int64_t K = x->K;
    const int DPG = GS / 4;
    __m512 acc[R], o[R];
    for (int r = 0; r < MR; r++) acc[r] = o[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < x->ng; g++) {
        const int32_t *tg = t->t + g * DPG * 16;
        __m512i s[R][2];
        for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int j = 0; j < DPG; j++) {
            const __m512i wv = _mm512_loadu_si512(tg + j * 16);
            for (int r = 0; r < MR; r++) {
                const int64_t at = (m0 + r) * K + g * GS + 4 * j;
                if (OFF) s[r][j & 1] = _mm512_dpbusd_epi32(s[r][j & 1], wv, _mm512_set1_epi32(dword_at(x->q + at)));
                else s[r][j & 1] = _mm512_dpbusd_epi32(s[r][j & 1], _mm512_set1_epi32(dword_at(x->u + at)), wv);
            }
        }
        const __m512 A = _mm512_loadu_ps(t->a + g * 16), B = _mm512_loadu_ps(t->b + g * 16);
        for (int r = 0; r < MR; r++) {
            const int64_t m = m0 + r;
            __m512i si = _mm512_add_epi32(s[r][0], s[r][1]);
            if (!OFF) si = _mm512_sub_epi32(si, _mm512_loadu_si512(t->w128 + g * 16));
            const __m512 sc = _mm512_mul_ps(A, _mm512_set1_ps(x->dx[m * x->nb + g * GS / 32]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), sc, acc[r]);
            if (OFF) o[r] = _mm512_fmadd_ps(B, _mm512_set1_ps(x->xsum[m * x->ng + g]), o[r]);
        }
    }
    for (int r = 0; r < MR; r++)
        _mm512_mask_storeu_ps(y + (m0 + r) * N, (__mmask16)((1u << nr) - 1), OFF ? _mm512_add_ps(acc[r], o[r]) : acc[r]);
}
#define tile16_CALL(MR, GS, OFF) tile16_of(t, x, y, m0, MR, N, nr, GS, OFF)
__attribute__((target(ISA_512))) static void tile16_avx512vnni(const tile_t *t, const xrows_t *x, float *y, int64_t m0,
                                                             int mr, int64_t N, int nr, int gs, int offset, int flush) {
    (void)flush;
    TILE_CASES(tile16_CALL)
}

/* One activation row (a decode step of one request) needs no tile: 8 weight rows' levels are built
 * in registers from the file's blocks (q8_levels.h) and multiplied at once, and a tree of hadds
 * turns their 8 x 8 partial sums into one vector of the rows' group sums, lane r for row r; from
 * there the same lane-wise steps as a tile's, so the same bits. */
/* 8 vectors of eight int32 -> lane r = sum of v[r]'s lanes 0-3 (*lo: the first 16 weights) or 4-7 (*hi). */
__attribute__((target("avx2"), always_inline)) static inline void sum8(const __m256i *p, __m256i *lo, __m256i *hi) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i g0 = _mm256_hadd_epi32(h01, h23), g1 = _mm256_hadd_epi32(h45, h67);
    *lo = _mm256_permute2x128_si256(g0, g1, 0x20);
    *hi = _mm256_permute2x128_si256(g0, g1, 0x31);
}


/* The eight int32 sums of 4 products of 32 levels v by 32 activations x: signed levels through
 * their magnitudes and x with their signs, offset types' (never negative) as they are. */
#define P32S_MADDUBS(v, x) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v)), _mm256_set1_epi16(1))
#define P32U_MADDUBS(v, x) _mm256_madd_epi16(_mm256_maddubs_epi16(v, x), _mm256_set1_epi16(1))
#define P32S_AVXVNNI(v, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(v), _mm256_sign_epi8(x, v))
#define P32U_AVXVNNI(v, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), v, x)
#define P32S_AVX512VNNI(v, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(v), _mm256_sign_epi8(x, v))
#define P32U_AVX512VNNI(v, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), v, x)

#define SPAN 16 /* 32-chunks per pass of direct8 (a multiple of 8: whole K-quant super-blocks) */

/* Q4_0 and Q5_0 levels plus 8 and 16 (0..15, 0..31): never negative, so direct8 multiplies them as
 * the offset types' (no sign pair) and takes the shift times the block's activation sum back from
 * the integer sum, which is exact: the same isum, so the same bits. 0 for the other types. */
static inline int level_shift(int64_t type) { return type == QT_Q4_0 ? 8 : type == QT_Q5_0 ? 16 : 0; }
__attribute__((target("avx2"), always_inline)) static inline __m256i shifted_levels32(const uint8_t *bl, int64_t type) {
    return type == QT_Q4_0 ? nibbles(bl + 2, 0) : _mm256_or_si256(nibbles(bl + 6, 0), fifth_bits(bl + 2));
}
#define DIRECT8(name, isa, P32S, P32U)                                                                          \
    __attribute__((target(isa), always_inline)) static inline void name##_of(                                   \
            const uint8_t *w, int64_t row_bytes, const int64_t type, const xrows_t *x, float *y, int nr) {       \
        const int64_t nc = x->K / 32, bytes = qt_bytes(type);                                                   \
        const int GS = group_size(type), OFF = q8_has_offset(type), SHIFT = level_shift(type);                  \
        __m256 acc = _mm256_setzero_ps(), o = _mm256_setzero_ps();                                              \
        __m256 ka[16], kb[16];                                                                                  \
        float a8[8], b8[8];                                                                                     \
        for (int64_t c0 = 0; c0 < nc; c0 += SPAN) {                                                             \
            const int64_t ce = c0 + SPAN < nc ? c0 + SPAN : nc;                                                 \
            __m256i P[SPAN][8];                                                                                 \
            /* row by row over the span, so the weights are read in address order, which the hardware */   \
            /* prefetcher follows from DRAM (8 rows a chunk at a time it did not: 12% slower steps) */    \
            for (int i = 0; i < 8; i++)                                                                         \
                for (int64_t c = c0; c < ce; c++) {                                                             \
                    if (i >= nr) { P[c - c0][i] = _mm256_setzero_si256(); continue; }                           \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * c));                    \
                    const uint8_t *bl = w + i * row_bytes;                                                      \
                    if (SHIFT) { P[c - c0][i] = P32U(shifted_levels32(bl + c * bytes, type), xv); continue; }   \
                    const __m256i v = fast32(type) ? levels32(bl + c * bytes, type, &a8[i], &b8[i])             \
                                                   : levels_k(bl + (c / 8) * bytes, type, (int)(c % 8));        \
                    P[c - c0][i] = OFF ? P32U(v, xv) : P32S(v, xv);                                             \
                }                                                                                               \
            for (int64_t c = c0; c < ce; c++) {                                                                 \
                if (!fast32(type) && c % 8 == 0) kscales8(w + (c / 8) * bytes, row_bytes, nr, type, ka, kb);   \
                __m256i lo, hi;                                                                                 \
                sum8(P[c - c0], &lo, &hi);                                                                      \
                const __m256 d = _mm256_set1_ps(x->dx[c]);                                                      \
                if (fast32(type)) {                                                                             \
                    __m256 A, B;                                                                                \
                    scales8(w + c * bytes, row_bytes, nr, &A, &B);                                              \
                    __m256i is = _mm256_add_epi32(lo, hi);                                                      \
                    if (SHIFT) is = _mm256_sub_epi32(is, _mm256_set1_epi32(SHIFT * x->bsum[c]));                \
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(A, d), acc);                    \
                    if (OFF) o = _mm256_fmadd_ps(B, _mm256_set1_ps(x->xsum[c]), o);                             \
                } else if (GS == 32) {                                                                          \
                    const __m256 A = ka[2 * (c % 8)];                                          \
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_mul_ps(A, d), acc); \
                    if (OFF) o = _mm256_fmadd_ps(kb[2 * (c % 8)], _mm256_set1_ps(x->xsum[c]), o); \
                } else {                                                                                        \
                    for (int h = 0; h < 2; h++) {                                                               \
                        const __m256 A = ka[2 * (c % 8) + h];                                  \
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h ? hi : lo), _mm256_mul_ps(A, d), acc);       \
                        if (OFF) o = _mm256_fmadd_ps(kb[2 * (c % 8) + h],                        \
                                                     _mm256_set1_ps(x->xsum[2 * c + h]), o);                    \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        float out[8];                                                                                           \
        _mm256_storeu_ps(out, OFF ? _mm256_add_ps(acc, o) : acc);                                               \
        memcpy(y, out, sizeof(float) * (size_t)nr);                                                             \
    }                                                                                                           \
    __attribute__((target(isa))) static void name(const uint8_t *w, int64_t row_bytes, int64_t type,            \
                                                  const xrows_t *x, float *y, int nr) {                         \
        switch (type) {                                                                                         \
            case QT_Q4_0: name##_of(w, row_bytes, QT_Q4_0, x, y, nr); return;                                   \
            case QT_Q4_1: name##_of(w, row_bytes, QT_Q4_1, x, y, nr); return;                                   \
            case QT_Q5_0: name##_of(w, row_bytes, QT_Q5_0, x, y, nr); return;                                   \
            case QT_Q5_1: name##_of(w, row_bytes, QT_Q5_1, x, y, nr); return;                                   \
            case QT_Q8_0: name##_of(w, row_bytes, QT_Q8_0, x, y, nr); return;                                   \
            case QT_IQ4_NL: name##_of(w, row_bytes, QT_IQ4_NL, x, y, nr); return;                               \
            case QT_Q4_K: name##_of(w, row_bytes, QT_Q4_K, x, y, nr); return;                                   \
            case QT_Q5_K: name##_of(w, row_bytes, QT_Q5_K, x, y, nr); return;                                   \
            case QT_Q6_K: name##_of(w, row_bytes, QT_Q6_K, x, y, nr); return;                                   \
            case QT_IQ4_XS: name##_of(w, row_bytes, QT_IQ4_XS, x, y, nr); return;                               \
            default: return; /* the caller sends only these */                                                  \
        }                                                                                                       \
    }
DIRECT8(direct8_avx2, "avx2,fma,f16c", P32S_MADDUBS, P32U_MADDUBS)
DIRECT8(direct8_avx512bw, "avx2,fma,f16c,avx512f,avx512bw,avx512vl", P32S_MADDUBS, P32U_MADDUBS)
DIRECT8(direct8_avxvnni, "avx2,fma,f16c,avxvnni", P32S_AVXVNNI, P32U_AVXVNNI)
DIRECT8(direct8_avx512vnni, ISA_512, P32S_AVX512VNNI, P32U_AVX512VNNI)
typedef void (*direct_fn)(const uint8_t *w, int64_t row_bytes, int64_t type, const xrows_t *x, float *y, int nr);

typedef void (*tile_fn)(const tile_t *t, const xrows_t *x, float *y, int64_t m0, int mr, int64_t N, int nr, int gs,
                        int offset, int flush);

/* y[M, N] = x[M, K] @ w[N, K]^T in q8 mode (quant_gemm's FERRY_QT_Q8 products, any M). */
void quant_q8_gemm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type) {
    const int64_t any_isa = quant_q8_isa(-2), isa = any_isa == ISA_AMX ? ISA_AVX512VNNI : any_isa; /* AMX: packed only */
    if (type & FERRY_QT_PACKED) {
        type &= ~(int64_t)FERRY_QT_PACKED;
        if (M == 0 || q8_packed_index(type, NULL) < 0) return; /* Python packs only the table's types */
        xrows_t xr;
        int want_u, want_sum, bsum_gs;
        q8_packed_needs(type, any_isa, &want_u, &want_sum, &bsum_gs);
        q8_quantize_rows(x, M, K, group_size(type), isa == ISA_PORTABLE, want_u, want_sum, bsum_gs, &xr);
        q8_packed_gemm(w, type, &xr, y, M, N, any_isa);
        q8_free_rows(&xr);
        return;
    }
    const int gs = group_size(type), offset = q8_has_offset(type);
    const int64_t row_bytes = K / qt_block(type) * qt_bytes(type);
    if (M == 0) return;
    const int vnni = isa == ISA_AVXVNNI || isa == ISA_AVX512VNNI;
    xrows_t xr;
    q8_quantize_rows(x, M, K, gs, isa == ISA_PORTABLE, vnni && !offset, offset, M == 1 && level_shift(type) ? 32 : 0, &xr);
    if (isa == ISA_PORTABLE) {
        q8_rows_portable(w, row_bytes, type, &xr, y, M, N);
        q8_free_rows(&xr);
        return;
    }
    if (M == 1 && (fast32(type) || fast_k(type))) {
        static const direct_fn DIRECT[ISA_COUNT] = {NULL, direct8_avx2, direct8_avx512bw, direct8_avxvnni,
                                                    direct8_avx512vnni, NULL};
        const direct_fn run = DIRECT[isa];
        #pragma omp parallel for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 8) run(w + n0 * row_bytes, row_bytes, type, &xr, y + n0, N - n0 < 8 ? (int)(N - n0) : 8);
        q8_free_rows(&xr);
        return;
    }
    static const tile_fn TILES[ISA_COUNT] = {NULL, tile8_avx2, tile8_avx512bw, tile8_avxvnni, tile16_avx512vnni, NULL};
    const tile_fn run = TILES[isa];
    const int TR = isa == ISA_AVX512VNNI ? 16 : 8, sums = vnni && !offset;
    int flush = 32767 / (2 * 127 * max_level(type));
    if (flush > gs / 4) flush = gs / 4;
    const int64_t G16 = K / 16, ng = K / gs, tiles = (N + TR - 1) / TR;
    #pragma omp parallel
    {
        int8_t *lev = malloc((size_t)(TR * K));
        float *ra = malloc(sizeof(float) * (size_t)(TR * G16)), *rb = malloc(sizeof(float) * (size_t)(TR * G16));
        tile_t t = {malloc((size_t)(TR * K)), malloc(sizeof(int32_t) * (size_t)(TR * ng)),
                    malloc(sizeof(float) * (size_t)(TR * ng)), malloc(sizeof(float) * (size_t)(TR * ng))};
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) {
            const int64_t n0 = i * TR;
            const int nr = N - n0 < TR ? (int)(N - n0) : TR;
            build_tile(w + n0 * row_bytes, row_bytes, type, K, nr, TR, gs, sums, lev, ra, rb, &t);
            for (int64_t m0 = 0; m0 < M; m0 += R) run(&t, &xr, y + n0, m0, M - m0 < R ? (int)(M - m0) : R, N, nr, gs, offset, flush);
        }
        free(lev); free(ra); free(rb);
        free(t.t); free(t.w128); free(t.a); free(t.b);
    }
    q8_free_rows(&xr);
}
