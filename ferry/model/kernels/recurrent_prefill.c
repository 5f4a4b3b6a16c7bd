/* The prefill chunk's work of the recurrent layers, where torch takes many passes or many small
 * calls: the causal depthwise convolution over a chunk's rows (one pass, the window read in place of
 * a concatenation), and the chunk-parallel gated delta rule of Qwen3.5's Gated DeltaNet (each head's
 * chunks in turn on one thread, every block of a chunk in cache: one parallel region per layer).
 * The same arithmetic as the torch parts in ferry/model/layers (recurrent.py, gated_deltanet.py), up
 * to the order of sums.
 *
 * A convolution's window is kept time-major, [K - 1, channels]: the last K - 1 inputs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_kernels.h"
#include "row_ops.h"
#include "vec.h"
#include "vmath.h"

/* Below this many rows one thread does the convolution: waking the pool costs more than the work. */
#define PARALLEL_ROWS 16

static inline float silu1(float g) {
    const float e = expf(-fabsf(g)); /* <= 1: no overflow, which fast math does not handle */
    return g * ((g < 0.f ? e : 1.f) / (1.f + e));
}

/* Row r of (window; x): the window's rows first, then x's. */
static inline const float *conv_input(const float *x, int64_t x_stride, const float *window, int64_t r, int64_t C,
                                      int64_t K) {
    return r < K - 1 ? window + r * C : x + (r - (K - 1)) * x_stride;
}

/* y[t, c] = act(bias[c] + sum_j w[j, c] * (window; x)[t + j, c]) for T rows of C channels: x rows
 * x_stride floats apart, window [K - 1, C] the inputs before them, taps w time-major [K, C] (oldest
 * first), bias [C] or NULL, act SiLU when silu, y [T, C] contiguous; new_window [K - 1, C] gets the
 * last K - 1 rows of (window; x). */
void conv_rows(const float *x, int64_t x_stride, const float *window, const float *w, const float *bias, float *y,
               float *new_window, int64_t T, int64_t C, int64_t K, int64_t silu) {
    const int64_t cv = C - C % V;
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *yt = y + t * C;
        for (int64_t c = 0; c < cv; c += V) {
            vf acc = bias ? loadv(bias + c) : (vf){0};
            for (int64_t j = 0; j < K; j++)
                acc += loadv(w + j * C + c) * loadv(conv_input(x, x_stride, window, t + j, C, K) + c);
            if (silu) acc = vsilu(acc);
            memcpy(yt + c, &acc, sizeof acc);
        }
        for (int64_t c = cv; c < C; c++) {
            float acc = bias ? bias[c] : 0.f;
            for (int64_t j = 0; j < K; j++) acc += w[j * C + c] * conv_input(x, x_stride, window, t + j, C, K)[c];
            yt[c] = silu ? silu1(acc) : acc;
        }
    }
    for (int64_t r = 0; r < K - 1; r++)
        memcpy(new_window + r * C, conv_input(x, x_stride, window, T + r, C, K), sizeof(float) * C);
}

#define MR 4
#define NR (2 * V)

/* c = alpha * A B + beta * c for one MR x NR tile (beta 0: c is not read). B's two vectors of a row
 * are loaded once for the four rows (the asm keeps gcc from folding them into each multiply-add). */
static inline void gemm_tile4(int64_t K, const float *A, int64_t as, int64_t ap, const float *B, int64_t ldb,
                              float *c, int64_t ldc, float alpha, float beta) {
    vf c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
    const float *a0 = A, *a1 = A + as, *a2 = A + 2 * as, *a3 = A + 3 * as;
    for (int64_t p = 0; p < K; p++, B += ldb) {
        vf b0 = loadv(B), b1 = loadv(B + V);
        __asm__("" : "+x"(b0), "+x"(b1));
        const int64_t o = p * ap;
        c00 += a0[o] * b0, c01 += a0[o] * b1;
        c10 += a1[o] * b0, c11 += a1[o] * b1;
        c20 += a2[o] * b0, c21 += a2[o] * b1;
        c30 += a3[o] * b0, c31 += a3[o] * b1;
    }
    const vf acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    for (int r = 0; r < MR; r++)
        for (int x = 0; x < 2; x++) {
            vf y = alpha * acc[r][x];
            if (beta != 0.f) y += beta * loadv(c + r * ldc + x * V);
            memcpy(c + r * ldc + x * V, &y, sizeof y);
        }
}

/* One element of the product, for the edges the tiles leave. */
static inline void gemm_one(int64_t K, const float *A, int64_t as, int64_t ap, const float *B, int64_t ldb, float *c,
                            float alpha, float beta, int64_t i, int64_t j) {
    float s = 0.f;
    for (int64_t p = 0; p < K; p++) s += A[i * as + p * ap] * B[p * ldb + j];
    *c = alpha * s + (beta != 0.f ? beta * *c : 0.f);
}

/* C [M, N] = alpha * A B + beta * C: A's element (i, p) at A[i * as + p * ap] (row-major or
 * transposed), B [K, N] row-major (ldb), C row-major (ldc); beta 0 does not read C. With lower, each
 * row block stops at the tile that holds its last row's diagonal: a lower-triangular result (and some). */
