/* The GGUF types ferry keeps quantized: one row of traits each, the one C definition of the facts
 * every kernel reads (block sizes, scale groups, offsets, level shifts, where the scales sit), which
 * ferry/model/quant.py's QUANT_TYPES mirrors (it checks each row against quant_type_traits at
 * load). Weights stay in the file's own blocks (float16 scales), so resident bytes equal the file's.
 * X(name, GGML type id = the kernels' type id, weights per block, bytes per block, q8 scale group,
 *   offset, level shift, byte offset of d): ferry_kernels.h's ferry_qt_traits_t says what each is.
 * MXFP4's d is no float16 but one E8M0 byte (a power of two, qt_e8m0_half), its levels E2M1 doubled. */
#ifndef FERRY_QUANT_TYPES_H
#define FERRY_QUANT_TYPES_H
#include <stdint.h>
#include <string.h>

#include "ferry_kernels.h"

#define FERRY_QUANT_TYPES(X)                     \
    X(Q4_0,    2,  32,  18, 32, 0,  8,   0)       \
    X(Q4_1,    3,  32,  20, 32, 1,  0,   0)       \
    X(Q5_0,    6,  32,  22, 32, 0, 16,   0)       \
    X(Q5_1,    7,  32,  24, 32, 1,  0,   0)       \
    X(Q8_0,    8,  32,  34, 32, 0,  0,   0)       \
    X(Q2_K,   10, 256,  84, 16, 1,  0,  80)       \
    X(Q3_K,   11, 256, 110, 16, 0,  4, 108)       \
    X(Q4_K,   12, 256, 144, 32, 1,  0,   0)       \
    X(Q5_K,   13, 256, 176, 32, 1,  0,   0)       \
    X(Q6_K,   14, 256, 210, 16, 0, 32, 208)       \
    X(IQ4_NL, 20,  32,  18, 32, 0,  0,   0)       \
    X(IQ4_XS, 23, 256, 136, 32, 0,  0,   0)       \
    X(MXFP4,  39,  32,  17, 32, 0,  0,   0)

#define FERRY_QT_ENUM(name, id, ...) QT_##name = id,
enum { FERRY_QUANT_TYPES(FERRY_QT_ENUM) };
#undef FERRY_QT_ENUM

/* The rows indexed by type id (ids not in the table: a row of zeros), as quant_type_traits exports
 * them. The kernels read the same rows through the accessors below, generated from the table. */
