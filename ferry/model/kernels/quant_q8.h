/* What quant_q8.c shares with quant_q8_packed.c and int8_peak.c: the variants, M activation rows
 * quantized to int8 (q[K] and a scale per 32, dx[K / 32]), the portable products that are every
 * variant's reference, and the packed products. */
#ifndef FERRY_QUANT_Q8_H
#define FERRY_QUANT_Q8_H
#include <stdint.h>

#include "ferry_kernels.h"

/* ISA_AMX: AVX-512 VNNI plus AMX-INT8's tile products for packed weights at several rows. */
enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512BW, ISA_AVXVNNI, ISA_AVX512VNNI, ISA_AMX, ISA_COUNT };
/* M activation rows, quantized once per product. */
typedef struct {
    int8_t *q;   /* [M][K] levels */
    uint8_t *u;  /* [M][K] levels + 128: dpbusd's unsigned operand */
    float *dx;   /* [M][K / 32] block scales */
    float *xsum; /* [M][K / gs] scale times the group's levels' sum */
    int32_t *bsum; /* [M][K / bsum_gs] each group's levels' sum (for shifted weight levels) */
    int64_t K, nb, ng;
} xrows_t;

/* want_u: dpbusd on unsigned activations (VNNI variants, types without offsets); want_sum: the
 * offset types' xsum; bsum_gs: 0, or the group size of the levels' sums (shifted weight levels). */
void q8_quantize_rows(const float *x, int64_t M, int64_t K, int gs, int portable, int want_u, int want_sum,
                      int bsum_gs, xrows_t *r);
void q8_free_rows(xrows_t *r);
/* The portable q8 products of file-layout rows, one weight row and one activation row at a time. */
void q8_rows_portable(const uint8_t *w, int64_t row_bytes, int64_t type, const xrows_t *x, float *y, int64_t M,
                      int64_t N);
/* y[M, N] = x @ w^T in q8 mode, type | FERRY_QT_PACKED for a weight packed by 16 rows (quant_gemm's q8 products). */
void quant_q8_gemm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type);
/* y[M, N] = x @ w^T, w a weight packed by 16 rows (quant_q8_packed.c), x quantized with what
 * q8_packed_needs says. */
void q8_packed_needs(int64_t type, int64_t isa, int *want_u, int *want_sum, int *bsum_gs);
void q8_packed_gemm(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N, int64_t isa);
#endif
