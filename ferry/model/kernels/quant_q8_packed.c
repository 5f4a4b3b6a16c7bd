/* q8 products with weights packed by 16 rows (ferry.model.quant.pack_rows16), at every M: Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS and MXFP4.
 *
 * The file's layout keeps a row's blocks together, so a vector of levels holds 32 weights of ONE
 * row, and every product would end in sums across lanes or a turned copy of the levels. Packed,
 * dword n of a 64-byte line holds four weights of row n: the lanes are the rows, so one broadcast
 * of four activation bytes multiplies 16 (or 8) rows at once and everything after it is lane by
 * lane, with nothing turned at run time (llama.cpp packs its AMX build's weights so).
 * Layout (LAYOUTS below, the one definition; quant.py reads it through q8_packed_index): per group
 * of 16 rows g and block b, one record of 16 x the block's bytes at (g * blocks per row + b) * record:
 *     the block's quant byte ranges, each as lines of 64 bytes: [64 L + 4 n + i] = byte 4L + i of
 *     the range in row n's block;
 *     then each other field (scales, offsets, fifth bits, K-quants' packed scales as dwords) with
 *     the 16 rows side by side: [size * n + i] = byte i of the field in row n's block.
 * Bytes are a permutation of the file's (the last group's missing rows zero), so resident size is
 * the file's. Levels are the file's: Q8_0 / IQ4_NL / IQ4_XS's signed as they are, the others as unsigned
 * bits (Q4_0 / Q5_0 / Q3_K / Q6_K's being level + 8 / 16 / 4 / 32, the shift times the group's activation sum
 * taken back from the exact integer sum). So each output follows the portable products' order
 * (quant_q8.c), op for op: the same bits as the file layout's products.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_kernels.h"
#include "quant_q8.h"
#include "quant_types.h"

#define R 4 /* activation rows per pass over a group: their accumulators stay in registers */

/* Each packable type's quant byte ranges and other fields, as (offset, bytes) in the file's block. */
typedef struct {
    int64_t type;
    int nq, nf;
    int q[2][2], f[6][2];
} layout_t;
static const layout_t LAYOUTS[] = {
    {QT_Q4_0, 1, 1, {{2, 16}}, {{0, 2}}},
    {QT_Q4_1, 1, 2, {{4, 16}}, {{0, 2}, {2, 2}}},
    {QT_Q5_0, 1, 2, {{6, 16}}, {{0, 2}, {2, 4}}},
    {QT_Q5_1, 1, 3, {{8, 16}}, {{0, 2}, {2, 2}, {4, 4}}},
    {QT_Q8_0, 1, 1, {{2, 32}}, {{0, 2}}},
    {QT_IQ4_NL, 1, 1, {{2, 16}}, {{0, 2}}},
    /* K-quants: d, dmin, the 12 scale bytes as 3 dwords (qs, then Q5_K's fifth bits, as lines) */
    {QT_Q4_K, 1, 5, {{16, 128}}, {{0, 2}, {2, 2}, {4, 4}, {8, 4}, {12, 4}}},
    {QT_Q5_K, 2, 5, {{48, 128}, {16, 32}}, {{0, 2}, {2, 2}, {4, 4}, {8, 4}, {12, 4}}},
    {QT_Q6_K, 1, 5, {{0, 192}}, {{192, 4}, {196, 4}, {200, 4}, {204, 4}, {208, 2}}},
    /* Q2_K: the 16 scale bytes as 4 dwords, d, dmin; Q3_K: qs, hmask as lines, 12 scale bytes as 3 dwords, d */
    {QT_Q2_K, 1, 6, {{16, 64}}, {{0, 4}, {4, 4}, {8, 4}, {12, 4}, {80, 2}, {82, 2}}},
    {QT_Q3_K, 2, 4, {{32, 64}, {0, 32}}, {{96, 4}, {100, 4}, {104, 4}, {108, 2}}},
    /* IQ4_XS: d, the high scale bits (16 bits), the low ones (4 bytes) */
    {QT_IQ4_XS, 1, 3, {{8, 128}}, {{0, 2}, {2, 2}, {4, 4}}},
    /* MXFP4: IQ4_NL's nibbles, then the E8M0 scale bytes (mxfp4_levels8 and the others below) */
    {QT_MXFP4, 1, 1, {{1, 16}}, {{0, 1}}},
};
#define N_LAYOUTS (int)(sizeof(LAYOUTS) / sizeof(LAYOUTS[0]))

static const layout_t *layout_of(int64_t type) {
    for (int i = 0; i < N_LAYOUTS; i++)
        if (LAYOUTS[i].type == type) return &LAYOUTS[i];
    return NULL;
}

/* idx[n * bytes + j] = where byte j of row n's block sits in its record; -1 when type is not packed. */
int64_t q8_packed_index(int64_t type, int64_t *idx) {
    const layout_t *l = layout_of(type);
    if (!l) return -1;
    if (!idx) return 0; /* only asked whether type is packed */
    const int64_t b = qt_bytes(type);
    int64_t at = 0;
    for (int r = 0; r < l->nq; r++) {
        for (int n = 0; n < 16; n++)
            for (int j = 0; j < l->q[r][1]; j++) idx[n * b + l->q[r][0] + j] = at + 64 * (j / 4) + 4 * n + j % 4;
        at += 16 * l->q[r][1];
    }
    for (int f = 0; f < l->nf; f++) {
        for (int n = 0; n < 16; n++)
            for (int j = 0; j < l->f[f][1]; j++) idx[n * b + l->f[f][0] + j] = at + l->f[f][1] * n + j;
        at += 16 * l->f[f][1];
    }
    return 0;
}

static inline int32_t dword_at(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Per type, constants the kernels fold (the type is a constant in every pass): the traits of
 * quant_types.h (qt_k, qt_offset: a min per block, qt_signed: levels stored signed, qt_shift: the
 * unsigned levels' shift, taken back as shift x the group's activation sum, qt_group), then the
 * packed record's own facts. Blocks of 32 per record: */
static inline int chunks_of(int64_t t) { return qt_k(t) ? 8 : 1; }
static inline int iq4(int64_t t) { return t == QT_IQ4_NL || t == QT_IQ4_XS; }
static inline int has_qh(int64_t t) { return t == QT_Q5_0 || t == QT_Q5_1; }
/* A 32-chunk's levels as 16 bytes of nibbles, the low ones first (not the K-quants' order). */
static inline int nibble_pairs(int64_t t) {
    return t == QT_Q4_0 || t == QT_Q4_1 || has_qh(t) || iq4(t) || t == QT_MXFP4;
}
static inline int lines_bytes(int64_t t) {
    switch (t) {
        case QT_Q8_0: return 512;
        case QT_Q2_K: return 1024;
        case QT_Q3_K: return 1536;
        case QT_Q4_K: return 2048;
        case QT_Q5_K: return 2560;
        case QT_Q6_K: return 3072;
        case QT_IQ4_XS: return 2048;
        default: return 256;
    }
}
/* Q2_K, Q3_K and Q6_K keep the file's order: scale dwords, then d (and Q2_K's dmin). */
static inline int scales_first(int64_t t) { return t == QT_Q2_K || t == QT_Q3_K || t == QT_Q6_K; }
static inline int d_at(int64_t t) { return lines_bytes(t) + (t == QT_Q3_K ? 192 : scales_first(t) ? 256 : 0); }
static inline int m_at(int64_t t) { return d_at(t) + 32; } /* Q4_1 / Q5_1's m, K-quants' dmin */
static inline int qh_at(int64_t t) { return d_at(t) + 32 + 32 * qt_offset(t); }
static inline int u_at(int64_t t) { return scales_first(t) ? lines_bytes(t) : d_at(t) + 64; } /* K scale dwords */

/* The portable variant: the rows gathered back into the file's blocks, then quant_q8.c's
 * portable products (a reference path: the copy costs nothing that matters). */
static void packed_portable(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N) {
    const int64_t b = qt_bytes(type), bpr = x->K / qt_block(type), RB = 16 * b;
    int64_t idx[16 * 210]; /* 210: the largest block (Q6_K) */
    q8_packed_index(type, idx);
    uint8_t *rows = ferry_alloc((size_t)(N * bpr * b), "a packed weight's rows in the file's layout");
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t blk = 0; blk < bpr; blk++)
            for (int64_t j = 0; j < b; j++)
                rows[(n * bpr + blk) * b + j] = w[((n / 16) * bpr + blk) * RB + idx[(n % 16) * b + j]];
    q8_rows_portable(rows, bpr * b, type, x, y, M, N);
    free(rows);
}

/* Asks for bytes of weights from p into L2. __builtin_prefetch (locality 2: prefetcht1), not
 * _mm_prefetch: gcc 12 silently drops _mm_prefetch inlined from a plain function into the passes'
 * target functions (tests/test_kernel_prefetch.py checks the compiled code keeps them). */
static inline void prefetch_span(const uint8_t *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 2);
}

/* What a pass over record rec asks for while it streams a group from memory (ahead set: its first
 * pass of rows): for a K-quant, the next record in address order. A pass reads a K-quant record's
 * 2-3.4 KB out of address order (a chunk pair's nibble lines, Q5_K / Q6_K's high-bit lines between,
 * the scales after), which the hardware prefetcher does not follow. Zen 4, one row, 4096 x 4096
 * weights from DRAM, AVX-512 and AVX2 variants alike: Q4_K 13-30 -> 25-33 GB/s, Q5_K 10-17 ->
 * 24-34, Q6_K 9-15 -> 17-35. The 32-blocks' short records are read in order and the hardware
 * prefetcher follows them: asking for the group two ahead measured no faster (within 1.05x). */
static inline void prefetch_ahead(const uint8_t *rec, int64_t RB, int64_t T) {
    if (qt_k(T)) prefetch_span(rec + RB, RB);
}

#define ISA_512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"

/* MXFP4's records: IQ4_NL's lines of nibbles with the E2M1 levels (doubled, so integers: KVALUES_MXFP4),
 * then the 16 rows' E8M0 scale bytes at d_at, each qt_e8m0_half's power of two, 2^(e - 128) (subnormal
 * for e < 2). Its own functions, which levels16 / scales16 / levels8 / scales8 hand MXFP4 to. */
