/* q8 products with 32-block weights packed by 16 rows (ferry.model.quant.pack_rows16), at every M:
 * Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.
 *
 * The file's layout keeps a row's blocks together, so a vector of levels holds 32 weights of ONE
 * row, and every product ends in sums across lanes (direct8's hadd tree) or a turned copy (the
 * tiles). Packed, dword n of a 64-byte line holds four weights of row n: the lanes are the rows, so
 * one broadcast of four activation bytes multiplies 16 (or 8) rows at once and everything after it
 * is lane by lane, with nothing turned at run time (llama.cpp packs its AMX build's weights so).
 * Layout, per group of 16 rows g and 32-block c, one record of 16 x the type's block bytes at
 * (g * K / 32 + c) * record; QB quant bytes per row's block (16, Q8_0 32):
 *     [64 * L + 4 * n + i], L < QB / 4, i < 4: quant byte 4L + i of row n's block
 *     then each of the block's other fields in the file's order, 16 rows side by side: d (float16,
 *     2 bytes a row), Q4_1 / Q5_1's m (2 bytes), Q5_0 / Q5_1's fifth bits qh (4 bytes a row).
 * Bytes are a permutation of the file's (the last group's missing rows zero), so resident size is
 * the file's. Levels: Q8_0's as they are; the nibbles (and fifth bits) as unsigned 0..15 (0..31),
 * Q4_0 / Q5_0's being level + 8 (+ 16) with the shift times the block's activation sum taken back
 * from the exact integer sum. So each output follows quant_q8_tiles.c's order, op for op: the same
 * bits as the file layout's products.
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

static inline int quant_bytes(int64_t t) { return t == QT_Q8_0 ? 32 : 16; }
static inline int has_m(int64_t t) { return t == QT_Q4_1 || t == QT_Q5_1; }
static inline int has_qh(int64_t t) { return t == QT_Q5_0 || t == QT_Q5_1; }
static inline int shift_of(int64_t t) { return t == QT_Q4_0 ? 8 : t == QT_Q5_0 ? 16 : 0; }
/* Record offsets of the 16 rows' d, m and qh. */
static inline int d_at(int64_t t) { return 16 * quant_bytes(t); }
static inline int m_at(int64_t t) { return d_at(t) + 32; }
static inline int qh_at(int64_t t) { return d_at(t) + 32 + 32 * has_m(t); }
/* Level vector j of a record (8 a record): the activations it multiplies start at this k. */
static inline int k_of(int64_t t, int j) { return t == QT_Q8_0 ? 4 * j : (j & 1) * 16 + 4 * (j >> 1); }

static void packed_portable(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N) {
    const int64_t nc = x->K / 32, RB = 16 * qt_bytes(type), groups = (N + 15) / 16;
    const int off = has_m(type), shift = shift_of(type);
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int n = 0; n < 16 && g * 16 + n < N; n++)
            for (int64_t m = 0; m < M; m++) {
                float acc = 0.f, o = 0.f;
                for (int64_t c = 0; c < nc; c++) {
                    const uint8_t *rec = w + (g * nc + c) * RB;
                    const int8_t *xq = x->q + m * x->K + 32 * c;
                    const uint32_t qh = has_qh(type) ? (uint32_t)dword_at(rec + qh_at(type) + 4 * n) : 0;
                    int32_t s = 0;
                    for (int k = 0; k < 32; k++) {
                        int32_t q;
                        if (type == QT_Q8_0) q = (int8_t)rec[64 * (k / 4) + 4 * n + k % 4];
                        else {
                            const uint8_t b = rec[64 * ((k % 16) / 4) + 4 * n + k % 4];
                            q = (k < 16 ? b & 15 : b >> 4) | (int32_t)(((qh >> k) & 1) << 4);
                        }
                        s += q * xq[k];
                    }
                    if (shift) s -= shift * x->bsum[m * x->nb + c];
                    const float t = qt_f16(rec + d_at(type) + 2 * n) * x->dx[m * x->nb + c];
                    acc = fmaf((float)s, t, acc);
                    if (off) o = fmaf(qt_f16(rec + m_at(type) + 2 * n), x->xsum[m * x->ng + c], o);
                }
                y[m * N + g * 16 + n] = off ? acc + o : acc;
            }
}

/* Weights stream from DRAM and the hardware prefetcher stops at each 4 KB page: ask for the group
 * two ahead, one record per block step, so its misses overlap the work. */
static inline void prefetch_record(const uint8_t *p, int64_t RB) {
    for (int64_t off = 0; off < RB; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T1);
}

