/* Every decoder layer of a decode-only step in one call: B requests, one new token each.
 *
 * A decode step with few requests does little arithmetic per operation, so done with torch it
 * costs mostly the ~25 operation dispatches per layer. Here a layer is: RMS norm, qkv product,
 * rope, K/V into the paged cache, paged attention, o product (+ residual), RMS norm, gate+up
 * product, SiLU(gate) * up (or GELU), down product (+ residual); Gemma's norms of the o and
 * down products' outputs where a layer has them. The products use the float32 or the
 * quantized kernel by each weight's type and split their rows over the threads; the small
 * operations are row loops. The same arithmetic as the torch path, up to the order of sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_types.h"
#include "row_ops.h"

/* From this many rows a decode step's rope, cache writes and gated activation are split over the
 * threads (a row's SiLU divides 1536 times; one row alone costs less than waking the pool). */
#define DECODE_PARALLEL_ROWS 4
/* body for b in [0, B): a parallel loop from DECODE_PARALLEL_ROWS rows, else a plain one (an
 * OpenMP loop whose if clause is false still sets up a team: ~microseconds a call, 60 a step). */
#define ROWS(B, ...)                                                                      \
    do {                                                                                  \
        if ((B) >= DECODE_PARALLEL_ROWS) {                                                \
            _Pragma("omp parallel for schedule(static)") for (int64_t b = 0; b < (B); b++) __VA_ARGS__; \
        } else                                                                            \
            for (int64_t b = 0; b < (B); b++) __VA_ARGS__;                                \
    } while (0)

void skinny_gemm(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K);
void quant_gemm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type);
void paged_decode_attention(const float *q, const void *k, const void *v, const int64_t *tables,
                            const int64_t *lens, float *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t window, int64_t kv);

/* One run of rows of one type in a stack of weights (ferry.model.quant.RowStack). */
typedef struct {
    const void *w;
    int64_t type, rows;
} wpart_t;

typedef struct {
    const float *input_norm, *post_norm, *qkv_bias;
    const void *qkv, *o_proj, *gate_up, *down;
    int64_t qkv_type, o_type, gate_up_type, down_type; /* -1: float32, else quant_gemm's type */
    void *k_cache, *v_cache;                           /* [slots, Hkv, D] of dims' kv type */
    int64_t window;                                    /* sliding window, 0: none */
    const float *q_norm, *k_norm;                      /* per-head RMS norm weights before rope, or NULL */
    const float *cos, *sin;                            /* this layer's rope tables [positions, D] */
    const float *attn_out_norm, *mlp_out_norm;         /* norms of the two outputs (Gemma), or NULL */
    const wpart_t *qkv_parts, *gate_up_parts;          /* stacks of types, or NULL: qkv, gate_up */
    int64_t n_qkv_parts, n_gate_up_parts;
} layer_t;

typedef struct {
    int64_t hidden, n_heads, n_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int64_t gelu; /* the MLP's gate: 0 SiLU (SwiGLU), 1 tanh-approximated GELU (GeGLU) */
    int64_t kv;   /* the KV cache's element type (kv_types.h) */
} dims_t;

/* Where the time goes, for the step profiler: seconds per part, added to times[]. */
enum { T_NORM, T_QKV, T_ROPE, T_ATTN, T_O, T_GATE_UP, T_ACT, T_DOWN, T_PARTS };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void matmul(const float *x, const void *w, int64_t type, float *y, int64_t M, int64_t N, int64_t K) {
    if (type < 0) skinny_gemm(x, (const float *)w, y, M, N, K);
    else quant_gemm(x, (const uint8_t *)w, y, M, N, K, type);
}

/* y[M, N] = x @ w^T, or with parts (n > 0) each part's product into its columns of y. */
static void matmul_stack(const float *x, const void *w, int64_t type, const wpart_t *parts, int64_t n, float *y,
                         int64_t M, int64_t N, int64_t K) {
    if (n == 0) {
        matmul(x, w, type, y, M, N, K);
        return;
    }
    float *tmp = M > 1 ? malloc(sizeof(float) * M * N) : NULL;
    for (int64_t i = 0, r0 = 0; i < n; r0 += parts[i].rows, i++) {
        const int64_t rows = parts[i].rows;
        if (M == 1) {
            matmul(x, parts[i].w, parts[i].type, y + r0, 1, rows, K);
            continue;
        }
        matmul(x, parts[i].w, parts[i].type, tmp, M, rows, K);
        for (int64_t m = 0; m < M; m++) memcpy(y + m * N + r0, tmp + m * rows, sizeof(float) * rows);
    }
    free(tmp);
}