__attribute__((target(ISA_512), always_inline)) static inline void mxfp4_levels16(const uint8_t *rec, __m512i *v,
                                                                                  const int flip) {
    const __m512i low = _mm512_set1_epi8(15), f80 = _mm512_set1_epi8(flip ? (char)0x80 : 0);
    const __m512i tab = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVALUES_MXFP4)), f80);
    for (int L = 0; L < 4; L++) {
        const __m512i raw = _mm512_loadu_si512(rec + 64 * L);
        v[2 * L] = _mm512_shuffle_epi8(tab, _mm512_and_si512(raw, low));
        v[2 * L + 1] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
}

__attribute__((target(ISA_512), always_inline)) static inline __m512 mxfp4_scales16(const uint8_t *rec) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rec + d_at(QT_MXFP4))));
    const __m512i norm = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(norm, _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), sub));
}

__attribute__((target("avx2"), always_inline)) static inline void mxfp4_levels8(const uint8_t *rec, int h, __m256i *v) {
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_MXFP4));
    for (int L = 0; L < 4; L++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 32 * h + 64 * L));
        v[2 * L] = _mm256_shuffle_epi8(tab, _mm256_and_si256(raw, low));
        v[2 * L + 1] = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
    }
}

__attribute__((target("avx2"), always_inline)) static inline __m256 mxfp4_scales8(const uint8_t *rec, int h) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + d_at(QT_MXFP4) + 8 * h)));
    const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(norm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* The 8 level vectors of 32-block chunk c of a record with 16 lanes: bytes 4i..4i+3 of lane n are
 * levels k_at(T, j) + i of row n; with flip, signed levels plus 128 (their sign bits flipped). */
static inline int k_at(int64_t t, int j) { return nibble_pairs(t) ? (j & 1) * 16 + 4 * (j >> 1) : 4 * j; }

__attribute__((target(ISA_512), always_inline)) static inline void levels16(const uint8_t *rec, const int64_t T, int c,
                                                                            __m512i *v, const int flip) {
    const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1), three = _mm512_set1_epi8(3);
    const __m512i four = _mm512_set1_epi8(4);
    const __m512i f80 = _mm512_set1_epi8(flip ? (char)0x80 : 0); /* flip: signed levels' sign bits flipped */
    if (T == QT_MXFP4) {
        mxfp4_levels16(rec, v, flip);
    } else if (T == QT_Q8_0) {
        for (int L = 0; L < 8; L++) v[L] = _mm512_xor_si512(_mm512_loadu_si512(rec + 64 * L), f80);
    } else if (T == QT_Q2_K || T == QT_Q3_K) { /* element 128 (c / 4) + 32 (c % 4) + l: bits 2 (c % 4) of qs
                                                  byte 32 (c / 4) + l; Q3_K's third, bit c of hmask byte l */
        for (int L = 0; L < 8; L++) {
            const __m512i raw = _mm512_loadu_si512(rec + 64 * (8 * (c / 4) + L));
            v[L] = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * (c % 4)), three);
            if (T == QT_Q3_K) {
                const __m512i hm = _mm512_loadu_si512(rec + 1024 + 64 * L); /* bit c to bit 2 in one shift */
                const __m512i hb = c >= 2 ? _mm512_srli_epi16(hm, c - 2) : _mm512_slli_epi16(hm, 2 - c);
                v[L] = _mm512_or_si512(v[L], _mm512_and_si512(hb, four));
            }
        }
    } else if (T == QT_Q4_K || T == QT_Q5_K) { /* 32-byte pairs: chunk 2p's low nibbles, 2p + 1's high */
        for (int L = 0; L < 8; L++) {
            const __m512i raw = _mm512_loadu_si512(rec + 64 * (8 * (c / 2) + L));
            v[L] = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(raw, 4) : raw, low);
            if (T == QT_Q5_K) { /* bit c of qh byte l: element 32c + l's fifth bit */
                const __m512i qh = _mm512_loadu_si512(rec + 2048 + 64 * L);
                v[L] = _mm512_or_si512(v[L], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, c), one), 4));
            }
        }
    } else if (T == QT_Q6_K) { /* element half * 128 + s * 32 + l, as unpack_block */
        const int half = c / 4, s = c % 4;
        for (int L = 0; L < 8; L++) {
            const __m512i l = _mm512_loadu_si512(rec + 64 * (16 * half + 8 * (s % 2) + L));
            const __m512i h = _mm512_loadu_si512(rec + 64 * (32 + 8 * half + L));
            v[L] = _mm512_or_si512(_mm512_and_si512(s < 2 ? l : _mm512_srli_epi16(l, 4), low),
                                   _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * s), three), 4));
        }
    } else { /* 32-blocks of nibbles (IQ4_XS: chunk c's 4 lines): line L's low nibbles are weights 4L..,
              * its high ones 16 + 4L.. */
        if (T == QT_IQ4_XS) rec += 256 * c;
        const __m512i sixteen = _mm512_set1_epi8(16), sel = _mm512_set1_epi32(0x08040201);
        const __m512i qh = has_qh(T) ? _mm512_loadu_si512(rec + qh_at(T)) : _mm512_setzero_si512();
        const __m512i lo_idx = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0x00000000),
                      hi_idx = _mm512_add_epi8(lo_idx, _mm512_set1_epi8(2));
        const __m512i tab = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVALUES_IQ4)), f80);
        for (int L = 0; L < 4; L++) {
            const __m512i raw = _mm512_loadu_si512(rec + 64 * L);
            __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            if (has_qh(T)) { /* lane n's qh shifted: its byte 0 (2) holds the line's low (high) 4 bits */
                const __m512i t = _mm512_srli_epi32(qh, 4 * L);
                lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(_mm512_shuffle_epi8(t, lo_idx), sel), sixteen));
                hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(_mm512_shuffle_epi8(t, hi_idx), sel), sixteen));
            }
            if (iq4(T)) lo = _mm512_shuffle_epi8(tab, lo), hi = _mm512_shuffle_epi8(tab, hi);
            v[2 * L] = lo;
            v[2 * L + 1] = hi;
        }
    }
}

/* Chunk c's scales with 16 lanes: A[0] and the offset B[0] (A[1], B[1]: a 16-group type's second
 * group), as unpack_block / k_scales compute them. */
__attribute__((target(ISA_512), always_inline)) static inline void scales16(const uint8_t *rec, const int64_t T, int c,
                                                                            __m512 *A, __m512 *B) {
    if (T == QT_MXFP4) { /* before D: its scales are no float16 */
        A[0] = mxfp4_scales16(rec);
        return;
    }
    const __m512 D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + d_at(T))));
    const __m512i ff = _mm512_set1_epi32(0xff);
    if (T == QT_Q2_K) { /* scale bytes 2c, 2c + 1: d x (low nibble), -(dmin x high nibble) */
        const __m512i u = _mm512_loadu_si512(rec + u_at(T) + 64 * (c / 2));
        const __m512 DMIN = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + m_at(T))));
        for (int g = 0; g < 2; g++) {
            const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(u, 8 * (2 * (c % 2) + g)), ff);
            A[g] = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15))));
            B[g] = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(_mm512_mul_ps(DMIN, _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)))),
                    _mm512_set1_epi32((int)0x80000000)));
        }
    } else if (T == QT_Q3_K) { /* 6-bit scales 2c, 2c + 1: low nibbles of dword (c % 4) / 2, high pairs of dword 2 */
        const __m512i lw = _mm512_loadu_si512(rec + u_at(T) + 64 * ((c % 4) / 2)), u2 = _mm512_loadu_si512(rec + u_at(T) + 128);
        const __m512i sc = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(lw, 4 * (c / 4)), _mm512_set1_epi8(15)),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u2, 2 * (c / 2)), _mm512_set1_epi8(3)), 4));
        for (int g = 0; g < 2; g++)
            A[g] = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_sub_epi32(
                    _mm512_and_si512(_mm512_srli_epi32(sc, 8 * (2 * (c % 2) + g)), ff), _mm512_set1_epi32(32))));
    } else if (T == QT_Q4_K || T == QT_Q5_K) {
        const __m512i u0 = _mm512_loadu_si512(rec + u_at(T)), u1 = _mm512_loadu_si512(rec + u_at(T) + 64),
                      u2 = _mm512_loadu_si512(rec + u_at(T) + 128);
        const __m512i m6 = _mm512_set1_epi8(63), m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
        const __m512i sc = c < 4 ? _mm512_and_si512(u0, m6)
                                 : _mm512_or_si512(_mm512_and_si512(u2, m4), _mm512_and_si512(_mm512_srli_epi32(u0, 2), m30));
        const __m512i mn = c < 4 ? _mm512_and_si512(u1, m6)
                                 : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4),
                                                   _mm512_and_si512(_mm512_srli_epi32(u1, 2), m30));
        const __m512 fs = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(sc, 8 * (c % 4)), ff));
        const __m512 fm = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(mn, 8 * (c % 4)), ff));
        const __m512 DMIN = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + m_at(T))));
        A[0] = _mm512_mul_ps(D, fs);
        B[0] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(DMIN, fm)), _mm512_set1_epi32((int)0x80000000)));
    } else if (T == QT_IQ4_XS) { /* 6-bit scale c - 32: nibble c of the low bytes, bits 2c of the high ones */
        const __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(rec + d_at(T) + 32)));
        const __m512i sl = _mm512_loadu_si512(rec + d_at(T) + 64);
        const __m512i ls = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(sl, 4 * c), _mm512_set1_epi32(15)),
                                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * c), _mm512_set1_epi32(3)), 4));
        A[0] = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
    } else if (T == QT_Q6_K) { /* the int8 scales of 16-groups 2c and 2c + 1 */
        const __m512i u = _mm512_loadu_si512(rec + u_at(T) + 64 * (c / 2));
        const int b0 = 2 * (c % 2);
        A[0] = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u, 24 - 8 * b0), 24)));
        A[1] = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u, 16 - 8 * b0), 24)));
    } else {
        A[0] = D;
        if (qt_offset(T)) B[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + m_at(T))));
    }
}