/* The 8 level vectors of 8 lanes (rows 8h..8h+7) of a record: bytes 4i..4i+3 of lane n = levels
 * k_of(j) + i of row n. Q5's fifth bits: lane n's qh shifted so that its low byte (and byte 2)
 * holds the 4 bits of the line's low (high) nibbles, spread to bytes and tested. */
__attribute__((target("avx2"), always_inline)) static inline void levels8(const uint8_t *rec, const int64_t type, int h,
                                                                          __m256i *v) {
    const __m256i low = _mm256_set1_epi8(15);
    if (type == QT_Q8_0) {
        for (int L = 0; L < 8; L++) v[L] = _mm256_loadu_si256((const __m256i *)(rec + 64 * L + 32 * h));
        return;
    }
    const __m256i qh = has_qh(type) ? _mm256_loadu_si256((const __m256i *)(rec + qh_at(type) + 32 * h)) : _mm256_setzero_si256();
    const __m256i sel = _mm256_set1_epi32(0x08040201),
                  lo_idx = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                            8, 8, 8, 8, 12, 12, 12, 12),
                  hi_idx = _mm256_add_epi8(lo_idx, _mm256_set1_epi8(2)), sixteen = _mm256_set1_epi8(16);
    for (int L = 0; L < 4; L++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 64 * L + 32 * h));
        __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        if (has_qh(type)) {
            const __m256i t = _mm256_srli_epi32(qh, 4 * L);
            const __m256i tl = _mm256_and_si256(_mm256_shuffle_epi8(t, lo_idx), sel);
            const __m256i th = _mm256_and_si256(_mm256_shuffle_epi8(t, hi_idx), sel);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(tl, sel), sixteen));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(th, sel), sixteen));
        }
        v[2 * L] = lo;
        v[2 * L + 1] = hi;
    }
}

/* Rows [m0, m0 + MR) of one group with 8 lanes (half h: rows 8h..8h+7 of the group). maddubs's
 * int16 pairs are summed `flush` vectors at a time (as many as an int16 holds: 8 x 2 x 15 x 127
 * for 4-bit levels, 4 for 5-bit) before madd widens them; Q8_0 through |w| and x with w's sign.
 * AVX-VNNI's dpbusd takes Q8_0 against the activations plus 128, less 128 times the levels' sum.
 * One activation row takes both halves in one pass (the group read once, in address order). */
