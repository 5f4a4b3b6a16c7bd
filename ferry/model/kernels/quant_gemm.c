/* Products with GGUF-quantized weights on the CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T.
 *
 * Exact mode: activations stay float32 and each weight is dequantized exactly as the gguf
 * library does (quant_dequant.c), so the result is the float32 model's up to the order of the
 * sums. Weights stay in the file's own blocks (quant_types.h), so every type takes one path: KR
 * weight rows at a time are dequantized into a small buffer that stays in L1/L2, then the
 * register-blocked float32 product of f32_rows.h runs over all input rows. Threads split the
 * weight rows (OpenMP, torch's own runtime). The win is memory: a decode step is bound by
 * streaming the weights, 4.5 bits each for Q4_K instead of 32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "f32_rows.h"
#include "ferry_kernels.h"
#include "quant_q8.h"
#include "quant_types.h"
#include "vec.h"

/* y[M, N] = x[M, K] @ dequant(w)[N, K]^T; K a multiple of the type's block (the caller checks).
 * type | FERRY_QT_Q8: activations quantized to int8 and integer dot products at every M
 * (quant_q8.c, quant_q8_packed.c), each row's result independent of the others. */
void quant_gemm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type) {
    if (type & FERRY_QT_Q8) {
        quant_q8_gemm(x, w, y, M, N, K, type & ~(int64_t)FERRY_QT_Q8);
        return;
    }
    const int64_t row_bytes = K / qt_block(type) * qt_bytes(type);
    #pragma omp parallel
    {
        float wbuf[KR * K];
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += KR) {
            const int nb = N - n0 < KR ? (int)(N - n0) : KR;
            for (int r = 0; r < nb; r++) quant_dequant_row(w + (n0 + r) * row_bytes, wbuf + r * K, K, type);
            f32_rows(x, wbuf, y + n0, M, N, K, nb);
        }
    }
}

/* out[i, K] = dequant(w)[ids[i]] (all rows when ids is NULL, n = N): embeddings, and the
 * whole matrix for products with many rows, which BLAS does best. */
void quant_dequant(const uint8_t *w, const int64_t *ids, float *out, int64_t n, int64_t K, int64_t type) {
    const int64_t row_bytes = K / qt_block(type) * qt_bytes(type);
    #pragma omp parallel for schedule(static) if (n > 64)
    for (int64_t i = 0; i < n; i++) quant_dequant_row(w + (ids ? ids[i] : i) * row_bytes, out + i * K, K, type);
}
