/* The decoder layers of a decode-only step in one call: B requests, one new token each.
 *
 * A decode step with few requests does little arithmetic per operation, so done with torch it
 * costs mostly the ~25 operation dispatches per layer. Here the layers are a list of ops compiled
 * by the Python parts (ferry/model/layers, ferry/model/fused_decode.py): RMS norm, a product
 * (float32 or quantized by the weight's type, rows split over the threads), a bias, per-head
 * norms, rope with the K/V cache write, paged attention, the gated activation, the residual add.
 * Ops read and write row buffers (decode_ops.h); a new layer feature is one Python part plus one
 * op here. The same arithmetic as the torch path, up to the order of sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ferry_kernels.h"
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
static int matmul_stack(const float *x, const void *w, int64_t type, const wpart_t *parts, int64_t n, float *y,
                        int64_t M, int64_t N, int64_t K) {
    if (n == 0) {
        matmul(x, w, type, y, M, N, K);
        return 0;
    }
    float *tmp = M > 1 ? malloc(sizeof(float) * M * N) : NULL;
    if (M > 1 && !tmp) return DECODE_OOM;
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
    return 0;
}

/* Run ops[0..n_ops) over B rows. x is the residual stream [B, hidden], out a caller's buffer
 * (a tensor-parallel rank's partial sum, which it all-reduces); the others are allocated here,
 * d->width[i] floats a row. Adds each op's seconds to times[op.part]. Returns 0, or DECODE_OOM. */