/* Rows [m0, m0 + MR) of one group with 16 lanes and AVX-512 VNNI's dpbusd: unsigned levels against
 * the activations; signed ones (Q8_0, IQ4_NL, IQ4_XS) with their sign bits flipped (the level plus
 * 128), less 128 times the activations' sum (one xor a vector where 128 times the levels' own sum
 * took 8 more dpbusd a chunk: that sum changes with every group, the activations' only per row). */
__attribute__((target(ISA_512), always_inline)) static inline void packed16_of(
        const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x, float *y, int64_t m0, const int MR, int64_t N,
        int nr, const int64_t T, const uint8_t *ahead, const uint8_t *lv) {
    const int64_t K = x->K;
    const int OFF = qt_offset(T), SH = qt_signed(T) ? 128 : qt_shift(T), CH = chunks_of(T), G2 = qt_group(T) == 16;
    __m512 acc[R], o[R];
    for (int r = 0; r < MR; r++) acc[r] = o[r] = _mm512_setzero_ps();
    for (int64_t e = 0; e < nrec; e++) {
        const uint8_t *rec = g0 + e * RB;
        if (ahead) prefetch_ahead(rec, RB, T);
        for (int c = 0; c < CH; c++) {
            const int64_t blk = e * CH + c;
            __m512i v[8];
            __m512 A[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, B[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
            if (lv)
                for (int L = 0; L < 8; L++) v[L] = _mm512_load_si512(lv + 64 * (8 * blk + L));
            else
                levels16(rec, T, c, v, 1); /* signed levels with sign bits flipped: plus 128, unsigned */
            scales16(rec, T, c, A, B);
            for (int r = 0; r < MR; r++) {
                const int64_t m = m0 + r;
                const int8_t *xq = x->q + m * K + 32 * blk;
                __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int j = 0; j < 8; j++) {
                    const int g = G2 && j >= 4;
                    s[g] = _mm512_dpbusd_epi32(s[g], v[j], _mm512_set1_epi32(dword_at(xq + k_at(T, j))));
                }
                const __m512 dx = _mm512_set1_ps(x->dx[m * x->nb + blk]);
                for (int g = 0; g <= G2; g++) {
                    __m512i si = s[g];
                    if (SH) si = _mm512_sub_epi32(si, _mm512_set1_epi32(SH * x->bsum[G2 ? m * (K / 16) + 2 * blk + g : m * x->nb + blk]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(A[g], dx), acc[r]);
                }
                for (int g = 0; OFF && g <= G2; g++)
                    o[r] = _mm512_fmadd_ps(B[g], _mm512_set1_ps(x->xsum[m * x->ng + (G2 ? 2 * blk + g : blk)]), o[r]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        _mm512_mask_storeu_ps(y + (m0 + r) * N, (__mmask16)((1u << nr) - 1), OFF ? _mm512_add_ps(acc[r], o[r]) : acc[r]);
}

/* levels16 with 8 lanes: rows 8h..8h+7 of the group. */
__attribute__((target("avx2"), always_inline)) static inline void levels8(const uint8_t *rec, const int64_t T, int c, int h,
                                                                          __m256i *v) {
    const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
    if (T == QT_MXFP4) {
        mxfp4_levels8(rec, h, v);
        return;
    }
    rec += 32 * h;
    if (T == QT_Q8_0) {
        for (int L = 0; L < 8; L++) v[L] = _mm256_loadu_si256((const __m256i *)(rec + 64 * L));
    } else if (T == QT_Q2_K || T == QT_Q3_K) {
        for (int L = 0; L < 8; L++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 64 * (8 * (c / 4) + L)));
            v[L] = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * (c % 4)), three);
            if (T == QT_Q3_K) {
                const __m256i hm = _mm256_loadu_si256((const __m256i *)(rec + 1024 + 64 * L));
                v[L] = _mm256_or_si256(v[L], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, c), one), 2));
            }
        }
    } else if (T == QT_Q4_K || T == QT_Q5_K) {
        for (int L = 0; L < 8; L++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 64 * (8 * (c / 2) + L)));
            v[L] = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(raw, 4) : raw, low);
            if (T == QT_Q5_K) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(rec + 2048 + 64 * L));
                v[L] = _mm256_or_si256(v[L], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, c), one), 4));
            }
        }
    } else if (T == QT_Q6_K) {
        const int half = c / 4, s = c % 4;
        for (int L = 0; L < 8; L++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *)(rec + 64 * (16 * half + 8 * (s % 2) + L)));
            const __m256i hq = _mm256_loadu_si256((const __m256i *)(rec + 64 * (32 + 8 * half + L)));
            v[L] = _mm256_or_si256(_mm256_and_si256(s < 2 ? l : _mm256_srli_epi16(l, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hq, 2 * s), three), 4));
        }
    } else {
        if (T == QT_IQ4_XS) rec += 256 * c;
        const __m256i sixteen = _mm256_set1_epi8(16), sel = _mm256_set1_epi32(0x08040201);
        const __m256i qh = has_qh(T) ? _mm256_loadu_si256((const __m256i *)(rec + qh_at(T))) : _mm256_setzero_si256();
        const __m256i lo_idx = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                                8, 8, 8, 8, 12, 12, 12, 12),
                      hi_idx = _mm256_add_epi8(lo_idx, _mm256_set1_epi8(2));
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4));
        for (int L = 0; L < 4; L++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 64 * L));
            __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            if (has_qh(T)) {
                const __m256i t = _mm256_srli_epi32(qh, 4 * L);
                const __m256i tl = _mm256_and_si256(_mm256_shuffle_epi8(t, lo_idx), sel);
                const __m256i th = _mm256_and_si256(_mm256_shuffle_epi8(t, hi_idx), sel);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(tl, sel), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(th, sel), sixteen));
            }
            if (iq4(T)) lo = _mm256_shuffle_epi8(tab, lo), hi = _mm256_shuffle_epi8(tab, hi);
            v[2 * L] = lo;
            v[2 * L + 1] = hi;
        }
    }
}

/* scales16 with 8 lanes. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void scales8(const uint8_t *rec, const int64_t T,
                                                                                   int c, int h, __m256 *A, __m256 *B) {
    if (T == QT_MXFP4) { /* before D: its scales are no float16 */
        A[0] = mxfp4_scales8(rec, h);
        return;
    }
    const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_at(T) + 16 * h)));
    const __m256i ff = _mm256_set1_epi32(0xff);
    if (T == QT_Q2_K) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(rec + u_at(T) + 64 * (c / 2) + 32 * h));
        const __m256 DMIN = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + m_at(T) + 16 * h)));
        for (int g = 0; g < 2; g++) {
            const __m256i sc = _mm256_and_si256(_mm256_srli_epi32(u, 8 * (2 * (c % 2) + g)), ff);
            A[g] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
            B[g] = _mm256_xor_ps(_mm256_mul_ps(DMIN, _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4))), _mm256_set1_ps(-0.f));
        }
    } else if (T == QT_Q3_K) {
        const uint8_t *u = rec + u_at(T) + 32 * h;
        const __m256i lw = _mm256_loadu_si256((const __m256i *)(u + 64 * ((c % 4) / 2)));
        const __m256i u2 = _mm256_loadu_si256((const __m256i *)(u + 128));
        const __m256i sc = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(lw, 4 * (c / 4)), _mm256_set1_epi8(15)),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u2, 2 * (c / 2)), _mm256_set1_epi8(3)), 4));
        for (int g = 0; g < 2; g++)
            A[g] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_sub_epi32(
                    _mm256_and_si256(_mm256_srli_epi32(sc, 8 * (2 * (c % 2) + g)), ff), _mm256_set1_epi32(32))));
    } else if (T == QT_Q4_K || T == QT_Q5_K) {
        const uint8_t *u = rec + u_at(T) + 32 * h;
        const __m256i u0 = _mm256_loadu_si256((const __m256i *)u), u1 = _mm256_loadu_si256((const __m256i *)(u + 64)),
                      u2 = _mm256_loadu_si256((const __m256i *)(u + 128));
        const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
        const __m256i sc = c < 4 ? _mm256_and_si256(u0, m6)
                                 : _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), m30));
        const __m256i mn = c < 4 ? _mm256_and_si256(u1, m6)
                                 : _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4),
                                                   _mm256_and_si256(_mm256_srli_epi32(u1, 2), m30));
        const __m256 fs = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(sc, 8 * (c % 4)), ff));
        const __m256 fm = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn, 8 * (c % 4)), ff));
        const __m256 DMIN = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + m_at(T) + 16 * h)));
        A[0] = _mm256_mul_ps(D, fs);
        B[0] = _mm256_xor_ps(_mm256_mul_ps(DMIN, fm), _mm256_set1_ps(-0.f));
    } else if (T == QT_IQ4_XS) {
        const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rec + d_at(T) + 32 + 16 * h)));
        const __m256i sl = _mm256_loadu_si256((const __m256i *)(rec + d_at(T) + 64 + 32 * h));
        const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(sl, 4 * c), _mm256_set1_epi32(15)),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(sh, 2 * c), _mm256_set1_epi32(3)), 4));
        A[0] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
    } else if (T == QT_Q6_K) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(rec + u_at(T) + 64 * (c / 2) + 32 * h));
        const int b0 = 2 * (c % 2);
        A[0] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u, 24 - 8 * b0), 24)));
        A[1] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u, 16 - 8 * b0), 24)));
    } else {
        A[0] = D;
        if (qt_offset(T)) B[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + m_at(T) + 16 * h)));
    }
}

/* The largest unsigned level of a type: how many maddubs results an int16 lane can add (two
 * products each, activations up to 127) before madd widens them; a 16-group's 4 at most, whose sum
 * stays its own. */
static inline int flush_of(int64_t t) {
    return t == QT_Q6_K ? 2 : t == QT_Q5_0 || t == QT_Q5_1 || t == QT_Q5_K || qt_group(t) == 16 ? 4 : 8;
}

/* packed16_of with 8 lanes: maddubs's int16 pairs, `flush` vectors at a time, then one madd;
 * signed levels through |w| and x with w's sign; or AVX-VNNI's dpbusd as packed16_of. One
 * activation row takes both halves in one pass (the group read once, in address order). */