#define PACKED8(name, isa, VNNI)                                                                                \
    __attribute__((target(isa), always_inline)) static inline void name##_of(                                   \
            const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x, float *y, int64_t m0, const int MR,     \
            int64_t N, int nr, const int64_t T, const uint8_t *ahead) {                                          \
        const int64_t K = x->K;                                                                                \
        const int HS = MR == 1 ? 2 : 1, OFF = has_m(T), SHIFT = shift_of(T), FLUSH = has_qh(T) ? 4 : 8;        \
        const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);                              \
        for (int h0 = 0; h0 < 2 && 8 * h0 < nr; h0 += HS) {                                                    \
            __m256 acc[2][R], o[2][R];                                                                         \
            for (int hh = 0; hh < HS; hh++)                                                                    \
                for (int r = 0; r < MR; r++) acc[hh][r] = o[hh][r] = _mm256_setzero_ps();                      \
            for (int64_t c = 0; c < nc; c++) {                                                                 \
                const uint8_t *rec = g0 + c * RB;                                                              \
                if (ahead && h0 == 0) prefetch_record(ahead + c * RB, RB);                                     \
                for (int hh = 0; hh < HS; hh++) {                                                              \
                    const int h = h0 + hh;                                                                     \
                    __m256i v[8], w128 = _mm256_setzero_si256();                                               \
                    levels8(rec, T, h, v);                                                                     \
                    if (VNNI && T == QT_Q8_0) {                                                                \
                        for (int j = 0; j < 8; j++) w128 = _mm256_dpbusd_avx_epi32(w128, ones8, v[j]);         \
                        w128 = _mm256_slli_epi32(w128, 7);                                                     \
                    }                                                                                          \
                    const __m256 A = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_at(T) + 16 * h))); \
                    const __m256 B = OFF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + m_at(T) + 16 * h))) \
                                         : _mm256_setzero_ps();                                                \
                    for (int r = 0; r < MR; r++) {                                                             \
                        const int64_t m = m0 + r;                                                              \
                        const int8_t *xq = x->q + m * K + 32 * c;                                              \
                        __m256i s = _mm256_setzero_si256();                                                    \
                        if (VNNI && T == QT_Q8_0) {                                                            \
                            const uint8_t *xu = x->u + m * K + 32 * c;                                         \
                            for (int j = 0; j < 8; j++)                                                        \
                                s = _mm256_dpbusd_avx_epi32(s, _mm256_set1_epi32(dword_at(xu + 4 * j)), v[j]);  \
                            s = _mm256_sub_epi32(s, w128);                                                     \
                        } else if (VNNI) {                                                                     \
                            for (int j = 0; j < 8; j++)                                                        \
                                s = _mm256_dpbusd_avx_epi32(s, v[j], _mm256_set1_epi32(dword_at(xq + k_of(T, j)))); \
                        } else if (T == QT_Q8_0) {                                                             \
                            for (int j = 0; j < 8; j++) {                                                      \
                                const __m256i xb = _mm256_set1_epi32(dword_at(xq + 4 * j));                    \
                                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(                \
                                        _mm256_abs_epi8(v[j]), _mm256_sign_epi8(xb, v[j])), ones16));          \
                            }                                                                                  \
                        } else {                                                                               \
                            for (int j0 = 0; j0 < 8; j0 += FLUSH) {                                            \
                                __m256i s16 = _mm256_setzero_si256();                                          \
                                for (int j = j0; j < j0 + FLUSH; j++)                                          \
                                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(                          \
                                            v[j], _mm256_set1_epi32(dword_at(xq + k_of(T, j)))));              \
                                s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, ones16));                       \
                            }                                                                                  \
                        }                                                                                      \
                        if (SHIFT) s = _mm256_sub_epi32(s, _mm256_set1_epi32(SHIFT * x->bsum[m * x->nb + c])); \
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
/* levels8's 16 lanes: a whole group per vector; the fifth bits through byte masks. */
__attribute__((target(ISA_512), always_inline)) static inline void levels16(const uint8_t *rec, const int64_t type,
                                                                            __m512i *v) {
    if (type == QT_Q8_0) {
        for (int L = 0; L < 8; L++) v[L] = _mm512_loadu_si512(rec + 64 * L);
        return;
    }
    const __m512i low = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16), sel = _mm512_set1_epi32(0x08040201);
    const __m512i qh = has_qh(type) ? _mm512_loadu_si512(rec + qh_at(type)) : _mm512_setzero_si512();
    const __m512i lo_idx = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0x00000000),
                  hi_idx = _mm512_add_epi8(lo_idx, _mm512_set1_epi8(2));
    for (int L = 0; L < 4; L++) {
        const __m512i raw = _mm512_loadu_si512(rec + 64 * L);
        __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        if (has_qh(type)) {
            const __m512i t = _mm512_srli_epi32(qh, 4 * L);
            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(_mm512_shuffle_epi8(t, lo_idx), sel), sixteen));
            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(_mm512_shuffle_epi8(t, hi_idx), sel), sixteen));
        }
        v[2 * L] = lo;
        v[2 * L + 1] = hi;
    }
}

/* The 8-lane pass with 16 lanes and AVX-512 VNNI's dpbusd. */
__attribute__((target(ISA_512), always_inline)) static inline void packed16_of(
        const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x, float *y, int64_t m0, const int MR, int64_t N,
        int nr, const int64_t T, const uint8_t *ahead) {
    const int64_t K = x->K;
    const int OFF = has_m(T), SHIFT = shift_of(T);
    const __m512i ones8 = _mm512_set1_epi8(1);
    __m512 acc[R], o[R];
    for (int r = 0; r < MR; r++) acc[r] = o[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *rec = g0 + c * RB;
        if (ahead) prefetch_record(ahead + c * RB, RB);
        __m512i v[8], w128 = _mm512_setzero_si512();
        levels16(rec, T, v);
        if (T == QT_Q8_0) {
            for (int j = 0; j < 8; j++) w128 = _mm512_dpbusd_epi32(w128, ones8, v[j]);
            w128 = _mm512_slli_epi32(w128, 7);
        }
        const __m512 A = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + d_at(T))));
        const __m512 B = OFF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + m_at(T)))) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const int64_t m = m0 + r;
            __m512i s = _mm512_setzero_si512();
            if (T == QT_Q8_0) {
                const uint8_t *xu = x->u + m * K + 32 * c;
                for (int j = 0; j < 8; j++) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(dword_at(xu + 4 * j)), v[j]);
                s = _mm512_sub_epi32(s, w128);
            } else {
                const int8_t *xq = x->q + m * K + 32 * c;
                for (int j = 0; j < 8; j++) s = _mm512_dpbusd_epi32(s, v[j], _mm512_set1_epi32(dword_at(xq + k_of(T, j))));
            }
            if (SHIFT) s = _mm512_sub_epi32(s, _mm512_set1_epi32(SHIFT * x->bsum[m * x->nb + c]));
            const __m512 sc = _mm512_mul_ps(A, _mm512_set1_ps(x->dx[m * x->nb + c]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[r]);
            if (OFF) o[r] = _mm512_fmadd_ps(B, _mm512_set1_ps(x->xsum[m * x->ng + c]), o[r]);
        }
    }
    for (int r = 0; r < MR; r++)
        _mm512_mask_storeu_ps(y + (m0 + r) * N, (__mmask16)((1u << nr) - 1), OFF ? _mm512_add_ps(acc[r], o[r]) : acc[r]);
}

