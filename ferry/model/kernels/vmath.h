/* Vector math the attention kernels share: a lane max, a lane select and exp over V lanes. */
#ifndef FERRY_VMATH_H
#define FERRY_VMATH_H
#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}
typedef int32_t vi __attribute__((vector_size(V * 4)));
/* exp of V lanes (x <= 0 here): 2^n * e^r with |r| <= ln2 / 2 and a degree-6 polynomial for
 * e^r (the attention tests hold it to torch within 1e-5); below -87 it is 0 (the masked tail of a tile is -inf). gcc does not
 * vectorize expf over a short fixed count: it unrolls the loop into scalar calls. */
static inline vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vexp(vf x) {
    const vi under = x < -87.f;
    x = vselect(under, (vf){0} - 87.f, x);
    const vf n = __builtin_convertvector(__builtin_convertvector(
        x * 1.44269504f + vselect(x < 0, (vf){0} - 0.5f, (vf){0} + 0.5f), vi), vf);
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.f / 720;
    p = p * r + 1.f / 120; p = p * r + 1.f / 24; p = p * r + 1.f / 6; p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return vselect(under, (vf){0}, p * scale);
}
#endif