/* part < 0: every layer, each output added to the residual stream x. A tensor-parallel rank runs
 * one layer's half at a time (part 0: attention to the o product, 1: the MLP) into out, its partial
 * sum, which the ranks all-reduce before it joins x (the caller adds it, normed where the layer says). */
void decode_layers(const layer_t *layers, int64_t n_layers, const dims_t *d, float *x, int64_t B,
                   const int64_t *positions, const float *cos, const float *sin, const int64_t *tables,
                   int64_t max_blocks, const int64_t *lens, const int64_t *slots, double *times,
                   int64_t part, float *out) {
    const int64_t H = d->hidden, D = d->head_dim, Hq = d->n_heads, Hkv = d->n_kv_heads, I = d->intermediate;
    const int64_t nqkv = (Hq + 2 * Hkv) * D, kv = Hkv * D;
    float *h = malloc(sizeof(float) * B * H), *qkv = malloc(sizeof(float) * B * nqkv);
    float *q = malloc(sizeof(float) * B * Hq * D), *attn = malloc(sizeof(float) * B * Hq * D);
    float *gu = malloc(sizeof(float) * B * 2 * I), *act = malloc(sizeof(float) * B * I);
    float *tmp = malloc(sizeof(float) * B * H);
    double t = now(), t1;
#define LAP(part) (t1 = now(), times[part] += t1 - t, t = t1)
    for (int64_t l = 0; l < n_layers; l++) {
        const layer_t *L = layers + l;
        if (part == 1) goto mlp;
        rms_norm(x, L->input_norm, h, B, H, d->eps);
        LAP(T_NORM);
        matmul_stack(h, L->qkv, L->qkv_type, L->qkv_parts, L->n_qkv_parts, qkv, B, nqkv, H);
        if (L->qkv_bias)
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < nqkv; i++) qkv[b * nqkv + i] += L->qkv_bias[i];
        LAP(T_QKV);
        const float *lc = L->cos ? L->cos : cos, *ls = L->sin ? L->sin : sin;
        ROWS(B, {
            float *row = qkv + b * nqkv;
            if (L->q_norm) { /* Qwen3: each head's q and k normalised on their own */
                for (int64_t hh = 0; hh < Hq; hh++) rms_norm(row + hh * D, L->q_norm, row + hh * D, 1, D, d->eps);
                for (int64_t hh = 0; hh < Hkv; hh++)
                    rms_norm(row + (Hq + hh) * D, L->k_norm, row + (Hq + hh) * D, 1, D, d->eps);
            }
            rope(row, Hq + Hkv, D, lc + positions[b] * D, ls + positions[b] * D);
            memcpy(q + b * Hq * D, row, sizeof(float) * Hq * D);
            store_kv((char *)L->k_cache + kv_bytes(slots[b] * kv, d->kv), row + Hq * D, kv, d->kv);
            store_kv((char *)L->v_cache + kv_bytes(slots[b] * kv, d->kv), row + Hq * D + kv, kv, d->kv);
                });
        LAP(T_ROPE);
        paged_decode_attention(q, L->k_cache, L->v_cache, tables, lens, attn, B, Hq, Hkv, D,
                               d->block_size, max_blocks, d->scale, L->window, d->kv);
        LAP(T_ATTN);
        if (part == 0) {
            matmul(attn, L->o_proj, L->o_type, out, B, H, Hq * D);
            LAP(T_O);
            break;
        }
        matmul(attn, L->o_proj, L->o_type, tmp, B, H, Hq * D);
        if (L->attn_out_norm) rms_norm(tmp, L->attn_out_norm, tmp, B, H, d->eps);
        for (int64_t i = 0; i < B * H; i++) x[i] += tmp[i];
        LAP(T_O);
    mlp:
        rms_norm(x, L->post_norm, h, B, H, d->eps);
        LAP(T_NORM);
        matmul_stack(h, L->gate_up, L->gate_up_type, L->gate_up_parts, L->n_gate_up_parts, gu, B, 2 * I, H);
        LAP(T_GATE_UP);
        ROWS(B, gated_act(gu + b * 2 * I, act + b * I, I, d->gelu));
        LAP(T_ACT);
        if (part == 1) {
            matmul(act, L->down, L->down_type, out, B, H, I);
            LAP(T_DOWN);
            break;
        }
        matmul(act, L->down, L->down_type, tmp, B, H, I);
        if (L->mlp_out_norm) rms_norm(tmp, L->mlp_out_norm, tmp, B, H, d->eps);
        for (int64_t i = 0; i < B * H; i++) x[i] += tmp[i];
        LAP(T_DOWN);
    }
#undef LAP
    free(h); free(qkv); free(q); free(attn); free(gu); free(act); free(tmp);
}
