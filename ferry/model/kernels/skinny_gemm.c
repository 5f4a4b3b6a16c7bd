/* y[M, N] = x[M, K] @ w[N, K]^T for small M (decode-sized batches) on the CPU.
 *
 * BLAS packs the weight before multiplying, which costs more than the product
 * when M is small and the weight comes from memory. Here each group of KR weight
 * rows is read in place, in order, and multiplied with all M input rows, which stay
 * in cache (f32_rows.h). Rows of w are split across threads with OpenMP (torch's own runtime).
 */
#include "f32_rows.h"
#include "ferry_kernels.h"

void skinny_gemm(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += KR)
        f32_rows(x, w + n0 * K, y + n0, M, N, K, N - n0 < KR ? (int)(N - n0) : KR);
}
