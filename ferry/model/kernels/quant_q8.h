/* What quant_q8.c shares with quant_q8_tiles.c: the variant in use, one activation row quantized
 * to int8 (q[K] and a scale per 32, dx[K / 32]), and one weight row unpacked to levels q[K] with a
 * scale a and offset b per 16 weights. */
#ifndef FERRY_QUANT_Q8_H
#define FERRY_QUANT_Q8_H
#include <stdint.h>

enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512BW, ISA_AVXVNNI, ISA_AVX512VNNI, ISA_COUNT };
int64_t quant_q8_isa(int64_t isa);
int q8_has_offset(int64_t type);
void q8_quantize_row(const float *x, int64_t K, int8_t *q, float *dx, int portable);
void q8_unpack_row(const uint8_t *row, int64_t type, int64_t K, int8_t *q, float *a, float *b, int portable);
#endif
