/* The float vector the kernels compute with: the machine's widest (16 lanes with AVX-512, else 8),
 * through GCC's vector extensions, so one source serves both. */
#ifndef FERRY_VEC_H
#define FERRY_VEC_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define V 16
#else
#define V 8
#endif
typedef float vf __attribute__((vector_size(V * 4)));

static inline vf loadv(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline float hsum(vf x) {
    float s = 0.f;
    for (int i = 0; i < V; i++) s += x[i];
    return s;
}
#endif
