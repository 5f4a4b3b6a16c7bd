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
/* Flush-to-zero and denormals-are-zero on this thread until ftz_end (the old control word): decays
 * multiplied over many tokens reach subnormal floats, each of which costs x86 a slow microcode path. */
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned ftz_begin(void) {
    const unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15) and DAZ (bit 6) */
    return old;
}
static inline void ftz_end(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned ftz_begin(void) { return 0; }
static inline void ftz_end(unsigned old) { (void)old; }
#endif
static inline float hsum(vf x) {
    float s = 0.f;
    for (int i = 0; i < V; i++) s += x[i];
    return s;
}
#endif
