/* Paged decode attention on the CPU: each query reads its request's K/V in place,
 * through the block table, instead of gathering the context into a new tensor.
 *
 * q:      [B, Hq, D]      one query token per request
 * k, v:   [S, Hkv, D]     the layer's cache, S = num_blocks * block_size slots, of type kv:
 *                         KV_F32, KV_BF16 or KV_F16 (16-bit caches are widened to float32 as read)
 * tables: [B, max_blocks] block ids of each request
 * lens:   [B]             context length of each request (the query's own token included)
 * out:    [B, Hq, D]
 * sinks:  [Hq] or NULL: each query head's sink logit, which joins every softmax denominator and
 *         adds no value (gpt-oss); the merge of a request's ranges starts from it
 * Work is split over (request, range of slots) items with OpenMP, sharing torch's thread pool:
 * one long request alone still uses every thread. Decode attention streams the whole KV context of every
 * request each step, so it is bound by memory bandwidth: one pass, each byte read once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_kernels.h"
#include "vec.h"
#include "kv_types.h"
#include "vmath.h"
#define TILE V
/* Slots per work item: long contexts are split so that one request still uses every thread. */
#define RANGE 256

/* How a request's L slots split into work items: ranges of at most RANGE slots, and at least two
 * past 64 slots so that one request alone keeps two cores busy. The split depends on L only, so a
 * request's attention has the same bits however it is batched. */
static inline int64_t n_ranges(int64_t L) {
    const int64_t n = (L + RANGE - 1) / RANGE;
    return n > 1 || L <= 64 ? n : 2;
}
static inline int64_t range_span(int64_t L) {
    const int64_t n = n_ranges(L), s = (L + n - 1) / n;
    return (s + TILE - 1) / TILE * TILE;
}

/* Byte offsets of slots [j0, j1) into a cache row array, walked block by block: no division per
 * key (block_size is a runtime value, and a 64-bit division costs tens of cycles). */
static inline void slot_offsets(const int64_t *table, int64_t j0, int64_t j1, int64_t block_size, int64_t bytes,
                                int64_t *off) {
    int64_t j = j0, blk = j0 / block_size, r = j0 % block_size;
    for (; j < j1; blk++, r = 0)
        for (const int64_t base = table[blk] * block_size; r < block_size && j < j1; r++, j++)
            off[j - j0] = (base + r) * bytes;
}

/* Prefetch the K and V rows of a range's first slots: the first near ones into L1, the rest up to
 * far into L2, where the score loop's own prefetches start. */
static inline __attribute__((always_inline)) void prefetch_first(
        const void *k, const void *v, const int64_t *off, int64_t near, int64_t far, int64_t bytes) {
    for (int64_t j = 0; j < far; j++)
        for (int64_t i = 0; i < bytes; i += 64) {
            if (j < near) {
                __builtin_prefetch((const char *)k + off[j] + i);
                __builtin_prefetch((const char *)v + off[j] + i);
            } else {
                __builtin_prefetch((const char *)k + off[j] + i, 0, 1);
                __builtin_prefetch((const char *)v + off[j] + i, 0, 1);
            }
        }
}
/* Slots asked for ahead of the one being read, a head's rows at a time inside the score loop, in
 * two steps: into L2 PF_FAR slots ahead (locality 1, prefetcht2, which x86 CPUs fill into L2; L2
 * tracks many more misses in flight than L1, whose miss buffers a far stream into L1 fills: Zen 4,
 * 16 requests x 192 slots 5.4 -> 3.7 ms a step of 30 layers, 64 x 1024 110 -> 74 ms; prefetcht1
 * measured no better), then into L1 PF_DIST ahead, from L2 (L1 prefetches alone were best on a
 * Zen 5 at 12 slots; there a burst of a whole tile's rows into L1 once per tile stalled on the miss
 * buffers). */
#define PF_DIST 4
#define PF_FAR 16

