/* y[M, N] = x[M, K] @ w[N, K]^T for small M (decode-sized batches) on the CPU.
 *
 * BLAS packs the weight before multiplying, which costs more than the product
 * when M is small and the weight comes from memory. Here each weight row is read
 * once, in order, and multiplied with all M input rows, which stay in cache.
 * Register blocking: 4 weight rows x 3 input rows = 12 vector accumulators.
 * Rows of w are split across threads with OpenMP (torch's own runtime).
 * Requires K % 8 == 0 (the caller checks).
 */
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#define NR 4
#define MR 3

/* One block of nr weight rows x mr input rows. Inlined with constant nr and mr at
 * each call site, so the compiler keeps all accumulators in registers. */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, float *y,
                                                        int64_t N, int64_t K, const int nr, const int mr) {
    v8 acc[NR][MR] = {{{0}}};
    for (int64_t k = 0; k < K; k += 8) {
        v8 xv[MR];
        for (int j = 0; j < mr; j++) xv[j] = load8(x + j * K + k);
        for (int r = 0; r < nr; r++) {
            const v8 wv = load8(w + r * K + k);
            for (int j = 0; j < mr; j++) acc[r][j] += wv * xv[j];
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < mr; j++) y[j * N + r] = hsum(acc[r][j]);
}

void skinny_gemm(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        const int nb = N - n0 < NR ? (int)(N - n0) : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mb = M - m0 < MR ? (int)(M - m0) : MR;
            const float *xb = x + m0 * K, *wb = w + n0 * K;
            float *yb = y + m0 * N + n0;
            if (nb == NR && mb == 3) block(xb, wb, yb, N, K, NR, 3);
            else if (nb == NR && mb == 2) block(xb, wb, yb, N, K, NR, 2);
            else if (nb == NR) block(xb, wb, yb, N, K, NR, 1);
            else block(xb, wb, yb, N, K, nb, mb); /* the last rows of an N not divisible by NR */
        }
    }
}