enum { FERRY_QT_IDS = 40 };
#define FERRY_QT_ROW(nm, id, block, bytes, group, offset, shift, d_at) \
    [id] = {#nm, id, block, bytes, group, offset, shift, d_at},
static const ferry_qt_traits_t FERRY_QT_TRAITS[FERRY_QT_IDS] = {FERRY_QUANT_TYPES(FERRY_QT_ROW)};
#undef FERRY_QT_ROW
#define FERRY_QT_CHECK(nm, id, block, bytes, group, ...)                                      \
    _Static_assert(id > 0 && id < FERRY_QT_IDS && (block == 32 || block == 256) && (group == 16 || group == 32), \
                   #nm ": an id the table indexes, blocks of 32 or 256, scale groups of 16 or 32");
FERRY_QUANT_TYPES(FERRY_QT_CHECK)
#undef FERRY_QT_CHECK

static inline const ferry_qt_traits_t *qt_traits(int64_t type) {
    return &FERRY_QT_TRAITS[(uint64_t)type < FERRY_QT_IDS ? type : 0];
}
/* Weights per block and bytes per block of a type id (0 for an unknown id). */
static inline int64_t qt_block(int64_t type) {
#define FERRY_QT_CASE(nm, id, block, ...) case id: return block;
    switch (type) { FERRY_QUANT_TYPES(FERRY_QT_CASE) default: return 0; }
#undef FERRY_QT_CASE
}
static inline int64_t qt_bytes(int64_t type) {
#define FERRY_QT_CASE(nm, id, block, bytes, ...) case id: return bytes;
    switch (type) { FERRY_QUANT_TYPES(FERRY_QT_CASE) default: return 0; }
#undef FERRY_QT_CASE
}
/* Byte offset of a block's float16 scale d (an offset type's min follows it). */
static inline int64_t qt_d_at(int64_t type) {
#define FERRY_QT_CASE(nm, id, block, bytes, group, offset, shift, d_at) case id: return d_at;
    switch (type) { FERRY_QUANT_TYPES(FERRY_QT_CASE) default: return 0; }
#undef FERRY_QT_CASE
}

/* The kernels' per-type predicates, as chains of comparisons over the rows in the table's order
 * ("t == QT_Q4_1 || t == QT_Q5_1 || ..." once the rows' constants fold): a constant type folds
 * as early as hand-written comparisons, so the passes compiled per type keep their code. */
/* A K-quant (or IQ4_XS): super-blocks of 256 weights, 8 chunks of 32. */
static inline int qt_k(int64_t t) {
#define FERRY_QT_OR(nm, id, block, ...) || (t == id && block == 256)
    return 0 FERRY_QUANT_TYPES(FERRY_QT_OR);
#undef FERRY_QT_OR
}
/* 1 where w = a q + b (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K): levels never negative, a min after d. */
static inline int qt_offset(int64_t t) {
#define FERRY_QT_OR(nm, id, block, bytes, group, offset, ...) || (t == id && offset)
    return 0 FERRY_QUANT_TYPES(FERRY_QT_OR);
#undef FERRY_QT_OR
}
/* Levels stored signed, as they are (Q8_0's int8, IQ4's table): neither offset nor shift. */
static inline int qt_signed(int64_t t) {
#define FERRY_QT_OR(nm, id, block, bytes, group, offset, shift, d_at) || (t == id && !offset && !shift)
    return 0 FERRY_QUANT_TYPES(FERRY_QT_OR);
#undef FERRY_QT_OR
}
/* Weights per scale group of the q8 products: 16 (Q2_K, Q3_K, Q6_K) or 32. */
static inline int qt_group(int64_t t) {
#define FERRY_QT_OR(nm, id, block, bytes, group, ...) || (t == id && group == 16)
    return 0 FERRY_QUANT_TYPES(FERRY_QT_OR) ? 16 : 32;
#undef FERRY_QT_OR
}
/* Stored levels are the level plus this (Q4_0 8, Q5_0 16, Q3_K 4, Q6_K 32), else 0. */
static inline int qt_shift(int64_t t) {
#define FERRY_QT_IF(nm, id, block, bytes, group, offset, shift, d_at) t == id && shift ? shift :
    return FERRY_QUANT_TYPES(FERRY_QT_IF) 0;
#undef FERRY_QT_IF
}

#define FERRY_QT_Q8 256 /* a product's type id | this: activations quantized to int8 (quant_q8.c) */
#define FERRY_QT_PACKED 512 /* | this (with FERRY_QT_Q8): the weight is packed by 16 rows (quant_q8_packed.c) */

/* Q4_K / Q5_K: sub-block j's six-bit scale and min, 8 of each packed in 12 bytes at s. */
static inline void qt_scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* IQ4_NL / IQ4_XS's non-linear levels. */
static const int8_t KVALUES_IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's levels: the E2M1 values doubled (so integers), a sign bit then 0, 0.5, 1, 1.5, 2, 3, 4, 6. */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* MXFP4's scale: an E8M0 byte e as half of 2^(e - 127), the levels being doubled (ggml's
 * ggml_e8m0_to_fp32_half, gguf's e8m0_to_fp32_half): 2^(e - 128), subnormal for e < 2. */
static inline float qt_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* IEEE half -> float, exact (subnormals, infinities and NaNs included). */
#if defined(__F16C__)
#include <immintrin.h>
/* One instruction (exact: every half is a float). */
static inline float qt_f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }
#else
static inline float qt_f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3ff, bits;
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man) {
        uint32_t e = 113;  /* normalise: value = man * 2^-24 */
        while (!(man & 0x400)) { man <<= 1; e--; }
        bits = sign | (e << 23) | ((man & 0x3ff) << 13);
    } else bits = sign;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* Dequantize one row of K weights (K a multiple of the type's block), as gguf.quants does. */
void quant_dequant_row(const uint8_t *row, float *out, int64_t K, int64_t type);
#endif