/* Slots [j0, j1) of one request (at most RANGE), every head, in two passes: the scores of every
 * slot first (per tile of TILE slots, the tile's K rows of all KV heads read whole: a block's
 * slots are contiguous, which the hardware prefetcher streams; each key's G dot products summed
 * TILE keys at a time by lane_sums), then one softmax per query head over the range (its max and
 * sum vector-wide, no rescaling per tile), then the V rows the same way. G and NV (= D / V) are
 * constants at each call site, so a head group's query and output vectors sit in registers. o,
 * mx, sum: per query head, the unnormalised output, max and sum (the caller merges the ranges of
 * one request). */
static inline __attribute__((always_inline)) void one_range(
        const void *k, const void *v, const float *q, const int64_t *table, int64_t j0, int64_t j1,
        float *o, float *mx, float *sum, int64_t Hkv, int64_t block_size, float scale, const int G, const int NV,
        const int kv) {
    const int64_t D = NV * V, row = Hkv * D, nt = (j1 - j0 + TILE - 1) / TILE;
    float sc[Hkv * G][RANGE] __attribute__((aligned(64)));  /* scores, then their exponentials */
    int64_t off[RANGE];  /* byte offset of each slot's row */
    slot_offsets(table, j0, j1, block_size, kv_bytes(row, kv), off);
    vi lane;
    for (int i = 0; i < V; i++) lane[i] = i;
    const int64_t L = j1 - j0, hb = kv_bytes(D, kv);
    prefetch_first(k, v, off, PF_DIST < L ? PF_DIST : L, PF_FAR < L ? PF_FAR : L, kv_bytes(row, kv));
    for (int64_t it = 0; it < nt; it++) {
        const int64_t t0 = j0 + it * TILE, n = j1 - t0 < TILE ? j1 - t0 : TILE;
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t ho = kv_bytes(h * D, kv);  /* head h's bytes into a slot's row */
            vf qv[G][NV], part[G][TILE];
            for (int g = 0; g < G; g++)
                for (int i = 0; i < NV; i++) qv[g][i] = loadv(q + (h * G + g) * D + i * V) * scale;
            for (int64_t t = 0; t < TILE; t++) {
                if (t >= n) {
                    for (int g = 0; g < G; g++) part[g][t] = (vf){0};
                    continue;
                }
                const int64_t pj = t0 - j0 + t + PF_DIST, pf = t0 - j0 + t + PF_FAR;
                if (pj < L) /* head h's K and V rows of the slot PF_DIST on, into L1 */
                    for (int64_t i = 0; i < hb; i += 64) {
                        __builtin_prefetch((const char *)k + off[pj] + ho + i);
                        __builtin_prefetch((const char *)v + off[pj] + ho + i);
                    }
                if (pf < L) /* and PF_FAR on, into L2 */
                    for (int64_t i = 0; i < hb; i += 64) {
                        __builtin_prefetch((const char *)k + off[pf] + ho + i, 0, 1);
                        __builtin_prefetch((const char *)v + off[pf] + ho + i, 0, 1);
                    }
                const char *kt = (const char *)k + off[t0 - j0 + t] + ho;
                vf kr[NV];
                for (int i = 0; i < NV; i++) kr[i] = load_kv(kt, i * V, kv);
                for (int g = 0; g < G; g++) {
                    vf acc = qv[g][0] * kr[0];
                    for (int i = 1; i < NV; i++) acc += qv[g][i] * kr[i];
                    part[g][t] = acc;
                }
            }
            for (int g = 0; g < G; g++) {  /* the tail of the last tile: -inf */
                const vf s = vselect(lane < (int32_t)n, lane_sums(part[g]), (vf){0} - INFINITY);
                memcpy(sc[h * G + g] + it * TILE, &s, sizeof s);
            }
        }
    }
    for (int64_t hq = 0; hq < Hkv * G; hq++) {
        vf m = loadv(sc[hq]), total = (vf){0};
        for (int64_t it = 1; it < nt; it++) {
            const vf s = loadv(sc[hq] + it * TILE);
            m = vselect(s > m, s, m);
        }
        const float mm = hmax(m);
        for (int64_t it = 0; it < nt; it++) {
            const vf e = vexp(loadv(sc[hq] + it * TILE) - mm);
            memcpy(sc[hq] + it * TILE, &e, sizeof e);
            total += e;
        }
        mx[hq] = mm;
        sum[hq] = hsum(total);
    }
    for (int64_t h = 0; h < Hkv; h++) {
        vf ov[G][NV];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < NV; i++) ov[g][i] = (vf){0};
        for (int64_t it = 0; it < nt; it++) {
            const int64_t t0 = j0 + it * TILE, n = j1 - t0 < TILE ? j1 - t0 : TILE;
            for (int64_t t = 0; t < n; t++) {
                const char *vt = (const char *)v + off[t0 - j0 + t] + kv_bytes(h * D, kv);
                for (int i = 0; i < NV; i++) {
                    const vf x = load_kv(vt, i * V, kv);
                    for (int g = 0; g < G; g++) ov[g][i] += sc[h * G + g][it * TILE + t] * x;
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < NV; i++) memcpy(o + (h * G + g) * D + i * V, &ov[g][i], sizeof(vf));
    }
}

