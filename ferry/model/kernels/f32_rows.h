/* y[:, 0:nb] (row stride N) = x[M, K] @ w[nb, K]^T for nb <= KR weight rows: the register-blocked
 * float32 product both GEMM kernels end in (the float32 one on the weights in place, the quantized
 * one on rows it has just dequantized into an L1 buffer). Each weight row is read once per MB input
 * rows; KR x MB vector accumulators stay in registers. */
#ifndef FERRY_F32_ROWS_H
#define FERRY_F32_ROWS_H
#include "vec.h"

#define KR 4
#define MB 6

static inline __attribute__((always_inline)) void f32_block(const float *x, const float *w, float *y,
                                                            int64_t N, int64_t K, const int nr, const int mr) {
    vf acc[KR][MB];
    float tail[KR][MB] = {{0}};
    for (int r = 0; r < KR; r++)
        for (int j = 0; j < MB; j++) acc[r][j] = (vf){0};
    const int64_t kv = K - K % V;
    for (int64_t k = 0; k < kv; k += V) {
        vf xv[MB];
        for (int j = 0; j < mr; j++) xv[j] = loadv(x + j * K + k);
        for (int r = 0; r < nr; r++) {
            const vf wv = loadv(w + r * K + k);
            for (int j = 0; j < mr; j++) acc[r][j] += wv * xv[j];
        }
    }
    for (int64_t k = kv; k < K; k++)  /* K not a multiple of the vector width */
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < mr; j++) tail[r][j] += w[r * K + k] * x[j * K + k];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < mr; j++) y[j * N + r] = hsum(acc[r][j]) + tail[r][j];
}

static inline __attribute__((always_inline)) void f32_rows(const float *x, const float *w, float *y,
                                                           int64_t M, int64_t N, int64_t K, int nb) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int mb = M - m0 < MB ? (int)(M - m0) : MB;
        const float *xb = x + m0 * K;
        float *yb = y + m0 * N;
        if (nb == KR) {
            switch (mb) {  /* constant counts: the accumulators stay in registers */
                case 6: f32_block(xb, w, yb, N, K, KR, 6); break;
                case 5: f32_block(xb, w, yb, N, K, KR, 5); break;
                case 4: f32_block(xb, w, yb, N, K, KR, 4); break;
                case 3: f32_block(xb, w, yb, N, K, KR, 3); break;
                case 2: f32_block(xb, w, yb, N, K, KR, 2); break;
                default: f32_block(xb, w, yb, N, K, KR, 1);
            }
        } else {
            f32_block(xb, w, yb, N, K, nb, mb);
        }
    }
}
#endif
