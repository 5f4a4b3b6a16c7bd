/* One decode token of a recurrent layer for B rows, each its own request's state slot: the fused
 * decode's ops for hybrid models (decode_layers.c calls them). The same arithmetic as the torch
 * parts in ferry/model/layers (gated_deltanet.py), up to the order of sums.
 *
 * A convolution's window is kept time-major, [K - 1, channels]: the last K - 1 inputs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_kernels.h"
#include "vec.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y[c] = act(sum_j w[c, j] * (window; x)[j][c]) for one row, and the window moves on by x. */
static void conv_step(const float *x, float *y, float *window, const float *w, const float *bias, int64_t C,
                      int64_t K, int act_silu) {
    for (int64_t c = 0; c < C; c++) {
        float acc = bias ? bias[c] : 0.0f;
        for (int64_t j = 0; j < K - 1; j++) acc += w[c * K + j] * window[j * C + c];
        acc += w[c * K + K - 1] * x[c];
        y[c] = act_silu ? silu(acc) : acc;
    }
    if (K > 1) {
        memmove(window, window + C, sizeof(float) * (K - 2) * C);
        memcpy(window + (K - 2) * C, x, sizeof(float) * C);
    }
}

static void l2norm(float *x, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] *= r;
}

/* Gated DeltaNet. in: B rows of [q (hk*dk) | k (hk*dk) | v (hv*dv) | z (hv*dv) | b (hv) | a (hv)]
 * (in_stride floats apart); out: B rows of the gated-normed heads [hv*dv]. windows: [slots, K-1,
 * conv_dim]; states: [slots, hv, dk, dv] (out = q @ S); tiled: value head h reads q/k head h % hk
 * (llama.cpp's order), else h / (hv / hk). Returns 0, or 1 when out of memory. */
int gdn_decode(const float *in, int64_t in_stride, float *out, int64_t out_stride, int64_t B, const int64_t *slots,
               float *windows, float *states, const float *conv_w, const float *neg_a, const float *dt_bias,
               const float *norm_w, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t K, int64_t tiled,
               float eps) {
    const int64_t kd = hk * dk, C = 2 * kd + hv * dv;
    float *y = malloc(sizeof(float) * B * C);
    if (!y) return 1;
    for (int64_t b = 0; b < B; b++) {
        float *yb = y + b * C;
        conv_step(in + b * in_stride, yb, windows + slots[b] * (K - 1) * C, conv_w, NULL, C, K, 1);
        for (int64_t h = 0; h < hk; h++) {
            l2norm(yb + h * dk, dk, 1.0f / sqrtf((float)dk));
            l2norm(yb + kd + h * dk, dk, 1.0f);
        }
    }
    const int64_t per = hv / hk;
#pragma omp parallel if (B * hv >= 4)
    {
    const unsigned csr = ftz_begin();
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * hv; bh++) {
        const int64_t b = bh / hv, h = bh % hv;
        const float *yb = y + b * C, *row = in + b * in_stride;
        const int64_t kh = tiled ? h % hk : h / per; /* llama.cpp tiles value heads over q/k heads, HF groups them */
        const float *q = yb + kh * dk, *k = yb + kd + kh * dk, *v = yb + 2 * kd + h * dv;
        const float *z = row + C + h * dv;
        const float decay = expf(neg_a[h] * softplus(row[C + hv * dv + hv + h] + dt_bias[h]));
        const float beta = 1.0f / (1.0f + expf(-row[C + hv * dv + h]));
        float *S = states + (slots[b] * hv + h) * dk * dv;
        float rem[dv], delta[dv], o[dv];
        for (int64_t j = 0; j < dv; j++) rem[j] = 0.0f, o[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = k[i];
            const float *Si = S + i * dv;
            for (int64_t j = 0; j < dv; j++) rem[j] += ki * Si[j];
        }
        for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - decay * rem[j]) * beta;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = k[i], qi = q[i];
            float *Si = S + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                const float s = decay * Si[j] + ki * delta[j];
                Si[j] = s;
                o[j] += qi * s;
            }
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < dv; j++) ss += o[j] * o[j];
        const float r = 1.0f / sqrtf(ss / dv + eps);
        float *ob = out + b * out_stride + h * dv;
        for (int64_t j = 0; j < dv; j++) ob[j] = norm_w[j] * (o[j] * r) * silu(z[j]);
    }
    ftz_end(csr);
    }
    free(y);
    return 0;
}

