/* q8 products with Q4_0 / Q4_1 weights packed by 16 rows (ferry.model.quant.pack_rows16), at every M.
 *
 * The file's layout keeps a row's blocks together, so a vector of levels holds 32 weights of ONE
 * row, and every product ends in sums across lanes (direct8's hadd tree) or a turned copy (the
 * tiles). Packed, dword n of a 64-byte line holds four weights of row n: the lanes are the rows, so
 * one broadcast of four activation bytes multiplies 16 (or 8) rows at once and everything after it
 * is lane by lane, with nothing turned at run time (llama.cpp packs its AMX build's weights so).
 * Layout, per group of 16 rows g and 32-block c, one record of 16 x the type's block bytes at
 * (g * K / 32 + c) * record:
 *     [64 * L + 4 * n + i], L < 4, i < 4: quant byte 4L + i of row n's block (low nibble weight
 *                                         4L + i, high nibble weight 16 + 4L + i)
 *     [256 + 2 * n]: row n's scale d (float16);  Q4_1: [288 + 2 * n]: its offset m.
 * Bytes are a permutation of the file's (the last group's missing rows zero), so resident size is
 * the file's. Levels are the nibbles (0..15): Q4_1's directly, Q4_0's as level + 8, the 8 times the
 * block's activation sum taken back from the exact integer sum. So each output follows
 * quant_q8_tiles.c's order, op for op: the same bits as the file layout's products.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_q8.h"
#include "quant_types.h"

#define R 4 /* activation rows per pass over a group: their accumulators stay in registers */

static inline int32_t dword_at(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void packed_portable(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N) {
    const int64_t nc = x->K / 32, RB = 16 * qt_bytes(type), groups = (N + 15) / 16;
    const int off = type == QT_Q4_1;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int n = 0; n < 16 && g * 16 + n < N; n++)
            for (int64_t m = 0; m < M; m++) {
                float acc = 0.f, o = 0.f;
                for (int64_t c = 0; c < nc; c++) {
                    const uint8_t *rec = w + (g * nc + c) * RB;
                    const int8_t *xq = x->q + m * x->K + 32 * c;
                    int32_t s = 0;
                    for (int k = 0; k < 16; k++) {
                        const uint8_t b = rec[64 * (k / 4) + 4 * n + k % 4];
                        s += (int32_t)(b & 15) * xq[k] + (int32_t)(b >> 4) * xq[k + 16];
                    }
                    if (!off) s -= 8 * x->bsum[m * x->nb + c];
                    const float t = qt_f16(rec + 256 + 2 * n) * x->dx[m * x->nb + c];
                    acc = fmaf((float)s, t, acc);
                    if (off) o = fmaf(qt_f16(rec + 288 + 2 * n), x->xsum[m * x->ng + c], o);
                }
                y[m * N + g * 16 + n] = off ? acc + o : acc;
            }
}

/* Weights stream from DRAM and the hardware prefetcher stops at each 4 KB page: ask for the group
 * two ahead, one record per block step, so its misses overlap the work. */
static inline void prefetch_record(const uint8_t *p, int64_t RB) {
    for (int64_t off = 0; off < RB; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T1);
}

/* Rows [m0, m0 + MR) of one group with 8 lanes (half h: rows 8h..8h+7 of the group): maddubs's
 * int16 pairs (at most 8 x 2 x 15 x 127 = 30,480) summed before one madd, or AVX-VNNI's dpbusd.
 * One activation row takes both halves in one pass (the group read once, in address order). */
