/* Products with GGUF-quantized weights on the CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T.
 *
 * Activations stay float32: each weight is dequantized exactly as the gguf library does
 * (the same float32 operations in the same order), so the result is that of the float32
 * model, up to the order of the sums. The win is memory: a Q4_1 row is 24 bytes per 32
 * weights instead of 128, and one request's decode step is bound by streaming the weights.
 *
 * Weights are repacked at load time into rows of blocks of 32 with float32 scales (no
 * float16 conversion in the inner loop):
 *   Q4_0: {float d;          uint8 qs[16]}  w = (q - 8) * d        20 bytes
 *   Q4_1: {float d; float m; uint8 qs[16]}  w = q * d + m          24 bytes
 *   Q8_0: {float d;          int8  qs[32]}  w = q * d              36 bytes
 * where element i < 16 is the low nibble of qs[i] and element 16 + i its high nibble.
 *
 * Few rows (decodes): each block is dequantized in registers and multiplied with every input
 * row (up to MR rows). More rows: KR weight rows at a time are dequantized into a small buffer
 * that stays in L1, then the register-blocked float32 product of f32_rows.h runs over all input
 * rows. Threads split the weight rows
 * (OpenMP, torch's own runtime).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "f32_rows.h"
#include "vec.h"

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
#define QK 32

static inline int64_t block_bytes(int type) { return type == Q4_0 ? 20 : type == Q4_1 ? 24 : 36; }

/* V bytes as floats, unsigned or signed. Intrinsics: gcc's generic conversions of byte
 * vectors go lane by lane. */
static inline vf u8_to_f(const uint8_t *p, int high) {
#if V == 16
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    b = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
#else
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    b = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
#endif
}
static inline vf s8_to_f(const uint8_t *p) {
#if V == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}

/* Sub-vector s (of QK / V) of one block, dequantized. */
static inline __attribute__((always_inline)) vf dequant(const uint8_t *blk, int s, const int type) {
    float d;
    memcpy(&d, blk, 4);
    if (type == Q8_0) return s8_to_f(blk + 4 + s * V) * d;
    const uint8_t *qs = blk + (type == Q4_1 ? 8 : 4);
    const int half = s / (16 / V), part = s % (16 / V);
    const vf q = u8_to_f(qs + part * V, half);
    if (type == Q4_0) return (q - 8.f) * d;
    float m;
    memcpy(&m, blk + 4, 4);
    /* q * d is exact (4-bit q, float16 d), so whether the compiler fuses the add or not,
     * this is the gguf library's float32 q * d + m. */
    return q * d + m;
}

/* Rows [n0, n0 + nr) of y for input rows [m0, m0 + mr), dequantizing as it goes. */
#define NR 4
#define MR 4
static inline __attribute__((always_inline)) void fused_block(
        const float *x, const uint8_t *w, float *y, int64_t N, int64_t K, int64_t row_bytes,
        const int nr, const int mr, const int type) {
    vf acc[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < MR; j++) acc[r][j] = (vf){0};
    const int64_t bb = block_bytes(type);
    for (int64_t b = 0; b < K / QK; b++) {
        for (int s = 0; s < QK / V; s++) {
            vf xv[MR];
            for (int j = 0; j < mr; j++) xv[j] = loadv(x + j * K + b * QK + s * V);
            for (int r = 0; r < nr; r++) {
                const vf wv = dequant(w + r * row_bytes + b * bb, s, type);
                for (int j = 0; j < mr; j++) acc[r][j] += wv * xv[j];
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < mr; j++) y[j * N + r] = hsum(acc[r][j]);
}

static inline __attribute__((always_inline)) void fused_rows(
        const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
        int nb, const int type) {
    const int64_t row_bytes = K / QK * block_bytes(type);
    const uint8_t *wb = w + n0 * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mb = M - m0 < MR ? (int)(M - m0) : MR;
        const float *xb = x + m0 * K;
        float *yb = y + m0 * N + n0;
        if (nb == NR) {
            switch (mb) {
                case 4: fused_block(xb, wb, yb, N, K, row_bytes, NR, 4, type); break;
                case 3: fused_block(xb, wb, yb, N, K, row_bytes, NR, 3, type); break;
                case 2: fused_block(xb, wb, yb, N, K, row_bytes, NR, 2, type); break;
                default: fused_block(xb, wb, yb, N, K, row_bytes, NR, 1, type);
            }
        } else {
            fused_block(xb, wb, yb, N, K, row_bytes, nb, mb, type);
        }
    }
}

/* Rows [0, n) of a quantized matrix into float32 [n, K]. */
static inline __attribute__((always_inline)) void dequant_rows(const uint8_t *w, float *out, int64_t n,
                                                               int64_t K, const int type) {
    const int64_t bb = block_bytes(type);
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < K / QK; b++)
            for (int s = 0; s < QK / V; s++) {
                const vf v = dequant(w + (r * (K / QK) + b) * bb, s, type);
                memcpy(out + r * K + b * QK + s * V, &v, sizeof v);
            }
}

static inline __attribute__((always_inline)) void buffered_rows(
        const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
        int nb, float *wbuf, const int type) {
    const int64_t row_bytes = K / QK * block_bytes(type);
    dequant_rows(w + n0 * row_bytes, wbuf, nb, K, type);
    f32_rows(x, wbuf, y + n0, M, N, K, nb);
}

static inline __attribute__((always_inline)) void gemm_typed(const float *x, const uint8_t *w, float *y,
                                                             int64_t M, int64_t N, int64_t K, const int type) {
    if (M <= MR) {  /* dequantizing again per MR rows beats a trip through the buffer */
        #pragma omp parallel for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NR)
            fused_rows(x, w, y, M, N, K, n0, N - n0 < NR ? (int)(N - n0) : NR, type);
    } else {
        #pragma omp parallel
        {
            float wbuf[KR * K];
            #pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += KR)
                buffered_rows(x, w, y, M, N, K, n0, N - n0 < KR ? (int)(N - n0) : KR, wbuf, type);
        }
    }
}

/* y[M, N] = x[M, K] @ dequant(w)[N, K]^T; K % 32 == 0 (the caller checks). */
void quant_gemm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type) {
    switch (type) {
        case Q4_0: gemm_typed(x, w, y, M, N, K, Q4_0); break;
        case Q4_1: gemm_typed(x, w, y, M, N, K, Q4_1); break;
        default: gemm_typed(x, w, y, M, N, K, Q8_0);
    }
}

/* out[i, K] = dequant(w)[ids[i]] (all rows when ids is NULL, n = N): embeddings, and the
 * whole matrix for products with many rows, which BLAS does best. */
void quant_dequant(const uint8_t *w, const int64_t *ids, float *out, int64_t n, int64_t K, int64_t type) {
    const int64_t row_bytes = K / QK * block_bytes((int)type);
    #pragma omp parallel for schedule(static) if (n > 64)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + (ids ? ids[i] : i) * row_bytes;
        switch (type) {
            case Q4_0: dequant_rows(row, out + i * K, 1, K, Q4_0); break;
            case Q4_1: dequant_rows(row, out + i * K, 1, K, Q4_1); break;
            default: dequant_rows(row, out + i * K, 1, K, Q8_0);
        }
    }
}
