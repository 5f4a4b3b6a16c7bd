/* Paged decode attention on the CPU: each query reads its request's K/V in place,
 * through the block table, instead of gathering the context into a new tensor.
 *
 * q:      [B, Hq, D]      one query token per request
 * k, v:   [S, Hkv, D]     the layer's cache, S = num_blocks * block_size slots
 * tables: [B, max_blocks] block ids of each request
 * lens:   [B]             context length of each request (the query's own token included)
 * out:    [B, Hq, D]
 * Work is split over (request, KV head) pairs with OpenMP, sharing torch's thread pool: one
 * request alone still uses every thread. Decode attention streams the whole KV context of every
 * request each step, so it is bound by memory bandwidth: one pass, each byte read once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define V 16
#else
#define V 8
#endif
typedef float vf __attribute__((vector_size(V * 4)));
#define TILE V

static inline vf loadv(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline float hsum(vf x) {
    float s = 0.f;
    for (int i = 0; i < V; i++) s += x[i];
    return s;
}
static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}
typedef int32_t vi __attribute__((vector_size(V * 4)));
/* exp of V lanes (x <= 0 here): 2^n * e^r with |r| <= ln2 / 2 and a degree-6 polynomial for
 * e^r, within 2 ulp of expf; below -87 it is 0 (the masked tail of a tile is -inf). gcc does not
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

/* Slots [j0, j1) of one request, every head, in one pass: each slot's K (then V) row, all KV
 * heads (Hkv * D floats, contiguous, as are the slots of a block), is read once, whole, which
 * the hardware prefetcher streams. A running softmax per query head, rescaled once per tile of
 * TILE slots. Writes the unnormalised output, the running max and the sum: the caller merges
 * the ranges of one request. D % V == 0 (the caller checks). */
static void one_range(const float *q, const float *k, const float *v, const int64_t *table,
                      int64_t j0, int64_t j1, float *o, float *mx, float *sum, int64_t Hq, int64_t Hkv,
                      int64_t D, int64_t block_size, float scale, vf *work) {
    const int64_t row = Hkv * D, nv = D / V, G = Hq / Hkv;
    vf *qv = work, *ov = qv + Hq * nv;
    float *p = (float *)(ov + Hq * nv);  /* [Hq][TILE] */
    for (int64_t i = 0; i < Hq * nv; i++) { qv[i] = loadv(q + i * V) * scale; ov[i] = (vf){0}; }
    for (int64_t hq = 0; hq < Hq; hq++) { mx[hq] = -INFINITY; sum[hq] = 0.f; }
    for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
        const int64_t n = j1 - t0 < TILE ? j1 - t0 : TILE;
        for (int64_t t = 0; t < n; t++) {
            const int64_t j = t0 + t;
            const float *kt = k + (table[j / block_size] * block_size + j % block_size) * row;
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float *kh = kt + hq / G * D;
                vf acc = qv[hq * nv] * loadv(kh);
                for (int64_t i = 1; i < nv; i++) acc += qv[hq * nv + i] * loadv(kh + i * V);
                p[hq * TILE + t] = hsum(acc);
            }
        }
        for (int64_t hq = 0; hq < Hq; hq++) {
            /* One vector per tile (the tail padded with -inf). */
            float *ph = p + hq * TILE;
            for (int64_t t = n; t < TILE; t++) ph[t] = -INFINITY;
            const vf sc = loadv(ph);
            const float m = fmaxf(mx[hq], hmax(sc)), corr = expf(mx[hq] - m);
            const vf e = vexp(sc - m);
            memcpy(ph, &e, sizeof e);
            sum[hq] = sum[hq] * corr + hsum(e);
            mx[hq] = m;
            for (int64_t i = 0; i < nv; i++) ov[hq * nv + i] *= corr;
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t j = t0 + t;
            const float *vt = v + (table[j / block_size] * block_size + j % block_size) * row;
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float pt = p[hq * TILE + t];
                const float *vh = vt + hq / G * D;
                for (int64_t i = 0; i < nv; i++) ov[hq * nv + i] += pt * loadv(vh + i * V);
            }
        }
    }
    for (int64_t i = 0; i < Hq * nv; i++) memcpy(o + i * V, &ov[i], sizeof(vf));
}