/* one_range for a (G, D) the switch below instantiates; returns 0 for another shape. One function
 * per cache type, so each stays as compact as the float32 one was. (D / V = 32: heads of 256 with
 * AVX2's 8 lanes, Qwen3.5's and Gemma's; G 8 of them: Gemma 4 E2B's 8 query heads on one KV head,
 * heads of 512 with AVX-512's 16 lanes.) */
#define ONE_RANGE_ANY(name, KV) \
static __attribute__((noinline)) int name(const float *q, const void *k, const void *v, const int64_t *table, \
        int64_t j0, int64_t j1, float *o, float *mx, float *sum, int64_t Hkv, int64_t D, int64_t G, \
        int64_t block_size, float scale) { \
    if (D % V) return 0; \
    switch (G * 100 + D / V) { \
        CASE(KV, 1, 4) CASE(KV, 2, 4) CASE(KV, 3, 4) CASE(KV, 4, 4) CASE(KV, 5, 4) CASE(KV, 6, 4) CASE(KV, 7, 4) \
        CASE(KV, 8, 4) CASE(KV, 1, 8) CASE(KV, 2, 8) CASE(KV, 3, 8) CASE(KV, 4, 8) CASE(KV, 5, 8) CASE(KV, 6, 8) \
        CASE(KV, 7, 8) CASE(KV, 8, 8) CASE(KV, 1, 16) CASE(KV, 2, 16) CASE(KV, 4, 16) CASE(KV, 8, 16) \
        CASE(KV, 1, 32) CASE(KV, 2, 32) CASE(KV, 4, 32) CASE(KV, 8, 32) \
        default: return 0; \
    } \
}
#define CASE(kv, g, nv) case (g) * 100 + (nv): \
    one_range(k, v, q, table, j0, j1, o, mx, sum, Hkv, block_size, scale, g, nv, kv); return 1;
ONE_RANGE_ANY(one_range_f32, KV_F32)
ONE_RANGE_ANY(one_range_bf16, KV_BF16)
ONE_RANGE_ANY(one_range_f16, KV_F16)
ONE_RANGE_ANY(one_range_q8_0, KV_Q8_0)
#undef CASE

static int one_range_any(const float *q, const void *k, const void *v, const int64_t *table, int64_t j0,
                         int64_t j1, float *o, float *mx, float *sum, int64_t Hkv, int64_t D,
                         int64_t G, int64_t block_size, float scale, int64_t kv) {
    return (kv == KV_BF16 ? one_range_bf16 : kv == KV_F16 ? one_range_f16 : kv == KV_Q8_0 ? one_range_q8_0 : one_range_f32)(
        q, k, v, table, j0, j1, o, mx, sum, Hkv, D, G, block_size, scale);
}