#define PACKED8(name, isa, VNNI)                                                                                \
    __attribute__((target(isa), always_inline)) static inline void name##_of(                                   \
            const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x, float *y, int64_t m0, const int MR,     \
            int64_t N, int nr, const int OFF, const uint8_t *ahead) {                                            \
        const int64_t K = x->K;                                                                                \
        const int HS = MR == 1 ? 2 : 1;                                                                        \
        const __m256i low = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);                               \
        for (int h0 = 0; h0 < 2 && 8 * h0 < nr; h0 += HS) {                                                    \
            __m256 acc[2][R], o[2][R];                                                                         \
            for (int hh = 0; hh < HS; hh++)                                                                    \
                for (int r = 0; r < MR; r++) acc[hh][r] = o[hh][r] = _mm256_setzero_ps();                      \
            for (int64_t c = 0; c < nc; c++) {                                                                 \
                const uint8_t *rec = g0 + c * RB;                                                              \
                if (ahead && h0 == 0) prefetch_record(ahead + c * RB, RB);                                     \
                for (int hh = 0; hh < HS; hh++) {                                                              \
                    const int h = h0 + hh;                                                                     \
                    __m256i wl[4], wh[4];                                                                      \
                    for (int L = 0; L < 4; L++) {                                                              \
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * L + 32 * h));        \
                        wl[L] = _mm256_and_si256(v, low);                                                      \
                        wh[L] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                                \
                    }                                                                                          \
                    const __m256 A = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));  \
                    const __m256 B = OFF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h))) \
                                         : _mm256_setzero_ps();                                                \
                    for (int r = 0; r < MR; r++) {                                                             \
                        const int64_t m = m0 + r;                                                              \
                        const int8_t *xq = x->q + m * K + 32 * c;                                              \
                        __m256i s;                                                                             \
                        if (VNNI) {                                                                            \
                            s = _mm256_setzero_si256();                                                        \
                            for (int L = 0; L < 4; L++) {                                                      \
                                s = _mm256_dpbusd_avx_epi32(s, wl[L], _mm256_set1_epi32(dword_at(xq + 4 * L))); \
                                s = _mm256_dpbusd_avx_epi32(s, wh[L], _mm256_set1_epi32(dword_at(xq + 16 + 4 * L))); \
                            }                                                                                  \
                        } else {                                                                               \
                            __m256i s16 = _mm256_setzero_si256();                                              \
                            for (int L = 0; L < 4; L++) {                                                      \
                                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wl[L], _mm256_set1_epi32(dword_at(xq + 4 * L)))); \
                                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wh[L], _mm256_set1_epi32(dword_at(xq + 16 + 4 * L)))); \
                            }                                                                                  \
                            s = _mm256_madd_epi16(s16, ones16);                                                \
                        }                                                                                      \
                        if (!OFF) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * x->bsum[m * x->nb + c]));      \
                        const __m256 sc = _mm256_mul_ps(A, _mm256_set1_ps(x->dx[m * x->nb + c]));             \
                        acc[hh][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[hh][r]);                   \
                        if (OFF) o[hh][r] = _mm256_fmadd_ps(B, _mm256_set1_ps(x->xsum[m * x->ng + c]), o[hh][r]); \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            for (int hh = 0; hh < HS; hh++) {                                                                  \
                const int h = h0 + hh, cols = nr - 8 * h < 8 ? nr - 8 * h : 8;                                 \
                for (int r = 0; r < MR && cols > 0; r++) {                                                     \
                    float out[8];                                                                              \
                    _mm256_storeu_ps(out, OFF ? _mm256_add_ps(acc[hh][r], o[hh][r]) : acc[hh][r]);             \
                    memcpy(y + (m0 + r) * N + 8 * h, out, sizeof(float) * (size_t)cols);                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }
PACKED8(packed8_avx2, "avx2,fma,f16c", 0)
PACKED8(packed8_avxvnni, "avx2,fma,f16c,avxvnni", 1)

#define ISA_512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
/* The same with 16 lanes, a whole group per vector, and AVX-512 VNNI's dpbusd. */
__attribute__((target(ISA_512), always_inline)) static inline void packed16_of(
        const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x, float *y, int64_t m0, const int MR, int64_t N,
        int nr, const int OFF, const uint8_t *ahead) {
    const int64_t K = x->K;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[R], o[R];
    for (int r = 0; r < MR; r++) acc[r] = o[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *rec = g0 + c * RB;
        if (ahead) prefetch_record(ahead + c * RB, RB);
        __m512i wl[4], wh[4];
        for (int L = 0; L < 4; L++) {
            const __m512i v = _mm512_loadu_si512(rec + 64 * L);
            wl[L] = _mm512_and_si512(v, low);
            wh[L] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 A = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
        const __m512 B = OFF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288))) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const int64_t m = m0 + r;
            const int8_t *xq = x->q + m * K + 32 * c;
            __m512i s = _mm512_setzero_si512();
            for (int L = 0; L < 4; L++) {
                s = _mm512_dpbusd_epi32(s, wl[L], _mm512_set1_epi32(dword_at(xq + 4 * L)));
                s = _mm512_dpbusd_epi32(s, wh[L], _mm512_set1_epi32(dword_at(xq + 16 + 4 * L)));
            }
            if (!OFF) s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * x->bsum[m * x->nb + c]));
            const __m512 sc = _mm512_mul_ps(A, _mm512_set1_ps(x->dx[m * x->nb + c]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[r]);
            if (OFF) o[r] = _mm512_fmadd_ps(B, _mm512_set1_ps(x->xsum[m * x->ng + c]), o[r]);
        }
    }
    for (int r = 0; r < MR; r++)
        _mm512_mask_storeu_ps(y + (m0 + r) * N, (__mmask16)((1u << nr) - 1), OFF ? _mm512_add_ps(acc[r], o[r]) : acc[r]);
}