/* Any head size: scores for the whole context, then softmax, then V. */
static void one_group_any_d(const float *q, const float *k, const float *v, const int64_t *table,
                            int64_t L, float *o, int64_t h, int64_t G, int64_t Hkv, int64_t D,
                            int64_t block_size, float scale, float *scores) {
    const int64_t row = Hkv * D;
    for (int64_t j = 0; j < L; j++) {
        const float *kh = k + (table[j / block_size] * block_size + j % block_size) * row + h * D;
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int64_t d = 0; d < D; d++) s += q[g * D + d] * kh[d];
            scores[g * L + j] = s * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sh = scores + g * L, m = sh[0], sum = 0.f;
        for (int64_t j = 1; j < L; j++) m = sh[j] > m ? sh[j] : m;
        for (int64_t j = 0; j < L; j++) { sh[j] = expf(sh[j] - m); sum += sh[j]; }
        for (int64_t j = 0; j < L; j++) sh[j] /= sum;
    }
    for (int64_t i = 0; i < G * D; i++) o[i] = 0.f;
    for (int64_t j = 0; j < L; j++) {
        const float *vh = v + (table[j / block_size] * block_size + j % block_size) * row + h * D;
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d++) o[g * D + d] += scores[g * L + j] * vh[d];
    }
}

/* Slots per work item: long contexts are split so that one request still uses every thread. */
#define RANGE 256

void paged_decode_attention(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *lens, float *out,
                            int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale) {
    const int64_t G = Hq / Hkv;
    if (D % V) {  /* rare head sizes: the plain kernel, one (request, KV head) per item */
        int64_t max_len = 1;
        for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
        #pragma omp parallel
        {
            float *scores = malloc(sizeof(float) * G * max_len);
            #pragma omp for schedule(dynamic, 1) collapse(2)
            for (int64_t b = 0; b < B; b++)
                for (int64_t h = 0; h < Hkv; h++) {
                    const int64_t off = (b * Hq + h * G) * D;
                    one_group_any_d(q + off, k, v, tables + b * max_blocks, lens[b], out + off, h, G, Hkv,
                                    D, block_size, scale, scores);
                }
            free(scores);
        }
        return;
    }
    /* Work items: (request, range of RANGE slots); first[b] is request b's first item. */
    int64_t *first = malloc(sizeof(int64_t) * (B + 1));
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + (lens[b] + RANGE - 1) / RANGE;
    const int64_t items = first[B];
    int64_t *owner = malloc(sizeof(int64_t) * items);
    for (int64_t b = 0; b < B; b++)
        for (int64_t it = first[b]; it < first[b + 1]; it++) owner[it] = b;
    float *po = malloc(sizeof(float) * items * Hq * (D + 2)), *pm = po + items * Hq * D, *ps = pm + items * Hq;
    #pragma omp parallel
    {
        vf *work = aligned_alloc(64, sizeof(vf) * 2 * Hq * (D / V) + ((sizeof(float) * Hq * TILE + 63) / 64) * 64);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = owner[it];
            const int64_t j0 = (it - first[b]) * RANGE, j1 = j0 + RANGE < lens[b] ? j0 + RANGE : lens[b];
            one_range(q + b * Hq * D, k, v, tables + b * max_blocks, j0, j1, po + it * Hq * D,
                      pm + it * Hq, ps + it * Hq, Hq, Hkv, D, block_size, scale, work);
        }
        free(work);
        /* Merge each request's ranges: rescale to the common max, add, divide by the sum. */
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t hq = 0; hq < Hq; hq++) {
                float m = -INFINITY, total = 0.f;
                for (int64_t it = first[b]; it < first[b + 1]; it++) m = fmaxf(m, pm[it * Hq + hq]);
                float *o = out + (b * Hq + hq) * D;
                for (int64_t d = 0; d < D; d++) o[d] = 0.f;
                for (int64_t it = first[b]; it < first[b + 1]; it++) {
                    const float w = expf(pm[it * Hq + hq] - m);
                    total += w * ps[it * Hq + hq];
                    const float *src = po + (it * Hq + hq) * D;
                    for (int64_t d = 0; d < D; d++) o[d] += w * src[d];
                }
                for (int64_t d = 0; d < D; d++) o[d] /= total;
            }
    }
    free(po);
    free(owner);
    free(first);
}
