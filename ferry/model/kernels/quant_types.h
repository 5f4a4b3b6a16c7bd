/* The GGUF types ferry keeps quantized: one row each, the one C definition of the table that
 * ferry/model/quant.py's QUANT_TYPES mirrors (it checks each row against quant_type_row at load).
 * X(name, GGML type id = the kernels' type id, weights per block, bytes per block). Weights stay in
 * the file's own blocks (float16 scales), so resident bytes equal the file's. */
#ifndef FERRY_QUANT_TYPES_H
#define FERRY_QUANT_TYPES_H
#include <stdint.h>
#include <string.h>

#define FERRY_QUANT_TYPES(X) \
    X(Q4_0, 2, 32, 18)       \
    X(Q4_1, 3, 32, 20)       \
    X(Q5_0, 6, 32, 22)       \
    X(Q5_1, 7, 32, 24)       \
    X(Q8_0, 8, 32, 34)       \
    X(Q2_K, 10, 256, 84)     \
    X(Q3_K, 11, 256, 110)    \
    X(Q4_K, 12, 256, 144)    \
    X(Q5_K, 13, 256, 176)    \
    X(Q6_K, 14, 256, 210)    \
    X(IQ4_NL, 20, 32, 18)    \
    X(IQ4_XS, 23, 256, 136)

#define FERRY_QT_ENUM(name, id, block, bytes) QT_##name = id,
enum { FERRY_QUANT_TYPES(FERRY_QT_ENUM) };
#undef FERRY_QT_ENUM

/* Weights per block and bytes per block of a type id (0 for an unknown id). */
static inline int64_t qt_block(int64_t type) {
#define FERRY_QT_CASE(name, id, block, bytes) case id: return block;
    switch (type) { FERRY_QUANT_TYPES(FERRY_QT_CASE) default: return 0; }
#undef FERRY_QT_CASE
}
static inline int64_t qt_bytes(int64_t type) {
#define FERRY_QT_CASE(name, id, block, bytes) case id: return bytes;
    switch (type) { FERRY_QUANT_TYPES(FERRY_QT_CASE) default: return 0; }
#undef FERRY_QT_CASE
}

#define FERRY_QT_Q8 256 /* a product's type id | this: activations quantized to int8 (quant_q8_tiles.c) */
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