/* Each (rows, type) pass compiled with both constant, so the loops unroll and the type's branches fold. */
#define PACKED_ROWS(CALL, T)                                                                         \
    switch (mr) {                                                                                    \
        case 1: CALL(1, T); break; case 2: CALL(2, T); break; case 3: CALL(3, T); break;             \
        default: CALL(4, T); break;                                                                  \
    }
#define PACKED_CASES(CALL)                                                                           \
    switch (type) {                                                                                  \
        case QT_Q4_0: PACKED_ROWS(CALL, QT_Q4_0); break; case QT_Q4_1: PACKED_ROWS(CALL, QT_Q4_1); break; \
        case QT_Q5_0: PACKED_ROWS(CALL, QT_Q5_0); break; case QT_Q5_1: PACKED_ROWS(CALL, QT_Q5_1); break; \
        default: PACKED_ROWS(CALL, QT_Q8_0); break;                                                  \
    }
#define PACKED_PASS(name, fn, isa)                                                                                \
    __attribute__((target(isa))) static void name(const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x,    \
                                                  float *y, int64_t m0, int mr, int64_t N, int nr, int64_t type,  \
                                                  const uint8_t *ahead) {                                         \
        PACKED_CASES(fn##_CALL)                                                                                   \
    }
#define packed8_avx2_of_CALL(MR, T) packed8_avx2_of(g0, nc, RB, x, y, m0, MR, N, nr, T, ahead)
#define packed8_avxvnni_of_CALL(MR, T) packed8_avxvnni_of(g0, nc, RB, x, y, m0, MR, N, nr, T, ahead)
#define packed16_of_CALL(MR, T) packed16_of(g0, nc, RB, x, y, m0, MR, N, nr, T, ahead)
PACKED_PASS(packed_avx2, packed8_avx2_of, "avx2,fma,f16c")
PACKED_PASS(packed_avxvnni, packed8_avxvnni_of, "avx2,fma,f16c,avxvnni")
PACKED_PASS(packed_avx512vnni, packed16_of, ISA_512)

typedef void (*pass_fn)(const uint8_t *g0, int64_t nc, int64_t RB, const xrows_t *x, float *y, int64_t m0, int mr,
                        int64_t N, int nr, int64_t type, const uint8_t *ahead);

/* What q8_packed_gemm needs of the activations: want_u, want_sum, want_bsum of q8_quantize_rows. */
void q8_packed_needs(int64_t type, int64_t isa, int *want_u, int *want_sum, int *want_bsum) {
    *want_u = type == QT_Q8_0 && (isa == ISA_AVXVNNI || isa == ISA_AVX512VNNI);
    *want_sum = has_m(type);
    *want_bsum = shift_of(type) != 0;
}

/* y[M, N] = x @ w^T for a packed weight w, x quantized as q8_packed_needs says. */
void q8_packed_gemm(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N, int64_t isa) {
    if (isa == ISA_PORTABLE) {
        packed_portable(w, type, x, y, M, N);
        return;
    }
    /* AVX-512BW without VNNI: the 8-lane maddubs pass (a 16-lane one is not measured to win). */
    static const pass_fn PASS[ISA_COUNT] = {NULL, packed_avx2, packed_avx2, packed_avxvnni, packed_avx512vnni};
    const pass_fn run = PASS[isa];
    const int64_t nc = x->K / 32, RB = 16 * qt_bytes(type), GB = nc * RB, groups = (N + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int nr = N - g * 16 < 16 ? (int)(N - g * 16) : 16;
        for (int64_t m0 = 0; m0 < M; m0 += R)
            run(w + g * GB, nc, RB, x, y + g * 16, m0, M - m0 < R ? (int)(M - m0) : R, N, nr, type,
                m0 == 0 && g + 2 < groups ? w + (g + 2) * GB : NULL);
    }
}