#define PACKED8(name, isa, VNNI)                                                                                \
    __attribute__((target(isa), always_inline)) static inline void name##_of(                                   \
            const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x, float *y, int64_t m0, const int MR,   \
            int64_t N, int nr, const int64_t T, const uint8_t *ahead, const uint8_t *lv) {                       \
        const int64_t K = x->K;                                                                                \
        const int HS = MR == 1 ? 2 : 1, OFF = qt_offset(T), SH = qt_shift(T), CH = chunks_of(T), G2 = qt_group(T) == 16; \
        const int FL = flush_of(T);                                                                            \
        const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);                              \
        for (int h0 = 0; h0 < 2 && 8 * h0 < nr; h0 += HS) {                                                    \
            __m256 acc[2][R], o[2][R];                                                                         \
            for (int hh = 0; hh < HS; hh++)                                                                    \
                for (int r = 0; r < MR; r++) acc[hh][r] = o[hh][r] = _mm256_setzero_ps();                      \
            for (int64_t e = 0; e < nrec; e++) {                                                               \
                const uint8_t *rec = g0 + e * RB;                                                              \
                if (ahead && h0 == 0) prefetch_ahead(rec, RB, T);                                              \
                for (int c = 0; c < CH; c++)                                                                   \
                    for (int hh = 0; hh < HS; hh++) {                                                          \
                        const int h = h0 + hh;                                                                 \
                        const int64_t blk = e * CH + c;                                                        \
                        __m256i v[8], w128 = _mm256_setzero_si256();                                           \
                        const __m256 z = _mm256_setzero_ps();                                                  \
                        __m256 A[2] = {z, z}, B[2] = {z, z};                                                   \
                        if (lv)                                                                                \
                            for (int L = 0; L < 8; L++)                                                        \
                                v[L] = _mm256_load_si256((const __m256i *)(lv + 64 * (8 * blk + L) + 32 * h)); \
                        else                                                                                   \
                            levels8(rec, T, c, h, v);                                                          \
                        scales8(rec, T, c, h, A, B);                                                           \
                        if (VNNI && qt_signed(T)) {                                                        \
                            for (int j = 0; j < 8; j++) w128 = _mm256_dpbusd_avx_epi32(w128, ones8, v[j]);     \
                            w128 = _mm256_slli_epi32(w128, 7);                                                 \
                        }                                                                                      \
                        for (int r = 0; r < MR; r++) {                                                         \
                            const int64_t m = m0 + r;                                                          \
                            const int8_t *xq = x->q + m * K + 32 * blk;                                        \
                            const uint8_t *xu = x->u + m * K + 32 * blk;                                       \
                            __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, s16 = _mm256_setzero_si256();       \
                            for (int j = 0; j < 8; j++) {                                                      \
                                const int g = G2 && j >= 4;                                                    \
                                const __m256i xb = _mm256_set1_epi32(dword_at(xq + k_at(T, j)));               \
                                if (VNNI && qt_signed(T))                                                  \
                                    s[g] = _mm256_dpbusd_avx_epi32(s[g], _mm256_set1_epi32(dword_at(xu + k_at(T, j))), v[j]); \
                                else if (VNNI) s[g] = _mm256_dpbusd_avx_epi32(s[g], v[j], xb);                  \
                                else if (qt_signed(T))                                                     \
                                    s[g] = _mm256_add_epi32(s[g], _mm256_madd_epi16(_mm256_maddubs_epi16(      \
                                            _mm256_abs_epi8(v[j]), _mm256_sign_epi8(xb, v[j])), ones16));     \
                                else {                                                                         \
                                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[j], xb));               \
                                    if ((j + 1) % FL == 0) {                                                   \
                                        s[g] = _mm256_add_epi32(s[g], _mm256_madd_epi16(s16, ones16));         \
                                        s16 = _mm256_setzero_si256();                                          \
                                    }                                                                          \
                                }                                                                              \
                            }                                                                                  \
                            if (VNNI && qt_signed(T)) s[0] = _mm256_sub_epi32(s[0], w128);                 \
                            const __m256 dx = _mm256_set1_ps(x->dx[m * x->nb + blk]);                          \
                            for (int g = 0; g <= G2; g++) {                                                    \
                                __m256i si = s[g];                                                             \
                                if (SH) si = _mm256_sub_epi32(si, _mm256_set1_epi32(                           \
                                        SH * x->bsum[G2 ? m * (K / 16) + 2 * blk + g : m * x->nb + blk]));     \
                                acc[hh][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(A[g], dx), acc[hh][r]); \
                            }                                                                                  \
                            for (int g = 0; OFF && g <= G2; g++)                                               \
                                o[hh][r] = _mm256_fmadd_ps(B[g], _mm256_set1_ps(                               \
                                        x->xsum[m * x->ng + (G2 ? 2 * blk + g : blk)]), o[hh][r]);             \
                        }                                                                                      \
                    }                                                                                          \
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

/* Each (rows, type) pass compiled with both constant, so the loops unroll and the type's branches
 * fold: EACH(CALL, T) for the type at hand. */
#define TYPE_CASES(EACH, CALL)                                                                       \
    switch (type) {                                                                                  \
        case QT_Q4_0: EACH(CALL, QT_Q4_0); break; case QT_Q4_1: EACH(CALL, QT_Q4_1); break;          \
        case QT_Q5_0: EACH(CALL, QT_Q5_0); break; case QT_Q5_1: EACH(CALL, QT_Q5_1); break;          \
        case QT_Q8_0: EACH(CALL, QT_Q8_0); break; case QT_IQ4_NL: EACH(CALL, QT_IQ4_NL); break;      \
        case QT_Q2_K: EACH(CALL, QT_Q2_K); break; case QT_Q3_K: EACH(CALL, QT_Q3_K); break;          \
        case QT_Q4_K: EACH(CALL, QT_Q4_K); break; case QT_Q5_K: EACH(CALL, QT_Q5_K); break;          \
        case QT_IQ4_XS: EACH(CALL, QT_IQ4_XS); break; case QT_MXFP4: EACH(CALL, QT_MXFP4); break;    \
        default: EACH(CALL, QT_Q6_K); break;                                                         \
    }
/* The types whose levels q8_packed_gemm decodes once per chunk (costly_levels): the passes that
 * load decoded levels are compiled for these only. */
#define COSTLY_CASES(EACH, CALL)                                                                     \
    switch (type) {                                                                                  \
        case QT_Q5_0: EACH(CALL, QT_Q5_0); break; case QT_Q5_1: EACH(CALL, QT_Q5_1); break;          \
        case QT_Q3_K: EACH(CALL, QT_Q3_K); break; case QT_Q5_K: EACH(CALL, QT_Q5_K); break;          \
        default: EACH(CALL, QT_Q6_K); break;                                                         \
    }
/* Passes of 1-4 rows, or of 2-4 where one row has its own pass (below). */
#define ROWS_2_TO_4(CALL, T)                                                                         \
    switch (mr) {                                                                                    \
        case 2: CALL(2, T); break; case 3: CALL(3, T); break; default: CALL(4, T); break;            \
    }
#define ROWS_1_TO_4(CALL, T)                                                                         \
    switch (mr) {                                                                                    \
        case 1: CALL(1, T); break; default: ROWS_2_TO_4(CALL, T); break;                             \
    }
#define ONE_ROW(CALL, T) CALL(1, T)
#define PACKED_PASS(name, fn, isa, ROWS)                                                                          \
    __attribute__((target(isa))) static void name(const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x,  \
                                                  float *y, int64_t m0, int mr, int64_t N, int nr, int64_t type,  \
                                                  const uint8_t *ahead, const uint8_t *lv) {                      \
        if (lv) COSTLY_CASES(ROWS, fn##_CALL)                                                                     \
        else TYPE_CASES(ROWS, fn##_CALL0)                                                                         \
    }
/* _CALL0: without decoded levels, a NULL the compiler folds (a run-time test in the block loop
 * made the Q8_0 LM head's 16-row product 1.25x slower). */
#define packed8_avx2_of_CALL(MR, T) packed8_avx2_of(g0, nrec, RB, x, y, m0, MR, N, nr, T, ahead, lv)
#define packed8_avx2_of_CALL0(MR, T) packed8_avx2_of(g0, nrec, RB, x, y, m0, MR, N, nr, T, ahead, NULL)
#define packed8_avxvnni_of_CALL(MR, T) packed8_avxvnni_of(g0, nrec, RB, x, y, m0, MR, N, nr, T, ahead, lv)
#define packed8_avxvnni_of_CALL0(MR, T) packed8_avxvnni_of(g0, nrec, RB, x, y, m0, MR, N, nr, T, ahead, NULL)
#define packed16_of_CALL(MR, T) packed16_of(g0, nrec, RB, x, y, m0, MR, N, nr, T, ahead, lv)
#define packed16_of_CALL0(MR, T) packed16_of(g0, nrec, RB, x, y, m0, MR, N, nr, T, ahead, NULL)
PACKED_PASS(packed_avx2, packed8_avx2_of, "avx2,fma,f16c", ROWS_1_TO_4)
PACKED_PASS(packed_avxvnni, packed8_avxvnni_of, "avx2,fma,f16c,avxvnni", ROWS_1_TO_4)
PACKED_PASS(packed_avx512vnni, packed16_of, ISA_512, ROWS_2_TO_4)

/* Q6_K with one activation row on AVX2 (a decode step of one request: the LM head of most K-quant
 * files, and many files' qkv and down products, are Q6_K): packed8_avx2_of's products for MR = 1,
 * op for op (the same bits), written out. gcc kept that pass's chunk loop rolled for Q6_K, its
 * shifts by a register and its sums on the stack, so the product ran at 11-13 GB/s where the DRAM
 * read rate is 25-28 (Zen 3, 2 threads, the 248320 x 1024 LM head). */
#define ISA_256 "avx2,fma,f16c"
/* Level vector L of 32-chunk s of a 128-weight half (ql: its line of nibbles, s < 2 the low ones;
 * qh: its line of high bit pairs, bits 2s..2s+1 for chunk s), the pair moved to bits 4-5. */
__attribute__((target(ISA_256), always_inline)) static inline __m256i q6k_level(__m256i ql, __m256i qh, const int s) {
    const __m256i lo = s < 2 ? ql : _mm256_srli_epi16(ql, 4);
    const __m256i hi = s == 0 ? _mm256_slli_epi16(qh, 4) : s == 1 ? _mm256_slli_epi16(qh, 2)
                     : s == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(15)), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

/* Chunk c of record rec, lanes 8h..8h+7, into acc: each 16-group's exact sum (maddubs in pairs,
 * flush_of's 2), less 32 x the activations' sum, then scaled as packed8_avx2_of scales it. */
__attribute__((target(ISA_256), always_inline)) static inline __m256 q6k_chunk(const uint8_t *rec, const int h, const int c,
                                                                                 const int8_t *xq, const float *dx,
                                                                                 const int32_t *bs, __m256 D, __m256 acc) {
    const uint8_t *ql = rec + 32 * h + 64 * (16 * (c / 4) + 8 * (c % 2)), *qh = rec + 32 * h + 64 * (32 + 8 * (c / 4));
    __m256i S[2];
    #pragma GCC unroll 2
    for (int g = 0; g < 2; g++)
        #pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            __m256i s16 = _mm256_setzero_si256();
            #pragma GCC unroll 2
            for (int L = 4 * g + 2 * p; L < 4 * g + 2 * p + 2; L++) {
                const __m256i v = q6k_level(_mm256_loadu_si256((const __m256i *)(ql + 64 * L)),
                                            _mm256_loadu_si256((const __m256i *)(qh + 64 * L)), c % 4);
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v, _mm256_set1_epi32(dword_at(xq + 4 * L))));
            }
            const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
            S[g] = p ? _mm256_add_epi32(S[g], s32) : s32;
        }
    const __m256i u = _mm256_loadu_si256((const __m256i *)(rec + u_at(QT_Q6_K) + 64 * (c / 2) + 32 * h));
    const __m256 dxv = _mm256_set1_ps(*dx);
    #pragma GCC unroll 2
    for (int g = 0; g < 2; g++) {
        const __m256i si = _mm256_sub_epi32(S[g], _mm256_set1_epi32(32 * bs[g]));
        const int b = 2 * (c % 2) + g; /* the group's int8 scale: byte b of the lane's dword */
        const __m256 A = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u, 24 - 8 * b), 24)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(A, dxv), acc);
    }
    return acc;
}

