/* Dequantization of every GGUF type in quant_types.h, bit for bit as gguf.quants.dequantize:
 * the same float32 operations in the same order. This file is compiled without -ffast-math and
 * with -ffp-contract=off (kernels/__init__.py), so no multiply-add is fused and no sum reordered.
 * Block layouts are the file's own (ggml's block_q4_0 ... block_iq4_xs). */
#include <stdint.h>
#include <string.h>

#include "quant_types.h"

/* Element i < 16 of a 32-block is the low nibble of qs[i], element 16 + i its high nibble. */
static inline int nib32(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }

static void q4_0(const uint8_t *b, float *y) {
    const float d = qt_f16(b);
    for (int i = 0; i < 32; i++) y[i] = d * (float)(nib32(b + 2, i) - 8);
}
static void q4_1(const uint8_t *b, float *y) {
    const float d = qt_f16(b), m = qt_f16(b + 2);
    for (int i = 0; i < 32; i++) y[i] = d * (float)nib32(b + 4, i) + m;
}
static void q5_0(const uint8_t *b, float *y) {
    const float d = qt_f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int i = 0; i < 32; i++) y[i] = d * (float)((nib32(b + 6, i) | (int)(((qh >> i) & 1) << 4)) - 16);
}
static void q5_1(const uint8_t *b, float *y) {
    const float d = qt_f16(b), m = qt_f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int i = 0; i < 32; i++) y[i] = d * (float)(nib32(b + 8, i) | (((qh >> i) & 1) << 4)) + m;
}
static void q8_0(const uint8_t *b, float *y) {
    const float d = qt_f16(b);
    for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
}
static void iq4_nl(const uint8_t *b, float *y) {
    const float d = qt_f16(b);
    for (int i = 0; i < 32; i++) y[i] = d * (float)KVALUES_IQ4[nib32(b + 2, i)];
}

/* Super-blocks of 256. Element e: 2-bit fields walk 32 bytes 4 times (shift 0, 2, 4, 6) per 128. */
static void q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = qt_f16(b + 80), dmin = qt_f16(b + 82);
    for (int e = 0; e < 256; e++) {
        const float dl = d * (float)(sc[e / 16] & 15), ml = dmin * (float)(sc[e / 16] >> 4);
        const int q = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        y[e] = dl * (float)q - ml;
    }
}
static void q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    const float d = qt_f16(b + 108);
    float dl[16];
    for (int i = 0; i < 16; i++) {
        const int lo = (s[i % 8] >> (4 * (i / 8))) & 15, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * (float)((lo | (hi << 4)) - 32);
    }
    for (int e = 0; e < 256; e++) {
        const int ql = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        const int h = (hm[e % 32] >> (e / 32)) & 1;
        y[e] = dl[e / 16] * (float)(ql - ((h ^ 1) << 2));
    }
}
/* Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes. */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}
static void q4_k(const uint8_t *b, float *y) {
    const float d = qt_f16(b), dmin = qt_f16(b + 2);
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(b + 4, j, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        for (int l = 0; l < 32; l++) y[j * 32 + l] = ds * (float)((qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 15) - dm;
    }
}
static void q5_k(const uint8_t *b, float *y) {
    const float d = qt_f16(b), dmin = qt_f16(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(b + 4, j, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            const int q = ((qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 15) | (((qh[l] >> j) & 1) << 4);
            y[j * 32 + l] = ds * (float)q - dm;
        }
    }
}
static void q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = qt_f16(b + 208);
    for (int e = 0; e < 256; e++) {
        const int half = e / 128, r = e % 128;
        const int lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
        const int hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
        y[e] = d * (float)sc[e / 16] * (float)((lo | (hi << 4)) - 32);
    }
}
static void iq4_xs(const uint8_t *b, float *y) {
    const float d = qt_f16(b);
    const uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int j = 0; j < 8; j++) {
        const int ls = (((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
        const float dl = d * (float)ls;
        for (int i = 0; i < 32; i++) y[j * 32 + i] = dl * (float)KVALUES_IQ4[nib32(qs + j * 16, i)];
    }
}

#define ROW(fn, block, bytes) \
    for (int64_t k = 0; k < K; k += block, row += bytes) fn(row, out + k); \
    return;
void quant_dequant_row(const uint8_t *row, float *out, int64_t K, int64_t type) {
    switch (type) {
        case QT_Q4_0: ROW(q4_0, 32, 18)
        case QT_Q4_1: ROW(q4_1, 32, 20)
        case QT_Q5_0: ROW(q5_0, 32, 22)
        case QT_Q5_1: ROW(q5_1, 32, 24)
        case QT_Q8_0: ROW(q8_0, 32, 34)
        case QT_Q2_K: ROW(q2_k, 256, 84)
        case QT_Q3_K: ROW(q3_k, 256, 110)
        case QT_Q4_K: ROW(q4_k, 256, 144)
        case QT_Q5_K: ROW(q5_k, 256, 176)
        case QT_Q6_K: ROW(q6_k, 256, 210)
        case QT_IQ4_NL: ROW(iq4_nl, 32, 18)
        case QT_IQ4_XS: ROW(iq4_xs, 256, 136)
        default: memset(out, 0, sizeof(float) * K);  /* unreachable: quant.py checks types at load */
    }
}

/* Row i of the table (name, id, block, bytes) for quant.py's load-time check; returns the row
 * count, and fills nothing when i is past the end. */
int64_t quant_type_row(int64_t i, char *name, int64_t *info) {
    int64_t n = 0;
#define FERRY_QT_ROW(nm, id, block, bytes) \
    if (n++ == i) { strcpy(name, #nm); info[0] = id; info[1] = block; info[2] = bytes; }
    FERRY_QUANT_TYPES(FERRY_QT_ROW)
#undef FERRY_QT_ROW
    return n;
}