/* one_range for any head shape, plainly (all heads): scores, their exponentials, then V. */
static void one_range_plain(const float *q, const void *k, const void *v, const int64_t *table,
                            int64_t j0, int64_t j1, float *o, float *mx, float *sum, int64_t G,
                            int64_t Hkv, int64_t D, int64_t block_size, float scale, float *scores, int64_t kv) {
    const int64_t row = Hkv * D, L = j1 - j0, Hq = G * Hkv;
    for (int64_t j = 0; j < L; j++) {
        const int64_t kj = (table[(j0 + j) / block_size] * block_size + (j0 + j) % block_size) * row;
        for (int64_t hq = 0; hq < Hq; hq++) {
            float s = 0.f;
            for (int64_t d = 0; d < D; d++) s += q[hq * D + d] * kv_at(k, kj + hq / G * D + d, kv);
            scores[hq * L + j] = s * scale;
        }
    }
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sc = scores + hq * L, m = sc[0], total = 0.f;
        for (int64_t j = 1; j < L; j++) m = sc[j] > m ? sc[j] : m;
        for (int64_t j = 0; j < L; j++) { sc[j] = expf(sc[j] - m); total += sc[j]; }
        mx[hq] = m;
        sum[hq] = total;
    }
    for (int64_t i = 0; i < Hq * D; i++) o[i] = 0.f;
    for (int64_t j = 0; j < L; j++) {
        const int64_t vj = (table[(j0 + j) / block_size] * block_size + (j0 + j) % block_size) * row;
        for (int64_t hq = 0; hq < Hq; hq++)
            for (int64_t d = 0; d < D; d++) o[hq * D + d] += scores[hq * L + j] * kv_at(v, vj + hq / G * D + d, kv);
    }
}


void paged_decode_attention(const float *q, const void *k, const void *v,
                            const int64_t *tables, const int64_t *lens, float *out,
                            int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t window, int64_t kv,
                            const float *sinks) {
    const int64_t G = Hq / Hkv;
    /* Work items: (request, range of RANGE slots); first[b] is request b's first item. With a
     * sliding window (window > 0) a request's ranges cover its last `window` positions only. */
    int64_t *first = ferry_alloc(sizeof(int64_t) * (B + 1), "decode attention's work items");
#define LO(b) (window > 0 && lens[b] > window ? lens[b] - window : 0)
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + n_ranges(lens[b] - LO(b));
    const int64_t items = first[B];
    int64_t *owner = ferry_alloc(sizeof(int64_t) * items, "decode attention's work items");
    for (int64_t b = 0; b < B; b++)
        for (int64_t it = first[b]; it < first[b + 1]; it++) owner[it] = b;
    /* Per item and query head: an output of D floats, a max, a sum. */
    float *po = ferry_alloc(sizeof(float) * items * Hq * (D + 2), "decode attention's partial outputs");
    float *pm = po + items * Hq * D, *ps = pm + items * Hq;
    #pragma omp parallel
    {
        float *scores = NULL;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = owner[it], span = range_span(lens[b] - LO(b)), j0 = LO(b) + (it - first[b]) * span;
            const int64_t j1 = j0 + span < lens[b] ? j0 + span : lens[b];
            const float *qb = q + b * Hq * D;
            if (!one_range_any(qb, k, v, tables + b * max_blocks, j0, j1, po + it * Hq * D, pm + it * Hq,
                               ps + it * Hq, Hkv, D, G, block_size, scale, kv)) {
                if (!scores) scores = ferry_alloc(sizeof(float) * Hq * RANGE, "decode attention's scores");
                one_range_plain(qb, k, v, tables + b * max_blocks, j0, j1, po + it * Hq * D, pm + it * Hq,
                                ps + it * Hq, G, Hkv, D, block_size, scale, scores, kv);
            }
        }
        free(scores);
        /* Merge each request's ranges: rescale to the common max, add, divide by the sum (the sink's
         * exponential in it first, where there is one). */
        #pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t hq = 0; hq < Hq; hq++) {
                float m = sinks ? sinks[hq] : -INFINITY, total = 0.f;
                for (int64_t it = first[b]; it < first[b + 1]; it++) m = fmaxf(m, pm[it * Hq + hq]);
                if (sinks) total = expf(sinks[hq] - m);
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
#undef LO
    free(po);
    free(owner);
    free(first);
}

/* store_kv for tests: the fused decode's writes into a cache, on their own. */
void kv_store(void *dst, const float *src, int64_t n, int64_t kv) { store_kv(dst, src, n, kv); }