/* One activation row over a Q6_K group (pass_fn's arguments, no decoded levels). Lanes 0-7 over the
 * whole group, then lanes 8-15 from L1 / L2: with both halves a chunk at a time, gcc kept the
 * activations' broadcasts for the second half on the stack. So that memory never idles while a
 * half computes, every record step asks for its share of the next group (half a record), rather
 * than the next record at once: Zen 3, 2 threads, from DRAM, the LM head 13-18 -> 21-27 GB/s
 * (this layout, then the prefetches), 6144 x 1024 14-18 -> 22-25. */
__attribute__((target(ISA_256))) static void q6k_one_avx2(const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x,
                                                         float *y, int64_t m0, int64_t N, int nr, const uint8_t *ahead) {
    const int64_t K = x->K;
    const int8_t *xq = x->q + m0 * K;
    const float *dx = x->dx + m0 * x->nb;
    const int32_t *bs = x->bsum + m0 * (K / 16);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < (nr > 8 ? 2 : 1); h++)
        for (int64_t e = 0; e < nrec; e++) {
            const uint8_t *rec = g0 + e * RB;
            if (ahead) prefetch_span(g0 + nrec * RB + (h * nrec + e) * (RB / 2), RB / 2);
            const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_at(QT_Q6_K) + 16 * h)));
            /* Written out: with a loop over the chunks (even one gcc was told to unroll) gcc kept it rolled. */
#define Q6K_CHUNK(c) acc[h] = q6k_chunk(rec, h, c, xq + 32 * (8 * e + c), dx + 8 * e + c, bs + 2 * (8 * e + c), D, acc[h])
            Q6K_CHUNK(0); Q6K_CHUNK(1); Q6K_CHUNK(2); Q6K_CHUNK(3); Q6K_CHUNK(4); Q6K_CHUNK(5); Q6K_CHUNK(6); Q6K_CHUNK(7);
#undef Q6K_CHUNK
        }
    for (int h = 0; h < 2 && 8 * h < nr; h++) {
        float out[8];
        _mm256_storeu_ps(out, acc[h]);
        memcpy(y + m0 * N + 8 * h, out, sizeof(float) * (size_t)(nr - 8 * h < 8 ? nr - 8 * h : 8));
    }
}

/* v, held in a register as it is: each row's running sum passes through it after every add, so gcc
 * cannot regroup a chunk's sums (all 8 x MR maddubs first, then the adds: its reassociation did so,
 * and the 32 products of 4 rows spilled to the stack with the rows' float sums). Integer adds
 * (wrapping), so any grouping gives the same bits. */
__attribute__((target(ISA_256), always_inline)) static inline __m256i keep256(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

/* Q4_K and Q6_K with 2-4 activation rows a pass on AVX2 (prompt chunks): packed8_avx2_of's products
 * for those rows, op for op (the same bits), with each level vector decoded (or loaded) once and
 * multiplied into every row before the next, so the sums of all rows stay in the 16 registers.
 * The generic pass kept all 8 level vectors live across its rows and spilled its sums, and gcc kept
 * its chunk loop rolled (shifts by a register). */
__attribute__((target(ISA_256), always_inline)) static inline void q4k_rows_chunk(const uint8_t *rec, const int h,
                                                                                   const int c, const xrows_t *x,
                                                                                   int64_t m0, const int MR, int64_t blk,
                                                                                   __m256 D, __m256 *acc) {
    const int64_t K = x->K;
    const uint8_t *q = rec + 32 * h + 64 * 8 * (c / 2);
    const int8_t *xq = x->q + m0 * K + 32 * blk;
    __m256i s16[R];
    for (int r = 0; r < MR; r++) s16[r] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int L = 0; L < 8; L++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * L));
        const __m256i v = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
        for (int r = 0; r < MR; r++)
            s16[r] = keep256(_mm256_add_epi16(s16[r], _mm256_maddubs_epi16(v, _mm256_set1_epi32(dword_at(xq + r * K + 4 * L)))));
    }
    const uint8_t *u = rec + u_at(QT_Q4_K) + 32 * h;
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)u), u2 = _mm256_loadu_si256((const __m256i *)(u + 128));
    const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), ff = _mm256_set1_epi32(0xff);
    const __m256i sc = c < 4 ? _mm256_and_si256(u0, m6)
                             : _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), m30));
    const __m256 fs = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(sc, 8 * (c % 4)), ff));
    const __m256 A = _mm256_mul_ps(D, fs);
    for (int r = 0; r < MR; r++) {
        const int64_t m = m0 + r;
        const __m256i s = _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(A, _mm256_set1_ps(x->dx[m * x->nb + blk])), acc[r]);
    }
}

/* Chunk c's mins term into o, MR rows: -(dmin * m) times each row's scaled sum of the chunk's
 * levels, in its own pass over the group (q4k_rows_of), so the level pass keeps its sums in registers. */
__attribute__((target(ISA_256), always_inline)) static inline void q4k_rows_mins(const uint8_t *rec, const int h,
                                                                                  const int c, const xrows_t *x,
                                                                                  int64_t m0, const int MR, int64_t blk,
                                                                                  __m256 DMIN, __m256 *o) {
    const uint8_t *u = rec + u_at(QT_Q4_K) + 32 * h;
    const __m256i u1 = _mm256_loadu_si256((const __m256i *)(u + 64)), u2 = _mm256_loadu_si256((const __m256i *)(u + 128));
    const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), ff = _mm256_set1_epi32(0xff);
    const __m256i mn = c < 4 ? _mm256_and_si256(u1, m6)
                             : _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi32(u1, 2), m30));
    const __m256 fm = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn, 8 * (c % 4)), ff));
    const __m256 B = _mm256_xor_ps(_mm256_mul_ps(DMIN, fm), _mm256_set1_ps(-0.f));
    for (int r = 0; r < MR; r++) o[r] = _mm256_fmadd_ps(B, _mm256_set1_ps(x->xsum[(m0 + r) * x->ng + blk]), o[r]);
}

/* MR rows over a Q4_K group, lanes 8h..8h+7 a pass (as packed8_avx2_of with several rows). */
__attribute__((target(ISA_256), always_inline)) static inline void q4k_rows_of(const uint8_t *g0, int64_t nrec,
                                                                                int64_t RB, const xrows_t *x, float *y,
                                                                                int64_t m0, const int MR, int64_t N,
                                                                                int nr, const uint8_t *ahead) {
    for (int h = 0; h < 2 && 8 * h < nr; h++) {
        __m256 acc[R], o[R];
        for (int r = 0; r < MR; r++) acc[r] = o[r] = _mm256_setzero_ps();
        for (int64_t e = 0; e < nrec; e++) {
            const uint8_t *rec = g0 + e * RB;
            if (ahead && h == 0) prefetch_ahead(rec, RB, QT_Q4_K);
            const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_at(QT_Q4_K) + 16 * h)));
#define Q4K_ROWS(c) q4k_rows_chunk(rec, h, c, x, m0, MR, 8 * e + c, D, acc)
            Q4K_ROWS(0); Q4K_ROWS(1); Q4K_ROWS(2); Q4K_ROWS(3); Q4K_ROWS(4); Q4K_ROWS(5); Q4K_ROWS(6); Q4K_ROWS(7);
#undef Q4K_ROWS
        }
        for (int64_t e = 0; e < nrec; e++) { /* the mins' terms, in the same order, from L1 / L2 */
            const uint8_t *rec = g0 + e * RB;
            const __m256 DMIN = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + m_at(QT_Q4_K) + 16 * h)));
#define Q4K_MINS(c) q4k_rows_mins(rec, h, c, x, m0, MR, 8 * e + c, DMIN, o)
            Q4K_MINS(0); Q4K_MINS(1); Q4K_MINS(2); Q4K_MINS(3); Q4K_MINS(4); Q4K_MINS(5); Q4K_MINS(6); Q4K_MINS(7);
