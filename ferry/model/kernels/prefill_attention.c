/* Paged attention for prefill chunks on the CPU, flash-attention style: each query of a chunk
 * reads its request's K/V in place through the chunk's slots (its own K/V are already in the
 * cache), causal inside the chunk, over the whole context before it (or the layer's sliding
 * window), tile by tile with a running softmax: no gathered copy of the context, no mask tensor.
 *
 * q:      [T, Hq, D] rows q_stride floats apart (the packed step's queries, after rope)
 * k, v:   [S, Hkv, D] the layer's cache, of type kv (kv_types.h)
 * slots:  per span, the cache slot of every position 0 .. ctx_len + q_len - 1
 * spans:  [n_spans, 4] int64: first packed row, q_len, ctx_len, offset of the span's slots
 * out:    [T, Hq, D]; only the spans' rows are written
 * sinks:  [Hq] or NULL: each query head's sink logit, which joins every softmax denominator and
 *         adds no value (gpt-oss); the running softmax starts from it
 *
 * A work item is V query rows of one KV head: a row is one of the head group's G query heads at
 * one position (position-major), so the G heads that share K/V share each tile. Both products
 * run with the vector across the item's rows: scores S[key] = sum_d K[key][d] * Q^T[d] and
 * output O^T[d] += V[key][d] * P[key], a broadcast element times a vector each, TK keys' scores in
 * registers; the softmax's running max and sum are vectors across rows too. Items are split over
 * the threads (OpenMP, torch's pool), so one long prompt keeps every core busy.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "ferry_kernels.h"
#include "kv_types.h"
#include "vec.h"
#include "vmath.h"

#define TK V /* keys per tile */

typedef struct {
    const float *q;
    int64_t q_stride;
    const void *k, *v;
    int64_t Hq, Hkv, D, window;
    float scale;
    const float *sinks;
} attn_t;

/* Rows r0 .. r0 + V - 1 of span (first, q_len, ctx) for KV head h; qt, ot: [D][V], kb, vb: [TK][D]. */
static inline __attribute__((always_inline)) void one_item(
        const attn_t *a, const int64_t *slots, int64_t first, int64_t q_len, int64_t ctx, int64_t h,
        int64_t r0, float *out, float *qt, float *ot, float *kb, float *vb, const int kv) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, rows = q_len * G, row = a->Hkv * D;
    vi pos;  /* each row's position; -1 for rows past the span's end, which see no key */
    vf m = (vf){0} - 1e30f, l = (vf){0};  /* finite start: no inf - inf */
    for (int i = 0; i < V; i++) {
        const int64_t r = r0 + i, t = r / G, hq = h * G + r % G;
        pos[i] = r < rows ? (int32_t)(ctx + t) : -1;
        if (a->sinks && r < rows) {  /* the sink: a first key of weight exp(sink), no value */
            m[i] = fmaxf(a->sinks[hq], -1e30f);
            l[i] = expf(a->sinks[hq] - m[i]);
        }
        for (int64_t d = 0; d < D; d++)
            qt[d * V + i] = r < rows ? a->q[(first + t) * a->q_stride + hq * D + d] * a->scale : 0.f;
    }
    for (int64_t i = 0; i < D * V; i++) ot[i] = 0.f;
    const int64_t last = r0 + V - 1 < rows ? r0 + V - 1 : rows - 1;
    const int64_t p0 = ctx + r0 / G, p1 = ctx + last / G;
    const int64_t lo = a->window > 0 && p0 - a->window + 1 > 0 ? p0 - a->window + 1 : 0;
    for (int64_t j0 = lo; j0 <= p1; j0 += TK) {
        const int64_t n = p1 + 1 - j0 < TK ? p1 + 1 - j0 : TK;
        for (int64_t t = 0; t < TK; t++) {
            float *kr = kb + t * D, *vr = vb + t * D;
            if (t >= n) {
                for (int64_t d = 0; d < D; d++) kr[d] = vr[d] = 0.f;
                continue;
            }
            const int64_t off = kv_bytes(slots[j0 + t] * row + h * D, kv);
            for (int64_t d = 0; d < D; d += V) {
                const vf x = load_kv((const char *)a->k + off, d, kv), y = load_kv((const char *)a->v + off, d, kv);
                memcpy(kr + d, &x, sizeof x);
                memcpy(vr + d, &y, sizeof y);
            }
        }
        vf s[TK];
        for (int t = 0; t < TK; t++) s[t] = (vf){0};
        for (int64_t d = 0; d < D; d++) {
            const vf qd = loadv(qt + d * V);
            for (int t = 0; t < TK; t++) s[t] += kb[t * D + d] * qd;
        }
        vf mx = m;
        for (int t = 0; t < TK; t++) {
            const int32_t key = (int32_t)(j0 + t);
            vi ok = pos >= key;
            if (a->window > 0) ok &= pos - (int32_t)a->window < key;
            if (t >= n) ok = (vi){0};
            s[t] = vselect(ok, s[t], (vf){0} - INFINITY);
            mx = vselect(s[t] > mx, s[t], mx);
        }
        const vf corr = vexp(m - mx);
        l *= corr;
        for (int t = 0; t < TK; t++) {
            s[t] = vexp(s[t] - mx);
            l += s[t];
        }
        m = mx;
        /* 8 output dims at a time: 8 independent chains of TK multiply-adds, not one latency-bound
         * chain per dim (each dim still sums the keys in order). */
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            vf o[8];
            for (int e = 0; e < 8; e++) o[e] = loadv(ot + (d0 + e) * V) * corr;
            for (int t = 0; t < TK; t++)
                for (int e = 0; e < 8; e++) o[e] += vb[t * D + d0 + e] * s[t];
            for (int e = 0; e < 8; e++) memcpy(ot + (d0 + e) * V, &o[e], sizeof o[e]);
        }
    }
    for (int i = 0; i < V; i++) {
        const int64_t r = r0 + i, t = r / G, hq = h * G + r % G;
        if (r >= rows) break;
        float *o = out + ((first + t) * a->Hq + hq) * D;
        for (int64_t d = 0; d < D; d++) o[d] = ot[d * V + i] / l[i];
    }
}

