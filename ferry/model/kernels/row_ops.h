/* The per-row operations of a decoder layer (RMS norm, rope, the MLP's gated activation), shared
 * by the fused decode (decode_layers.c) and the prefill path (row_ops.c), so a token's row gets
 * the same bits whichever path computes it. */
#ifndef FERRY_ROW_OPS_H
#define FERRY_ROW_OPS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"
#include "vmath.h"

/* Hugging Face's LlamaRMSNorm over B rows of H: x * rsqrt(mean(x^2) + eps) * w. */
static inline void rms_norm(const float *x, const float *w, float *out, int64_t B, int64_t H, float eps) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * H;
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += xb[i] * xb[i];
        const float r = 1.f / sqrtf(ss / H + eps);
        for (int64_t i = 0; i < H; i++) out[b * H + i] = xb[i] * r * w[i];
    }
}

/* Hugging Face's half-split rope on each head of a row: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
 * V pairs at a time where the half-head allows (gcc does not vectorize the loop: x may alias c). */
static inline void rope(float *v, int64_t heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2, vhalf = half % V ? 0 : half;
    for (int64_t h = 0; h < heads; h++) {
        float *x = v + h * D;
        for (int64_t i = 0; i < vhalf; i += V) {
            const vf x1 = loadv(x + i), x2 = loadv(x + i + half);
            const vf y1 = x1 * loadv(c + i) - x2 * loadv(s + i), y2 = x2 * loadv(c + i + half) + x1 * loadv(s + i + half);
            memcpy(x + i, &y1, sizeof y1);
            memcpy(x + i + half, &y2, sizeof y2);
        }
        for (int64_t i = vhalf; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
    }
}

/* SiLU of V lanes: g * sigmoid(g), the sigmoid from e = exp(-|g|) <= 1 (vexp takes x <= 0):
 * 1 / (1 + e) for g >= 0, e / (1 + e) below. */
static inline vf vsilu(vf g) {
    const vi neg = g < 0;
    const vf e = vexp(vselect(neg, g, -g));
    return g * (vselect(neg, e, (vf){0} + 1.f) / (1.f + e));
}

/* One row of the gated MLP: out[i] = act(gu[i]) * gu[I + i], act SiLU (SwiGLU) or, with gelu,
 * tanh-approximated GELU (GeGLU). */
static inline void gated_act(const float *gu, float *out, int64_t I, int64_t gelu) {
    int64_t i0 = 0;
    if (!gelu)
        for (; i0 + V <= I; i0 += V) {
            const vf y = vsilu(loadv(gu + i0)) * loadv(gu + I + i0);
            memcpy(out + i0, &y, sizeof y);
        }
    for (int64_t i = i0; i < I; i++) {
        const float g = gu[i];
        const float e = expf(-fabsf(g));  /* <= 1: no overflow, which fast math does not handle */
        const float a = gelu ? 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)))
                             : g * ((g < 0.f ? e : 1.f) / (1.f + e));
        out[i] = a * gu[I + i];
    }
}
#endif