#undef Q4K_MINS
        }
        const int cols = nr - 8 * h < 8 ? nr - 8 * h : 8;
        for (int r = 0; r < MR; r++) {
            float out[8];
            _mm256_storeu_ps(out, _mm256_add_ps(acc[r], o[r]));
            memcpy(y + (m0 + r) * N + 8 * h, out, sizeof(float) * (size_t)cols);
        }
    }
}

/* Q6_K's chunk c over MR rows, one 16-group at a time (its sums in pairs of maddubs, flush_of's 2),
 * level vectors loaded from lv (decoded once per chunk of the group) or decoded here. */
__attribute__((target(ISA_256), always_inline)) static inline void q6k_rows_chunk(const uint8_t *rec, const int h,
                                                                                   const int c, const xrows_t *x,
                                                                                   int64_t m0, const int MR, int64_t blk,
                                                                                   __m256 D, const uint8_t *lv,
                                                                                   __m256 *acc) {
    const int64_t K = x->K;
    const int8_t *xq = x->q + m0 * K + 32 * blk;
    const uint8_t *ql = rec + 32 * h + 64 * (16 * (c / 4) + 8 * (c % 2)), *qh = rec + 32 * h + 64 * (32 + 8 * (c / 4));
    const __m256i u = _mm256_loadu_si256((const __m256i *)(rec + u_at(QT_Q6_K) + 64 * (c / 2) + 32 * h));
    #pragma GCC unroll 2
    for (int g = 0; g < 2; g++) {
        __m256i s32[R];
        #pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            __m256i s16[R];
            for (int r = 0; r < MR; r++) s16[r] = _mm256_setzero_si256();
            #pragma GCC unroll 2
            for (int L = 4 * g + 2 * p; L < 4 * g + 2 * p + 2; L++) {
                const __m256i v = lv ? _mm256_load_si256((const __m256i *)(lv + 64 * (8 * blk + L) + 32 * h))
                                     : q6k_level(_mm256_loadu_si256((const __m256i *)(ql + 64 * L)),
                                                 _mm256_loadu_si256((const __m256i *)(qh + 64 * L)), c % 4);
                for (int r = 0; r < MR; r++)
                    s16[r] = keep256(_mm256_add_epi16(s16[r], _mm256_maddubs_epi16(v, _mm256_set1_epi32(dword_at(xq + r * K + 4 * L)))));
            }
            for (int r = 0; r < MR; r++) {
                const __m256i t = _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1));
                s32[r] = p ? _mm256_add_epi32(s32[r], t) : t;
            }
        }
        const int b = 2 * (c % 2) + g; /* the group's int8 scale: byte b of the lane's dword */
        const __m256 A = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u, 24 - 8 * b), 24)));
        for (int r = 0; r < MR; r++) {
            const int64_t m = m0 + r;
            const __m256i si = _mm256_sub_epi32(s32[r], _mm256_set1_epi32(32 * x->bsum[m * (K / 16) + 2 * blk + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(A, _mm256_set1_ps(x->dx[m * x->nb + blk])), acc[r]);
        }
    }
}

/* MR rows over a Q6_K group, lanes 8h..8h+7 a pass. */
__attribute__((target(ISA_256), always_inline)) static inline void q6k_rows_of(const uint8_t *g0, int64_t nrec,
                                                                                int64_t RB, const xrows_t *x, float *y,
                                                                                int64_t m0, const int MR, int64_t N,
                                                                                int nr, const uint8_t *ahead,
                                                                                const uint8_t *lv) {
    for (int h = 0; h < 2 && 8 * h < nr; h++) {
        __m256 acc[R];
        for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t e = 0; e < nrec; e++) {
            const uint8_t *rec = g0 + e * RB;
            if (ahead && h == 0) prefetch_ahead(rec, RB, QT_Q6_K);
            const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_at(QT_Q6_K) + 16 * h)));
#define Q6K_ROWS(c) q6k_rows_chunk(rec, h, c, x, m0, MR, 8 * e + c, D, lv, acc)
            Q6K_ROWS(0); Q6K_ROWS(1); Q6K_ROWS(2); Q6K_ROWS(3); Q6K_ROWS(4); Q6K_ROWS(5); Q6K_ROWS(6); Q6K_ROWS(7);
#undef Q6K_ROWS
        }
        const int cols = nr - 8 * h < 8 ? nr - 8 * h : 8;
        for (int r = 0; r < MR; r++) {
            float out[8];
            _mm256_storeu_ps(out, acc[r]);
            memcpy(y + (m0 + r) * N + 8 * h, out, sizeof(float) * (size_t)cols);
        }
    }
}

#define q4k_rows_of_CALL(MR, T) q4k_rows_of(g0, nrec, RB, x, y, m0, MR, N, nr, ahead)
#define q6k_rows_of_CALL(MR, T) q6k_rows_of(g0, nrec, RB, x, y, m0, MR, N, nr, ahead, lv)
#define q6k_rows_of_CALL0(MR, T) q6k_rows_of(g0, nrec, RB, x, y, m0, MR, N, nr, ahead, NULL)
/* The AVX2 variant's passes of 2-4 rows: Q4_K's and Q6_K's own, the generic pass for the other types. */
__attribute__((target(ISA_256))) static void rows_avx2(const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x,
                                                      float *y, int64_t m0, int mr, int64_t N, int nr, int64_t type,
                                                      const uint8_t *ahead, const uint8_t *lv) {
    if (type == QT_Q4_K && !lv) ROWS_2_TO_4(q4k_rows_of_CALL, QT_Q4_K)
    else if (type == QT_Q6_K && lv) ROWS_2_TO_4(q6k_rows_of_CALL, QT_Q6_K)
    else if (type == QT_Q6_K) ROWS_2_TO_4(q6k_rows_of_CALL0, QT_Q6_K)
    else packed_avx2(g0, nrec, RB, x, y, m0, mr, N, nr, type, ahead, lv);
}

/* Q4_K written out likewise (the gate / up products of a Q4_K_M file; the generic pass kept its
 * sums on the stack too), in packed8_avx2_of's order (all 8 maddubs in int16, flush_of's 8). A
 * record half's 6-bit scales and mins, lanes 8h..8h+7, are assembled once (sc[0], mn[0]: chunks
 * 0-3, one byte each of the lane's dword; sc[1], mn[1]: chunks 4-7) and each chunk picks its byte
 * with one shuffle; the mins' product is -(dmin * m) as (-dmin) * m, the same bits. */
typedef struct {
    __m256i sc[2], mn[2];
    __m256 d, neg_dmin;
} q4k_scales_t;

__attribute__((target(ISA_256), always_inline)) static inline q4k_scales_t q4k_scales(const uint8_t *rec, const int h) {
    const uint8_t *u = rec + u_at(QT_Q4_K) + 32 * h;
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)u), u1 = _mm256_loadu_si256((const __m256i *)(u + 64)),
                  u2 = _mm256_loadu_si256((const __m256i *)(u + 128));
    const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    q4k_scales_t k;
    k.sc[0] = _mm256_and_si256(u0, m6);
    k.mn[0] = _mm256_and_si256(u1, m6);
    k.sc[1] = _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), m30));
    k.mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4), _mm256_and_si256(_mm256_srli_epi32(u1, 2), m30));
    k.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_at(QT_Q4_K) + 16 * h)));
    k.neg_dmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + m_at(QT_Q4_K) + 16 * h))),
                               _mm256_set1_ps(-0.f));
    return k;
}

/* Chunk c of record rec, lanes 8h..8h+7, into acc and o. */
__attribute__((target(ISA_256), always_inline)) static inline void q4k_chunk(const uint8_t *rec, const int h, const int c,
                                                                               const int8_t *xq, const float *dx,
                                                                               const float *xs, const q4k_scales_t *k,
                                                                               __m256 *acc, __m256 *o) {
    const uint8_t *q = rec + 32 * h + 64 * 8 * (c / 2);
    __m256i s16 = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int L = 0; L < 8; L++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * L));
        const __m256i v = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v, _mm256_set1_epi32(dword_at(xq + 4 * L))));
    }
    const __m256i s = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    const int b = c % 4; /* byte b of each dword, zero-extended */
    const __m256i pick = _mm256_setr_epi32((int)(0x80808000u + b), (int)(0x80808004u + b), (int)(0x80808008u + b),
                                           (int)(0x8080800cu + b), (int)(0x80808000u + b), (int)(0x80808004u + b),
                                           (int)(0x80808008u + b), (int)(0x8080800cu + b));
    const __m256 fs = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(k->sc[c / 4], pick));
    const __m256 fm = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(k->mn[c / 4], pick));
    const __m256 A = _mm256_mul_ps(k->d, fs), B = _mm256_mul_ps(k->neg_dmin, fm);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(A, _mm256_set1_ps(*dx)), *acc);
    *o = _mm256_fmadd_ps(B, _mm256_set1_ps(*xs), *o);
}

/* One activation row over a Q4_K group, lanes and prefetches as q6k_one_avx2. Zen 3, 2 threads,
 * from DRAM: 7168 x 1024 17-19 -> 17-24 GB/s; Qwen3.5-0.8B Q4_K_M's decode, gate_up 5.9 -> 4.9 ms. The
 * scales assembled once per record half (q4k_scales), medians of 3 from DRAM: 16384 x 2048 23.9 -> 24.7
 * GB/s, 2048 x 8192 22.0 -> 26.9 (from L3: 28 -> 30). */