/* LFM2's gated short convolution. in: B rows of [b (H) | c (H) | x (H)]; out: B rows of
 * c * conv(b * x) [H]. windows: [slots, K-1, H] of b * x. Returns 0, or 1 when out of memory. */
int short_conv_decode(const float *in, int64_t in_stride, float *out, int64_t out_stride, int64_t B,
                      const int64_t *slots, float *windows, const float *conv_w, const float *conv_b, int64_t H,
                      int64_t K) {
    float *bx = malloc(sizeof(float) * H);
    if (!bx) return 1;
    for (int64_t b = 0; b < B; b++) {
        const float *row = in + b * in_stride;
        float *o = out + b * out_stride;
        for (int64_t c = 0; c < H; c++) bx[c] = row[c] * row[2 * H + c];
        conv_step(bx, o, windows + slots[b] * (K - 1) * H, conv_w, conv_b, H, K, 0);
        for (int64_t c = 0; c < H; c++) o[c] *= row[H + c];
    }
    free(bx);
    return 0;
}

/* Mamba2 (SSD). in: B rows of [z (inner) | xBC (inner + 2 G N) | dt (H)]; out: B rows of
 * w * rms_norm(y * silu(z)) per group of inner / G channels. windows: [slots, K-1, inner + 2 G N];
 * states: [slots, H, P, N]. params: dt_bias [H], A [H] (-exp(A_log)), D [H], then dt's clamp (lo, hi).
 * shape: inner, G, N, H, P, K. Returns 0, or 1 when out of memory. */
int mamba2_decode(const float *in, int64_t in_stride, float *out, int64_t out_stride, int64_t B, const int64_t *slots,
                  float *windows, float *states, const float *conv_w, const float *conv_b, const float *params,
                  const float *norm_w, const int64_t *shape, float eps) {
    const int64_t inner = shape[0], G = shape[1], N = shape[2], H = shape[3], P = shape[4], K = shape[5];
    const int64_t C = inner + 2 * G * N, per = H / G;
    const float *dt_bias = params, *A = params + H, *Dskip = params + 2 * H, lo = params[3 * H], hi = params[3 * H + 1];
    float *xbc = malloc(sizeof(float) * B * C), *y = malloc(sizeof(float) * B * inner);
    if (!xbc || !y) {
        free(xbc);
        free(y);
        return 1;
    }
    for (int64_t b = 0; b < B; b++)
        conv_step(in + b * in_stride + inner, xbc + b * C, windows + slots[b] * (K - 1) * C, conv_w, conv_b, C, K, 1);
#pragma omp parallel if (B * H >= 4)
    {
    const unsigned csr = ftz_begin();
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H, g = h / per;
        const float *x = xbc + b * C + h * P, *Bv = xbc + b * C + inner + g * N, *Cv = Bv + G * N;
        float dt = softplus(in[b * in_stride + inner + C + h] + dt_bias[h]);
        dt = dt < lo ? lo : (dt > hi ? hi : dt);
        const float dA = expf(dt * A[h]);
        float *S = states + (slots[b] * H + h) * P * N, *yb = y + b * inner + h * P;
        for (int64_t p = 0; p < P; p++) {
            const float dx = dt * x[p];
            float acc = 0.0f;
            float *Sp = S + p * N;
            for (int64_t n = 0; n < N; n++) {
                const float s = Sp[n] * dA + dx * Bv[n];
                Sp[n] = s;
                acc += s * Cv[n];
            }
            yb[p] = acc + Dskip[h] * x[p];
        }
    }
    ftz_end(csr);
    }
    const int64_t gw = inner / G;
    for (int64_t b = 0; b < B; b++) {
        const float *z = in + b * in_stride;
        float *yb = y + b * inner, *ob = out + b * out_stride;
        for (int64_t c = 0; c < inner; c++) yb[c] *= silu(z[c]);
        for (int64_t g = 0; g < G; g++) {
            float ss = 0.0f;
            for (int64_t c = g * gw; c < (g + 1) * gw; c++) ss += yb[c] * yb[c];
            const float r = 1.0f / sqrtf(ss / gw + eps);
            for (int64_t c = g * gw; c < (g + 1) * gw; c++) ob[c] = norm_w[c] * yb[c] * r;
        }
    }
    free(xbc);
    free(y);
    return 0;
}