int decode_ops(const decode_op_t *ops, int64_t n_ops, const decode_dims_t *d, float *x, float *out, int64_t B,
               const int64_t *positions, const int64_t *tables, int64_t max_blocks, const int64_t *lens,
               const int64_t *slots, double *times) {
    float *buf[DECODE_BUFFERS] = {x, out};
    int status = 0;
    for (int i = 2; i < DECODE_BUFFERS; i++)
        if (d->width[i] && !(buf[i] = malloc(sizeof(float) * B * d->width[i]))) status = DECODE_OOM;
    const int64_t Hq = d->n_heads, Hkv = d->n_kv_heads, D = d->head_dim, kv = Hkv * D;
    double t = now(), t1;
    for (int64_t i = 0; i < n_ops && !status; i++) {
        const decode_op_t *op = ops + i;
        float *src = buf[op->src], *dst = buf[op->dst];
        const int64_t ws = d->width[op->src], wd = d->width[op->dst];
        switch (op->code) {
        case OP_NORM:
            rms_norm(src, (const float *)op->w, dst, B, ws, d->eps);
            break;
        case OP_MATMUL:
            status = matmul_stack(src, op->w, op->type, op->parts, op->n_parts, dst, B, op->n, op->k);
            break;
        case OP_BIAS: { /* n: the bias's length (0: dst's width) */
            const float *bias = (const float *)op->w;
            const int64_t n = op->n ? op->n : wd;
            for (int64_t b = 0; b < B; b++)
                for (int64_t j = 0; j < n; j++) dst[b * wd + j] += bias[j];
            break;
        }
        case OP_ROPE_KV: /* q, k normed per head by w, w2 where given (Qwen3), rotated in the qkv rows (src); q
                          * to dst; k, v into the cache. k: q heads' stride in the row where their gates sit
                          * between them (Qwen3.5; 0: D); n: the rotated dimensions of each head (0: D; < 0:
                          * none). */
            if (op->k == 0 && op->n == 0) {
                ROWS(B, {
                    float *row = src + b * ws;
                    if (op->w) {
                        for (int64_t hh = 0; hh < Hq; hh++)
                            rms_norm(row + hh * D, (const float *)op->w, row + hh * D, 1, D, d->eps);
                        for (int64_t hh = Hq; hh < Hq + Hkv; hh++)
                            rms_norm(row + hh * D, (const float *)op->w2, row + hh * D, 1, D, d->eps);
                    }
                    rope(row, Hq + Hkv, D, op->cos + positions[b] * D, op->sin + positions[b] * D);
                    memcpy(dst + b * wd, row, sizeof(float) * Hq * D);
                    store_kv((char *)op->k_cache + kv_bytes(slots[b] * kv, d->kv), row + Hq * D, kv, d->kv);
                    store_kv((char *)op->v_cache + kv_bytes(slots[b] * kv, d->kv), row + Hq * D + kv, kv, d->kv);
                });
                break;
            }
            ROWS(B, {
                const int64_t qs = op->k ? op->k : D, rd = op->n > 0 ? op->n : D;
                float *row = src + b * ws, *krow = row + Hq * qs;
                const float *c = op->cos ? op->cos + positions[b] * rd : NULL;
                const float *s = op->sin ? op->sin + positions[b] * rd : NULL;
                for (int64_t hh = 0; hh < Hq + Hkv; hh++) {
                    float *head = hh < Hq ? row + hh * qs : krow + (hh - Hq) * D;
                    if (op->w) rms_norm(head, (const float *)(hh < Hq ? op->w : op->w2), head, 1, D, d->eps);
                    if (op->n >= 0) rope(head, 1, rd, c, s); /* n < 0: no rotation (Mamba2 hybrids' attention) */
                    if (hh < Hq) memcpy(dst + b * wd + hh * D, head, sizeof(float) * D);
                }
                store_kv((char *)op->k_cache + kv_bytes(slots[b] * kv, d->kv), krow, kv, d->kv);
                store_kv((char *)op->v_cache + kv_bytes(slots[b] * kv, d->kv), krow + kv, kv, d->kv);
            });
            break;
        case OP_RELU2: /* dst = max(src, 0)^2 (Nemotron-H's plain MLP) */
            for (int64_t b = 0; b < B; b++)
                for (int64_t j = 0; j < wd; j++) {
                    const float v = src[b * ws + j] > 0.0f ? src[b * ws + j] : 0.0f;
                    dst[b * wd + j] = v * v;
                }
            break;
        case OP_GATE: /* dst's n heads of k floats times sigmoid of their gates in src (each after its q head) */
            for (int64_t b = 0; b < B; b++)
                for (int64_t hh = 0; hh < op->n; hh++) {
                    const float *g = src + b * ws + hh * 2 * op->k + op->k;
                    float *o = dst + b * wd + hh * op->k;
                    for (int64_t j = 0; j < op->k; j++) o[j] *= 1.0f / (1.0f + expf(-g[j]));
                }
            break;
        case OP_ATTENTION:
            paged_decode_attention(src, op->k_cache, op->v_cache, tables, lens, dst, B, Hq, Hkv, D, d->block_size,
                                   max_blocks, op->scale, op->n, d->kv, (const float *)op->w);
            break;
        case OP_GATED_ACT:
            ROWS(B, gated_act(src + b * ws, dst + b * wd, wd, op->n));
            break;
        case OP_ADD: { /* dst += scale * src (scale 0: 1), src normed by w first where there is one (Gemma's
                        * output norms) */
            if (op->w) rms_norm(src, (const float *)op->w, src, B, ws, d->eps);
            const float sc = op->scale != 0.0f ? op->scale : 1.0f;
            for (int64_t j = 0; j < B * wd; j++) dst[j] += sc * src[j];
            break;
        }
        case OP_GDN: {
            const int64_t *sh = op->shape; /* k heads, v heads, k dim, v dim, conv taps, tiled */
            status = gdn_decode(src, ws, dst, wd, B, d->state_slots, op->k_cache, op->v_cache, op->w, op->w3, op->w4,
                                op->w2, sh[0], sh[1], sh[2], sh[3], sh[4], sh[5], d->eps)
                         ? DECODE_OOM
                         : 0;
            break;
        }
        case OP_SHORT_CONV: /* shape: channels, conv taps */
            status = short_conv_decode(src, ws, dst, wd, B, d->state_slots, op->k_cache, op->w, op->w2, op->shape[0],
                                       op->shape[1])
                         ? DECODE_OOM
                         : 0;
            break;
        case OP_MAMBA2:
            status = mamba2_decode(src, ws, dst, wd, B, d->state_slots, op->k_cache, op->v_cache, op->w, op->w2,
                                   op->w3, op->w4, op->shape, d->eps)
                         ? DECODE_OOM
                         : 0;
            break;
        default:
            status = DECODE_BAD_OP;
        }
        t1 = now();
        times[op->part] += t1 - t;
        t = t1;
    }
    for (int i = 2; i < DECODE_BUFFERS; i++) free(buf[i]);
    return status;
}

void decode_counts(int64_t *out) {
    out[0] = DECODE_OPS;
    out[1] = DECODE_BUFFERS;
}