__attribute__((target(ISA_256))) static void q4k_one_avx2(const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x,
                                                            float *y, int64_t m0, int64_t N, int nr, const uint8_t *ahead) {
    const int64_t K = x->K;
    const int8_t *xq = x->q + m0 * K;
    const float *dx = x->dx + m0 * x->nb, *xs = x->xsum + m0 * x->ng;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, o[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < (nr > 8 ? 2 : 1); h++)
        for (int64_t e = 0; e < nrec; e++) {
            const uint8_t *rec = g0 + e * RB;
            if (ahead) prefetch_span(g0 + nrec * RB + (h * nrec + e) * (RB / 2), RB / 2);
            const q4k_scales_t k = q4k_scales(rec, h);
#define Q4K_CHUNK(c) q4k_chunk(rec, h, c, xq + 32 * (8 * e + c), dx + 8 * e + c, xs + 8 * e + c, &k, &acc[h], &o[h])
            Q4K_CHUNK(0); Q4K_CHUNK(1); Q4K_CHUNK(2); Q4K_CHUNK(3); Q4K_CHUNK(4); Q4K_CHUNK(5); Q4K_CHUNK(6); Q4K_CHUNK(7);
#undef Q4K_CHUNK
        }
    for (int h = 0; h < 2 && 8 * h < nr; h++) {
        float out[8];
        _mm256_storeu_ps(out, _mm256_add_ps(acc[h], o[h]));
        memcpy(y + m0 * N + 8 * h, out, sizeof(float) * (size_t)(nr - 8 * h < 8 ? nr - 8 * h : 8));
    }
}

/* The AVX2 variant's one-row passes: Q6_K's and Q4_K's own, the generic pass for the other types. */
__attribute__((target(ISA_256))) static void one_avx2(const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x,
                                                     float *y, int64_t m0, int mr, int64_t N, int nr, int64_t type,
                                                     const uint8_t *ahead, const uint8_t *lv) {
    if (type == QT_Q6_K && !lv) q6k_one_avx2(g0, nrec, RB, x, y, m0, N, nr, ahead);
    else if (type == QT_Q4_K && !lv) q4k_one_avx2(g0, nrec, RB, x, y, m0, N, nr, ahead);
    else packed_avx2(g0, nrec, RB, x, y, m0, mr, N, nr, type, ahead, lv);
}

/* One activation row's 16-lane passes (a decode step of one request), scheduled before register
 * allocation with an eye on register pressure (gcc's first scheduling pass, off by default on x86).
 * Zen 4, one row: the embedded file's Q8_0 LM head 1.6x faster, down 1.17x; 4096-wide weights from
 * L3: IQ4_XS 1.32x, Q6_K 1.19x, Q4_0 1.11x; from DRAM: Q4_1 / Q8_0 1.01-1.08x. Not for more rows (the
 * Q8_0 LM head's 16-row passes ran 1.7x slower so compiled), nor for AVX2: there it stopped the
 * spills of the level decoders (from L3: Q3_K 1.22x, Q2_K 1.15x) but streamed from DRAM slower
 * (Q4_1 0.85-0.88x), and the embedded file's decode ran ~10% slower in the engine. */
#define PACKED_ONE_ROW(name, fn, isa)                                                                             \
    __attribute__((target(isa), optimize("schedule-insns", "sched-pressure"))) static void name(                  \
            const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x, float *y, int64_t m0, int mr, int64_t N,\
            int nr, int64_t type, const uint8_t *ahead, const uint8_t *lv) {                                      \
        (void)mr;                                                                                                 \
        if (lv) COSTLY_CASES(ONE_ROW, fn##_CALL)                                                                  \
        else TYPE_CASES(ONE_ROW, fn##_CALL0)                                                                      \
    }
PACKED_ONE_ROW(one_avx512vnni, packed16_of, ISA_512)

/* A group's level vectors, every 32-chunk of every record, decoded once into lv (chunk blk's 8
 * vectors of 64 bytes at lv + 512 blk, 16 lanes as levels16 gives them; levels8's half h is bytes
 * 32h..32h + 31 of each), for passes that load them instead of decoding them again. */
__attribute__((target(ISA_512), always_inline)) static inline void decode16_of(const uint8_t *g0, int64_t nrec, int64_t RB,
                                                                               const int64_t T, uint8_t *lv) {
    for (int64_t e = 0; e < nrec; e++)
        for (int c = 0; c < chunks_of(T); c++) {
            __m512i v[8];
            levels16(g0 + e * RB, T, c, v, 0);
            for (int L = 0; L < 8; L++) _mm512_store_si512(lv + 64 * (8 * (e * chunks_of(T) + c) + L), v[L]);
        }
}
__attribute__((target("avx2"), always_inline)) static inline void decode8_of(const uint8_t *g0, int64_t nrec, int64_t RB,
                                                                            const int64_t T, uint8_t *lv) {
    for (int64_t e = 0; e < nrec; e++)
        for (int c = 0; c < chunks_of(T); c++)
            for (int h = 0; h < 2; h++) {
                __m256i v[8];
                levels8(g0 + e * RB, T, c, h, v);
                for (int L = 0; L < 8; L++)
                    _mm256_store_si256((__m256i *)(lv + 64 * (8 * (e * chunks_of(T) + c) + L) + 32 * h), v[L]);
            }
}
#define DECODE_CASES(fn)                                                                                  \
    switch (type) { /* costly_levels' types */                                                           \
        case QT_Q5_0: fn(g0, nrec, RB, QT_Q5_0, lv); break; case QT_Q5_1: fn(g0, nrec, RB, QT_Q5_1, lv); break; \
        case QT_Q3_K: fn(g0, nrec, RB, QT_Q3_K, lv); break; \
        case QT_Q5_K: fn(g0, nrec, RB, QT_Q5_K, lv); break; default: fn(g0, nrec, RB, QT_Q6_K, lv); break; \
    }
__attribute__((target(ISA_512))) static void decode_avx512(const uint8_t *g0, int64_t nrec, int64_t RB, int64_t type,
                                                           uint8_t *lv) {
    DECODE_CASES(decode16_of)
}
__attribute__((target("avx2"))) static void decode_avx2(const uint8_t *g0, int64_t nrec, int64_t RB, int64_t type,
                                                       uint8_t *lv) {
    DECODE_CASES(decode8_of)
}

/* AMX-INT8 (ISA_AMX): a group's 16 rows against up to 16 activation rows per tile product. A
 * chunk's 8 level vectors (levels16) are already a B tile: line j holds four weights of each row,
 * k_at(T, j) onwards, so stored as tile row k_at(T, j) / 4 they meet the activations' own columns
 * (tile A: the rows' int8 levels as quantized, stride K). TDPBSUD multiplies signed activations by
 * unsigned levels, TDPBSSD signed by signed (Q8_0, IQ4_NL: no +128 detour), giving exactly
 * packed16_of's integer sums; everything after them is packed16_of's, op for op, so the bits match.
 * Below AMX_ROWS rows the vector pass wins (a tile product costs about the same at 1 row as at 16;
 * measured crossover 10 rows, Q4_1 at K 576 and 1536). */
#define AMX_ROWS 10
#define ISA_AMX_T ISA_512 ",amx-tile,amx-int8"
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Tiles, two sets so that one chunk's tile product overlaps the previous chunk's scaling: 0, 1
 * (4, 5) sums (Q6_K: one per 16-group), 2 (6) activations (mr x 32, or mr x 16 per 16-group), 3 (7)
 * levels (8 x 64, or 4 x 64). Loaded by each thread when its passes' row count changes (a tail of
 * fewer rows, at most twice a chunk; ldtilecfg costs hundreds of cycles), released at the
 * product's end: other code on the thread
 * (oneDNN) may use tiles between products. */
__attribute__((target(ISA_AMX_T))) static void amx_config(int mr, int g2) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int s = 0; s < 8; s += 4) {
        cfg.rows[s] = cfg.rows[s + 1] = cfg.rows[s + 2] = (uint8_t)mr;
        cfg.colsb[s] = cfg.colsb[s + 1] = 64;
        cfg.colsb[s + 2] = g2 ? 16 : 32;
        cfg.rows[s + 3] = g2 ? 4 : 8;
        cfg.colsb[s + 3] = 64;
    }
    /* gcc 12 drops the stores above otherwise: it does not see ldtilecfg read all 64 bytes. */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* One chunk's integer sums into cs[g][row][lane], with tile set C0, C1, TA, TB (literals: tile
 * numbers are immediates). */
#define AMX_SUMS(C0, C1, TA, TB, lvp, csp)                                      \
    do {                                                                        \
        _tile_zero(C0);                                                         \
        _tile_loadd(TA, xq, K);                                                 \
        _tile_loadd(TB, lvp, 64);                                               \
        if (qt_signed(T)) _tile_dpbssd(C0, TA, TB); else _tile_dpbsud(C0, TA, TB); \
        _tile_stored(C0, csp[0], 64);                                           \
        if (G2) {                                                               \
            _tile_zero(C1);                                                     \
            _tile_loadd(TA, xq + 16, K);                                        \
            _tile_loadd(TB, lvp + 256, 64);                                     \
            _tile_dpbsud(C1, TA, TB);                                           \
            _tile_stored(C1, csp[1], 64);                                       \
        }                                                                       \
    } while (0)

/* Chunk q's level vectors stored as a B tile (row k_at(T, j) / 4 = line j). */
__attribute__((target(ISA_AMX_T), always_inline)) static inline void amx_levels(const uint8_t *g0, int64_t RB, int64_t q,
                                                                               const int64_t T, uint8_t *lvp) {
    __m512i v[8];
    levels16(g0 + q / chunks_of(T) * RB, T, (int)(q % chunks_of(T)), v, 0);
    for (int j = 0; j < 8; j++) _mm512_store_si512(lvp + 16 * k_at(T, j), v[j]);
}

/* A tile load waits for stores still in flight to its bytes (no forwarding): levels are stored
 * AMX_AHEAD chunks before their tile product reads them. */
