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

/* out[i] = the lane sum of x[i], for V vectors at once: a tree of V - 1 shuffle pairs and adds (each
 * level halves the lanes every vector's partial sums take), instead of V reductions one after
 * another, each waiting on its own chain of adds. */
#define VSHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
static inline vf lane_sums(const vf *x) {
#if V == 16
    vf l1[8], l2[4], l3[2];
    for (int j = 0; j < 8; j++)
        l1[j] = VSHUF(x[2 * j], x[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                VSHUF(x[2 * j], x[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        l2[j] = VSHUF(l1[2 * j], l1[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                VSHUF(l1[2 * j], l1[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        l3[j] = VSHUF(l2[2 * j], l2[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                VSHUF(l2[2 * j], l2[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return VSHUF(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           VSHUF(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf l1[4], l2[2];
    for (int j = 0; j < 4; j++)
        l1[j] = VSHUF(x[2 * j], x[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) + VSHUF(x[2 * j], x[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int j = 0; j < 2; j++)
        l2[j] = VSHUF(l1[2 * j], l1[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) + VSHUF(l1[2 * j], l1[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return VSHUF(l2[0], l2[1], 0, 2, 4, 6, 8, 10, 12, 14) + VSHUF(l2[0], l2[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}
#undef VSHUF
#endif