/* One function per cache type, so each keeps its loads compact. */
#define ITEM_KV(name, KV) \
    static __attribute__((noinline)) void name(const attn_t *a, const int64_t *slots, int64_t first, int64_t q_len, \
            int64_t ctx, int64_t h, int64_t r0, float *out, float *qt, float *ot, float *kb, float *vb) { \
        one_item(a, slots, first, q_len, ctx, h, r0, out, qt, ot, kb, vb, KV); \
    }
ITEM_KV(item_f32, KV_F32)
ITEM_KV(item_bf16, KV_BF16)
ITEM_KV(item_f16, KV_F16)
ITEM_KV(item_q8_0, KV_Q8_0)

/* Returns 1 when it served the call, 0 for a head size it does not take (D not a multiple of V), -1
 * when out of memory (the rows of out then incomplete). */
int paged_prefill_attention(const float *q, int64_t q_stride, const void *k, const void *v, const int64_t *slots,
                            const int64_t *spans, int64_t n_spans, float *out, int64_t Hq, int64_t Hkv, int64_t D,
                            float scale, int64_t window, int64_t kv, const float *sinks) {
    if (D % V || Hq % Hkv) return 0;
    const int64_t G = Hq / Hkv;
    const attn_t a = {q, q_stride, k, v, Hq, Hkv, D, window, scale, sinks};
    /* Items: (span, KV head, V rows); first[s] is span s's first item. */
    int64_t *first = malloc(sizeof(int64_t) * (n_spans + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < n_spans; s++) first[s + 1] = first[s] + Hkv * ((spans[4 * s + 1] * G + V - 1) / V);
    const int64_t items = first[n_spans];
    int failed = 0;
    #pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * (2 * D * V + 2 * TK * D));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        float *qt = buf, *ot = qt + D * V, *kb = ot + D * V, *vb = kb + TK * D;
        int64_t s = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!buf) continue; /* this thread's items: the call fails as a whole */
            while (it >= first[s + 1]) s++;
            while (it < first[s]) s--;
            const int64_t *sp = spans + 4 * s, per_head = (first[s + 1] - first[s]) / Hkv;
            const int64_t h = (it - first[s]) / per_head, r0 = (it - first[s]) % per_head * V;
            (kv == KV_BF16 ? item_bf16 : kv == KV_F16 ? item_f16 : kv == KV_Q8_0 ? item_q8_0 : item_f32)(
                &a, slots + sp[3], sp[0], sp[1], sp[2], h, r0, out, qt, ot, kb, vb);
        }
        free(buf);
    }
    free(first);
    return failed ? -1 : 1;
}