#define AMX_AHEAD 4
__attribute__((target(ISA_AMX_T), always_inline)) static inline void amx_of(
        const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x, float *y, int64_t m0, int mr, int64_t N,
        int nr, const int64_t T, const uint8_t *ahead, const uint8_t *pre) {
    const int64_t K = x->K, nq = nrec * chunks_of(T);
    const int OFF = qt_offset(T), SH = qt_shift(T), CH = chunks_of(T), G2 = qt_group(T) == 16;
    __m512 acc[16], o[16], sa[2][2], sb[2][2];
    uint8_t lv[AMX_AHEAD][512] __attribute__((aligned(64)));
    int32_t cs[2][2][16][16] __attribute__((aligned(64)));
    for (int r = 0; r < mr; r++) acc[r] = o[r] = _mm512_setzero_ps();
    for (int64_t q = 0; !pre && q < AMX_AHEAD && q < nq; q++) amx_levels(g0, RB, q, T, lv[q]);
    for (int64_t q = 0; q <= nq; q++) {
        if (q < nq) { /* chunk q (block q of each row): scales and the tile product */
            const int64_t e = q / CH;
            const int c = (int)(q % CH), p = (int)(q & 1);
            const uint8_t *rec = g0 + e * RB;
            if (ahead && c == 0) prefetch_span(ahead + e * RB, RB);
            sa[p][0] = sa[p][1] = sb[p][0] = sb[p][1] = _mm512_setzero_ps();
            scales16(rec, T, c, sa[p], sb[p]);
            const int8_t *xq = x->q + m0 * K + 32 * q;
            uint8_t *lvq = pre ? (uint8_t *)pre + 512 * q : lv[q % AMX_AHEAD];
            if (p) AMX_SUMS(4, 5, 6, 7, lvq, cs[1]);
            else AMX_SUMS(0, 1, 2, 3, lvq, cs[0]);
            if (!pre && q + AMX_AHEAD < nq) amx_levels(g0, RB, q + AMX_AHEAD, T, lvq);
        }
        if (q > 0) { /* chunk q - 1's sums scaled into the rows, as packed16_of */
            const int64_t blk = q - 1;
            const int p = (int)(blk & 1);
            for (int r = 0; r < mr; r++) {
                const int64_t m = m0 + r;
                const __m512 dx = _mm512_set1_ps(x->dx[m * x->nb + blk]);
                for (int g = 0; g <= G2; g++) {
                    __m512i si = _mm512_load_si512(cs[p][g][r]);
                    if (SH) si = _mm512_sub_epi32(si, _mm512_set1_epi32(SH * x->bsum[G2 ? m * (K / 16) + 2 * blk + g : m * x->nb + blk]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(sa[p][g], dx), acc[r]);
                }
                for (int g = 0; OFF && g <= G2; g++)
                    o[r] = _mm512_fmadd_ps(sb[p][g], _mm512_set1_ps(x->xsum[m * x->ng + (G2 ? 2 * blk + g : blk)]), o[r]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        _mm512_mask_storeu_ps(y + (m0 + r) * N, (__mmask16)((1u << nr) - 1), OFF ? _mm512_add_ps(acc[r], o[r]) : acc[r]);
}
__attribute__((target(ISA_AMX_T))) static void amx_release(void) { _tile_release(); }
#define amx_of_CALL(T) amx_of(g0, nrec, RB, x, y, m0, mr, N, nr, T, ahead, lv)
#define AMX_EACH(CALL, T) CALL(T)
/* lv: the group's levels stored as B tiles by decode_amx, or NULL to decode them here. */
__attribute__((target(ISA_AMX_T))) static void packed_amx(const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x,
                                                        float *y, int64_t m0, int mr, int64_t N, int nr, int64_t type,
                                                        const uint8_t *ahead, const uint8_t *lv) {
    TYPE_CASES(AMX_EACH, amx_of_CALL)
}
/* A group's levels as B tiles, 512 bytes a chunk: every tile pass of 16 rows then loads them. */
#define amx_decode_CALL(T) \
    for (int64_t q = 0; q < nrec * chunks_of(T); q++) amx_levels(g0, RB, q, T, lv + 512 * q)
__attribute__((target(ISA_AMX_T))) static void decode_amx(const uint8_t *g0, int64_t nrec, int64_t RB, int64_t type,
                                                        uint8_t *lv) {
    TYPE_CASES(AMX_EACH, amx_decode_CALL)
}

/* With several passes of rows, each thread walks its groups in chunks of about CHUNK_BYTES, every
 * pass over a chunk before the next: the first pass reads the chunk as one stream, which the
 * hardware prefetcher follows, and the others read it from L2. Group by group, each group's first
 * pass waited on memory while its other passes computed, and the hardware prefetcher did not cover
 * it (Zen 4, 16 rows: Q4_1 gate_up 128 -> 103 us, the Q8_0 LM head 2.32 -> 1.88 ms; the prefetches
 * of the group two ahead tried then had been compiled out, see prefetch_span). A thread's groups
 * are one contiguous range, as before. */
#define CHUNK_BYTES (128 * 1024)

typedef void (*pass_fn)(const uint8_t *g0, int64_t nrec, int64_t RB, const xrows_t *x, float *y, int64_t m0, int mr,
                        int64_t N, int nr, int64_t type, const uint8_t *ahead, const uint8_t *lv);
typedef void (*decode_fn)(const uint8_t *g0, int64_t nrec, int64_t RB, int64_t type, uint8_t *lv);

/* From this many passes of rows over a chunk, the levels of the types with fifth or sixth bits are
 * decoded once (decode_*) and every pass loads them: a pass of R rows decodes a record's levels for
 * only R rows' products, and for these types that is a large share of its work. Zen 4, 128 rows
 * (prompt chunks), AVX-512 / AVX2: Q5_0 1.25 / 1.28x faster, Q5_1 1.26 / 1.26x, Q5_K 1.29 / 1.21x,
 * Q6_K 1.32 / 1.23x; 16 rows Q6_K 1.52 / 1.13x. For 4-bit nibbles (two instructions a vector) the
 * extra loads and stores cost more than they save (Q4_1 16 rows: 1.4x slower). */
#define PRE_PASSES 4
#define AMX_PRE_PASSES 8
static inline int costly_levels(int64_t t) { return has_qh(t) || t == QT_Q3_K || t == QT_Q5_K || t == QT_Q6_K; }

/* The thread's buffer of decoded levels, grown as needed and kept (torch's OpenMP threads live as
 * long as the process; a chunk's decoded levels are 1.2-1.5x its 128 KB of weights). */
static uint8_t *levels_buffer(size_t bytes) {
    static __thread uint8_t *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 4095) / 4096 * 4096;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0; /* no memory: the passes decode the levels themselves */
    }
    return buf;
}

/* What q8_packed_gemm needs of the activations (q8_quantize_rows's flags; bsum per scale group for
 * the shifted and the flipped levels). */
void q8_packed_needs(int64_t type, int64_t isa, int *want_u, int *want_sum, int *bsum_gs) {
    const int flipped = qt_signed(type) && (isa == ISA_AVX512VNNI || isa == ISA_AMX); /* packed16_of's */
    *want_u = qt_signed(type) && isa == ISA_AVXVNNI;
    *want_sum = qt_offset(type);
    *bsum_gs = qt_shift(type) || flipped ? qt_group(type) : 0;
}

/* y[M, N] = x @ w^T for a packed weight w, x quantized as q8_packed_needs says. */
void q8_packed_gemm(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N, int64_t isa) {
    if (isa == ISA_PORTABLE) {
        packed_portable(w, type, x, y, M, N);
        return;
    }
    /* AVX-512BW without VNNI: the 8-lane maddubs pass (a 16-lane one is not measured to win). */
    static const pass_fn PASS[ISA_COUNT] = {NULL, rows_avx2, rows_avx2, packed_avxvnni, packed_avx512vnni,
                                            packed_avx512vnni};
    static const pass_fn ONE[ISA_COUNT] = {NULL, one_avx2, one_avx2, packed_avxvnni, one_avx512vnni, one_avx512vnni};
    const int64_t nrec = x->K / qt_block(type), RB = 16 * qt_bytes(type), GB = nrec * RB, groups = (N + 15) / 16;
    static const decode_fn DECODE[ISA_COUNT] = {NULL, decode_avx2, decode_avx2, decode_avx2, decode_avx512,
                                                decode_amx};
    const int64_t chunk = CHUNK_BYTES / GB > 1 ? CHUNK_BYTES / GB : 1, LB = nrec * chunks_of(type) * 512;
    /* AMX: levels decoded once as tiles that every tile pass loads (the vector passes of its tail decode
     * their own): from two passes for the costly types, from AMX_PRE_PASSES for the others, whose
     * decoding costs about what storing and loading it does (Q4_1 / Q8_0: slower at 2 passes, 1.05-1.1x
     * faster at 8 and 32; Q6_K 1.15-1.2x faster at 2 to 32). */
    const int pre = isa == ISA_AMX ? M / 16 >= (costly_levels(type) ? 2 : AMX_PRE_PASSES)
                                   : (M + R - 1) / R >= PRE_PASSES && costly_levels(type) && DECODE[isa];
    #pragma omp parallel
    {
        int tile_rows = 0; /* the rows this thread's tile config is for; 0: none loaded */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t ga = groups * t / nt, gb = groups * (t + 1) / nt; /* this thread's groups */
        uint8_t *lv = pre ? levels_buffer((size_t)(chunk * LB)) : NULL;
        const int use = lv != NULL;
        for (int64_t c0 = ga; c0 < gb; c0 += chunk) {
            const int64_t c1 = c0 + chunk < gb ? c0 + chunk : gb;
            if (use)
                for (int64_t g = c0; g < c1; g++) DECODE[isa](w + g * GB, nrec, RB, type, lv + (g - c0) * LB);
            for (int64_t m0 = 0, rm; m0 < M; m0 += rm) { /* AMX passes of 16 rows while AMX_ROWS are left */
                const int amx = isa == ISA_AMX && M - m0 >= AMX_ROWS;
                rm = amx ? 16 : R;
                const int mr = M - m0 < rm ? (int)(M - m0) : (int)rm;
                if (amx && tile_rows != mr) amx_config(tile_rows = mr, qt_group(type) == 16);
                for (int64_t g = c0; g < c1; g++) {
                    const int nr = N - g * 16 < 16 ? (int)(N - g * 16) : 16;
                    (amx ? packed_amx : mr == 1 ? ONE[isa] : PASS[isa])(w + g * GB, nrec, RB, x, y + g * 16, m0, mr, N, nr, type,
                                                   m0 == 0 && !use && g + 2 < gb ? w + (g + 2) * GB : NULL,
                                                   use && amx == (isa == ISA_AMX) ? lv + (g - c0) * LB : NULL);
                }
            }
        }
        if (tile_rows) amx_release();
    }
}