/* Each (rows, offset) pass compiled with both constant, so the loops unroll. */
#define PACKED_CASES(CALL)                                                           \
    switch (mr + 8 * off) {                                                          \
        case 1: CALL(1, 0); break; case 2: CALL(2, 0); break;                        \
        case 3: CALL(3, 0); break; case 4: CALL(4, 0); break;                        \
        case 9: CALL(1, 1); break; case 10: CALL(2, 1); break;                       \
        case 11: CALL(3, 1); break; default: CALL(4, 1); break;                      \
    }
#define PACKED_PASS(name, fn, isa)                                                                                \
    __attribute__((target(isa))) static void name(const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x,    \
                                                  float *y, int64_t m0, int mr, int64_t N, int nr, int off,       \
                                                  const uint8_t *ahead) {                                         \
        PACKED_CASES(fn##_CALL)                                                                                   \
    }
#define packed8_avx2_of_CALL(MR, OFF) packed8_avx2_of(g0, nc, RB, x, y, m0, MR, N, nr, OFF, ahead)
#define packed8_avxvnni_of_CALL(MR, OFF) packed8_avxvnni_of(g0, nc, RB, x, y, m0, MR, N, nr, OFF, ahead)
#define packed16_of_CALL(MR, OFF) packed16_of(g0, nc, RB, x, y, m0, MR, N, nr, OFF, ahead)
PACKED_PASS(packed_avx2, packed8_avx2_of, "avx2,fma,f16c")
PACKED_PASS(packed_avxvnni, packed8_avxvnni_of, "avx2,fma,f16c,avxvnni")
PACKED_PASS(packed_avx512vnni, packed16_of, ISA_512)

typedef void (*pass_fn)(const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x, float *y, int64_t m0, int mr,
                        int64_t N, int nr, int off, const uint8_t *ahead);

/* y[M, N] = x @ w^T for a packed Q4_0 / Q4_1 weight w; x quantized with xsum (Q4_1) or bsum (Q4_0). */
void q8_packed_gemm(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N, int64_t isa) {
    if (isa == ISA_PORTABLE) {
        packed_portable(w, type, x, y, M, N);
        return;
    }
    /* AVX-512BW without VNNI: the 8-lane maddubs pass (a 16-lane one is not measured to win). */
    static const pass_fn PASS[ISA_COUNT] = {NULL, packed_avx2, packed_avx2, packed_avxvnni, packed_avx512vnni};
    const pass_fn run = PASS[isa];
    const int64_t nc = x->K / 32, RB = 16 * qt_bytes(type), GB = nc * RB, groups = (N + 15) / 16;
    const int off = type == QT_Q4_1;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int nr = N - g * 16 < 16 ? (int)(N - g * 16) : 16;
        for (int64_t m0 = 0; m0 < M; m0 += R)
            run(w + g * GB, nc, RB, x, y + g * 16, m0, M - m0 < R ? (int)(M - m0) : R, N, nr, off,
                m0 == 0 && g + 2 < groups ? w + (g + 2) * GB : NULL);
    }
}