static void gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t as, int64_t ap, const float *B, int64_t ldb,
                 float *C, int64_t ldc, float alpha, float beta, int lower) {
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
        const int64_t rows = M - i0 < MR ? M - i0 : MR;
        const int64_t up = (i0 + rows + NR - 1) / NR * NR, n = lower && up < N ? up : N;
        const int64_t nv = rows == MR ? n - n % NR : 0;
        for (int64_t j0 = 0; j0 < nv; j0 += NR)
            gemm_tile4(K, A + i0 * as, as, ap, B + j0, ldb, C + i0 * ldc + j0, ldc, alpha, beta);
        for (int64_t i = i0; i < i0 + rows; i++)
            for (int64_t j = nv; j < n; j++) gemm_one(K, A, as, ap, B, ldb, C + i * ldc + j, alpha, beta, i, j);
    }
}

/* Rows i0 .. i0 + 3 of x (columns c .. c + 2V) less what rows 0 .. i0 - 1 (final already) and then
 * each other contribute: each load of an earlier row serves the four. */
static inline void solve_rows4(const float *L, int64_t ldl, float *x, int64_t ldx, int64_t i0, int64_t c) {
    vf a[4][2];
    for (int r = 0; r < 4; r++) {
        a[r][0] = loadv(x + (i0 + r) * ldx + c);
        a[r][1] = loadv(x + (i0 + r) * ldx + c + V);
    }
    for (int64_t j = 0; j < i0; j++) {
        const vf x0 = loadv(x + j * ldx + c), x1 = loadv(x + j * ldx + c + V);
        for (int r = 0; r < 4; r++) {
            const float l = L[(i0 + r) * ldl + j];
            a[r][0] -= l * x0;
            a[r][1] -= l * x1;
        }
    }
    for (int r = 1; r < 4; r++)
        for (int s = 0; s < r; s++) {
            const float l = L[(i0 + r) * ldl + i0 + s];
            a[r][0] -= l * a[s][0];
            a[r][1] -= l * a[s][1];
        }
    for (int r = 0; r < 4; r++) {
        memcpy(x + (i0 + r) * ldx + c, &a[r][0], sizeof(vf));
        memcpy(x + (i0 + r) * ldx + c + V, &a[r][1], sizeof(vf));
    }
}

/* x [n, W] (rows ldx apart) <- (I + L)^-1 x in place, L the strict lower triangle of [n, n] (rows
 * ldl apart; its diagonal and above are not read): forward substitution. */
static void solve_block(const float *L, int64_t ldl, float *x, int64_t ldx, int64_t n, int64_t W) {
    const int64_t cw = W - W % (2 * V), ci = n - n % 4;
    for (int64_t i0 = 0; i0 < ci; i0 += 4)
        for (int64_t c = 0; c < cw; c += 2 * V) solve_rows4(L, ldl, x, ldx, i0, c);
    for (int64_t i = ci; i < n; i++) /* the last rows, when n is not a multiple of 4 */
        for (int64_t c = 0; c < cw; c++)
            for (int64_t j = 0; j < i; j++) x[i * ldx + c] -= L[i * ldl + j] * x[j * ldx + c];
    for (int64_t i = 1; i < n; i++) /* the last columns, when W is not a multiple of 2V */
        for (int64_t c = cw; c < W; c++)
            for (int64_t j = 0; j < i; j++) x[i * ldx + c] -= L[i * ldl + j] * x[j * ldx + c];
}

/* d[j] = exp(cum[i] - cum[j]) for j < n (cum non-increasing: every argument <= 0 for j <= i). */
static inline void decays(const float *cum, int64_t i, int64_t n, float *d) {
    int64_t j = 0;
    for (; j + V <= n; j += V) {
        vf x = cum[i] - loadv(cum + j);
        x = vselect(x > 0, (vf){0}, x);
        const vf y = vexp(x);
        memcpy(d + j, &y, sizeof y);
    }
    for (; j < n; j++) d[j] = expf(fminf(cum[i] - cum[j], 0.f));
}

/* n floats of x into y, times r; with norm, r / sqrt(sum x^2 + 1e-6) (gated_deltanet.py's l2norm). */
static inline void load_row(const float *x, float *y, int64_t n, float r, int norm) {
    if (norm) {
        float ss = 0.f;
        for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
        r /= sqrtf(ss + 1e-6f);
    }
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r;
}

