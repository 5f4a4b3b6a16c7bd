/* What quant_q8.c shares with quant_q8_tiles.c: the variant in use, one activation row quantized
 * to int8 (q[K] and a scale per 32, dx[K / 32]), and one weight row unpacked to levels q[K] with a
 * scale a and offset b per 16 weights. */
#ifndef FERRY_QUANT_Q8_H
#define FERRY_QUANT_Q8_H
#include <stdint.h>

/* ISA_AMX: AVX-512 VNNI plus AMX-INT8's tile products for packed weights at several rows. */
enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512BW, ISA_AVXVNNI, ISA_AVX512VNNI, ISA_AMX, ISA_COUNT };
int64_t quant_q8_isa(int64_t isa);
int q8_has_offset(int64_t type);
void q8_quantize_row(const float *x, int64_t K, int8_t *q, float *dx, int portable);
void q8_unpack_row(const uint8_t *row, int64_t type, int64_t K, int8_t *q, float *a, float *b, int portable);
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
/* y[M, N] = x @ w^T, w a 32-block weight packed by 16 rows (quant_q8_packed.c), x quantized with
 * what q8_packed_needs says. */
void q8_packed_needs(int64_t type, int64_t isa, int *want_u, int *want_sum, int *bsum_gs);
int64_t q8_packed_index(int64_t type, int64_t *idx); /* idx NULL: 0 when type is packed, else -1 */
void q8_packed_gemm(const uint8_t *w, int64_t type, const xrows_t *x, float *y, int64_t M, int64_t N, int64_t isa);
#endif