/* Value head h's chunks, in order, from its state; w: the thread's scratch. */
static void gdn_head(const float *q, const float *k, const float *v, const float *g, const float *beta,
                     const float *state_in, float *state_out, float *out, const int64_t *shape, int64_t h, float *w) {
    const int64_t T = shape[0], hv = shape[1], dk = shape[2], dv = shape[3], C = shape[4];
    const int64_t qk_stride = shape[5], v_stride = shape[6], gb_stride = shape[7], out_stride = shape[8];
    const int64_t hk = shape[9], norm = shape[11];
    /* llama.cpp tiles value heads over q/k heads, HF groups them */
    const int64_t kh = shape[10] ? h % hk : h / (hv / hk);
    const float q_scale = norm ? 1.f / sqrtf((float)dk) : 1.f;
    float *Kc = w, *Qc = Kc + C * dk, *Kt = Qc + C * dk, *A = Kt + dk * C, *P = A + C * C, *W = P + C * C;
    float *U = W + C * dk, *S = U + C * dv, *cum = S + dk * dv, *bt = cum + C, *d = bt + C;
    memcpy(S, state_in + h * dk * dv, sizeof(float) * dk * dv);
    for (int64_t t0 = 0; t0 < T; t0 += C) {
        const int64_t L = T - t0 < C ? T - t0 : C;
        for (int64_t r = 0; r < L; r++) {
            const int64_t t = t0 + r;
            load_row(k + t * qk_stride + kh * dk, Kc + r * dk, dk, 1.f, norm);
            load_row(q + t * qk_stride + kh * dk, Qc + r * dk, dk, q_scale, norm);
            for (int64_t p = 0; p < dk; p++) Kt[p * C + r] = Kc[r * dk + p];
            cum[r] = (r ? cum[r - 1] : 0.f) + g[t * gb_stride + h];
            bt[r] = beta[t * gb_stride + h];
        }
        /* the UT transform's matrix and the in-chunk scores, lower triangles */
        gemm(L, C, dk, Kc, dk, 1, Kt, C, A, C, 1.f, 0.f, 1);
        gemm(L, C, dk, Qc, dk, 1, Kt, C, P, C, 1.f, 0.f, 1);
        for (int64_t i = 0; i < L; i++) {
            decays(cum, i, i + 1, d);
            for (int64_t j = 0; j < i; j++) A[i * C + j] *= bt[i] * d[j];
            for (int64_t j = 0; j <= i; j++) P[i * C + j] *= d[j];
            for (int64_t j = i + 1; j < L; j++) P[i * C + j] = 0.f;
        }
        for (int64_t r = 0; r < L; r++) {
            const float *vr = v + (t0 + r) * v_stride + h * dv;
            const float kb = bt[r] * expf(cum[r]);
            for (int64_t p = 0; p < dk; p++) W[r * dk + p] = Kc[r * dk + p] * kb;
            for (int64_t p = 0; p < dv; p++) U[r * dv + p] = vr[p] * bt[r];
        }
        solve_block(A, C, W, dk, L, dk);
        solve_block(A, C, U, dv, L, dv);
        gemm(L, dv, dk, W, dk, 1, S, dv, U, dv, -1.f, 1.f, 0); /* U: the corrections the state leaves */
        for (int64_t r = 0; r < L; r++) {
            const float e = expf(cum[r]), kd = expf(cum[L - 1] - cum[r]);
            for (int64_t p = 0; p < dk; p++) Qc[r * dk + p] *= e, Kc[r * dk + p] *= kd;
        }
        float *o = out + t0 * out_stride + h * dv;
        gemm(L, dv, dk, Qc, dk, 1, S, dv, o, out_stride, 1.f, 0.f, 0);
        gemm(L, dv, L, P, C, 1, U, dv, o, out_stride, 1.f, 1.f, 0);
        gemm(dk, dv, L, Kc, 1, dk, U, dv, S, dv, 1.f, expf(cum[L - 1]), 0);
    }
    memcpy(state_out + h * dk * dv, S, sizeof(float) * dk * dv);
}

/* The gated delta rule over T tokens of hv value heads, chunk-parallel (shape[4] tokens a block).
 * q, k: [T, hk, dk] (rows shape[5] floats apart), L2-normed here when shape[11] (q then also scaled
 * by dk^-0.5); value head h reads q/k head h % hk when shape[10] (tiled), else h / (hv / hk);
 * v: [T, hv, dv] (rows shape[6] apart); g (log decay), beta: [T, hv] (rows shape[7] apart);
 * out: [T, hv, dv] (rows shape[8] apart); the state [hv, dk, dv] (out = q S) from state_in into
 * state_out. shape: T, hv, dk, dv, chunk, the four strides, hk, tiled, norm. Each thread takes
 * whole heads. Returns 0, or 1 when out of memory. */
int gdn_prefill(const float *q, const float *k, const float *v, const float *g, const float *beta,
                const float *state_in, float *state_out, float *out, const int64_t *shape) {
    const int64_t H = shape[1], dk = shape[2], dv = shape[3], C = shape[4];
    const size_t floats = 3 * C * dk + 2 * C * C + C * dk + C * dv + dk * dv + 3 * C + V;
    int oom = 0;
    #pragma omp parallel
    {
        const unsigned csr = ftz_begin();
        float *w = malloc(sizeof(float) * floats);
        if (!w) {
            #pragma omp atomic write
            oom = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t h = 0; h < H; h++)
            if (w) gdn_head(q, k, v, g, beta, state_in, state_out, out, shape, h, w);
        free(w);
        ftz_end(csr);
    }
    return oom;
}
