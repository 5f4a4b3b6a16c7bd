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

/* One row's routing: softmax of the router's logits (biased), the k largest (the lower expert first
 * on a tie), their weights renormalised over the k where renorm (experts.py's route). */
static void route_row(float *logits, const float *bias, int64_t E, int64_t top, int64_t renorm, int64_t *chosen,
                      float *wts) {
    for (int64_t e = 0; e < E; e++) logits[e] += bias ? bias[e] : 0.f;
    float mx = logits[0], sum = 0.f; /* no infinities: the file builds with fast math */
    for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    for (int64_t e = 0; e < E; e++) sum += logits[e] = expf(logits[e] - mx);
    float kept = 0.f;
    for (int64_t j = 0; j < top; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[j] = best;
        kept += wts[j] = logits[best] / sum;
    }
    if (renorm)
        for (int64_t j = 0; j < top; j++) wts[j] /= kept;
}

/* gpt-oss's clamped SwiGLU of one row: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g the
 * gate clamped above at limit; the sigmoid from e = exp(-|z|) <= 1 (fast math has no infinities). */
static void swiglu_clamp(const float *gu, float *out, int64_t I, float alpha, float limit) {
    for (int64_t i = 0; i < I; i++) {
        const float g = gu[i] < limit ? gu[i] : limit;
        const float u = gu[I + i] < -limit ? -limit : gu[I + i] > limit ? limit : gu[I + i];
        const float z = alpha * g, e = expf(-fabsf(z));
        out[i] = (u + 1.f) * (g * ((z < 0.f ? e : 1.f) / (1.f + e)));
    }
}

/* OP_EXPERTS: dst = the routed experts of src's rows. w: the router [E, k] float32; w2: its bias
 * [E] then the clamped SwiGLU's alpha and limit, then the shared expert's gate row [k] where it
 * has one; parts: the E experts' gate_up products [2I, k], then their down products [n, I], then
 * the shared expert's gate_up [2S, k] and down [n, S] where S; w3, w4: the experts' biases [E, 2I],
 * [E, n] (or NULL); shape: E, the experts a row takes, I, renorm, act (0 SiLU, 1 GELU-tanh, 2
 * clamped SwiGLU), S (0: no shared expert), gated (1: the shared output times sigmoid(x . its gate
 * row)). Each expert runs once over its rows; dst sums their outputs by the router's weights in
 * expert order, as experts.py's index_add does, then adds the shared expert's. */
static int routed_experts(const decode_op_t *op, const float *x, int64_t ws, float *y, int64_t wd, int64_t B) {
    const int64_t E = op->shape[0], top = op->shape[1], I = op->shape[2], renorm = op->shape[3], act = op->shape[4];
    const int64_t K = op->k, N = op->n, S = op->shape[5], gated = op->shape[6], W = S > I ? S : I;
    const float *bias = (const float *)op->w2, alpha = bias[E], limit = bias[E + 1];
    float *logits = malloc(sizeof(float) * B * E), *wts = malloc(sizeof(float) * B * top);
    float *xs = malloc(sizeof(float) * B * K), *gu = malloc(sizeof(float) * B * 2 * W);
    float *a = malloc(sizeof(float) * B * W), *ys = malloc(sizeof(float) * B * N);
    int64_t *chosen = malloc(sizeof(int64_t) * B * top), *pick = malloc(sizeof(int64_t) * B);
    int status = logits && wts && xs && gu && a && ys && chosen && pick ? 0 : DECODE_OOM;
    if (!status) {
        for (int64_t b = 0; b < B; b++) memcpy(xs + b * K, x + b * ws, sizeof(float) * K);
        skinny_gemm(xs, (const float *)op->w, logits, B, E, K);
        for (int64_t b = 0; b < B; b++) route_row(logits + b * E, bias, E, top, renorm, chosen + b * top, wts + b * top);
        for (int64_t b = 0; b < B; b++) memset(y + b * wd, 0, sizeof(float) * N);
    }
    for (int64_t e = 0; e < E && !status; e++) {
        int64_t n = 0; /* its rows: pick[r] the (row, slot) index */
        for (int64_t i = 0; i < B * top; i++)
            if (chosen[i] == e) pick[n++] = i;
        if (!n) continue;
        for (int64_t r = 0; r < n; r++) memcpy(xs + r * K, x + pick[r] / top * ws, sizeof(float) * K);
        matmul(xs, op->parts[e].w, op->parts[e].type, gu, n, 2 * I, K);
        for (int64_t r = 0; r < n; r++) {
            float *g = gu + r * 2 * I;
            if (op->w3)
                for (int64_t j = 0; j < 2 * I; j++) g[j] += ((const float *)op->w3)[e * 2 * I + j];
            if (act == 2) swiglu_clamp(g, a + r * I, I, alpha, limit);
            else gated_act(g, a + r * I, I, act);
        }
        matmul(a, op->parts[E + e].w, op->parts[E + e].type, ys, n, N, I);
        for (int64_t r = 0; r < n; r++) {
            const float *o = ys + r * N, wt = wts[pick[r]];
            float *out = y + pick[r] / top * wd;
            for (int64_t j = 0; j < N; j++)
                out[j] += wt * (op->w4 ? o[j] + ((const float *)op->w4)[e * N + j] : o[j]);
        }
    }
    if (S && !status) { /* the shared expert, on every row */
        for (int64_t b = 0; b < B; b++) memcpy(xs + b * K, x + b * ws, sizeof(float) * K);
        matmul(xs, op->parts[2 * E].w, op->parts[2 * E].type, gu, B, 2 * S, K);
        for (int64_t b = 0; b < B; b++) gated_act(gu + b * 2 * S, a + b * S, S, act);
        matmul(a, op->parts[2 * E + 1].w, op->parts[2 * E + 1].type, ys, B, N, S);
        for (int64_t b = 0; b < B; b++) {
            float z = 0.f, wt = 1.f;
            if (gated) {
                for (int64_t j = 0; j < K; j++) z += xs[b * K + j] * bias[E + 2 + j];
                const float e = expf(-fabsf(z)); /* sigmoid without infinities, as swiglu_clamp's */
                wt = (z < 0.f ? e : 1.f) / (1.f + e);
            }
            for (int64_t j = 0; j < N; j++) y[b * wd + j] += wt * ys[b * N + j];
        }
    }
    free(logits), free(wts), free(xs), free(gu), free(a), free(ys), free(chosen), free(pick);
    return status;
}

/* One head's RMS norm with no weight (Gemma 4's norm of v). */
static void norm_plain(const float *x, float *out, int64_t D, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < D; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = x[i] * r;
}

/* OP_HEADS_ROPE_KV: a layer of its own head counts and size (Gemma 4), rows packed: shape Hq, Hkv,
 * D, mode, vnorm. src rows hold q, then (mode 0) k and v, (mode 1) k, which is also v before its
 * norm (k_eq_v), (mode 2) nothing: the layer reads the K/V an earlier one wrote. q, k heads normed
 * by w, w2 and rotated by the D-wide table; v's heads normed without a weight where vnorm; q to
 * dst, k and v into the cache. */
static void heads_rope_kv(const decode_op_t *op, const decode_dims_t *d, const float *src, float *dst, int64_t B,
                          const int64_t *positions, const int64_t *slots) {
    const int64_t Hq = op->shape[0], Hkv = op->shape[1], D = op->shape[2], mode = op->shape[3], vnorm = op->shape[4];
    const int64_t kv = Hkv * D, ws = (Hq + (mode == 0 ? 2 : mode == 1 ? 1 : 0) * Hkv) * D;
    ROWS(B, {
        const float *row = src + b * ws;
        float *q = dst + b * Hq * D;
        const float *c = op->cos + positions[b] * D, *s = op->sin + positions[b] * D;
        for (int64_t hh = 0; hh < Hq; hh++) rms_norm(row + hh * D, (const float *)op->w, q + hh * D, 1, D, d->eps);
        rope(q, Hq, D, c, s);
        if (mode != 2) {
            float *k = malloc(sizeof(float) * 2 * kv), *v = k ? k + kv : NULL;
            if (k) {
                const float *kr = row + Hq * D, *vr = mode == 1 ? kr : kr + kv;
                for (int64_t hh = 0; hh < Hkv; hh++) {
                    rms_norm(kr + hh * D, (const float *)op->w2, k + hh * D, 1, D, d->eps);
                    if (vnorm) norm_plain(vr + hh * D, v + hh * D, D, d->eps);
                    else memcpy(v + hh * D, vr + hh * D, sizeof(float) * D);
                }
                rope(k, Hkv, D, c, s);
                store_kv((char *)op->k_cache + kv_bytes(slots[b] * kv, d->kv), k, kv, d->kv);
                store_kv((char *)op->v_cache + kv_bytes(slots[b] * kv, d->kv), v, kv, d->kv);
                free(k);
            }
        }
    });
}

/* OP_ACT_MUL: dst = act(src) * w's row (Gemma 4's per-layer input block), rows packed: shape n,
 * w's row stride, gelu (1: GELU-tanh, 0: SiLU). */
static void act_mul(const decode_op_t *op, const float *src, float *dst, int64_t B) {
    const int64_t n = op->shape[0], stride = op->shape[1], gelu = op->shape[2];
    const float *w = (const float *)op->w;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < n; j++) {
            const float g = src[b * n + j], e = expf(-fabsf(g));
            const float a = gelu ? 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)))
                                 : g * ((g < 0.f ? e : 1.f) / (1.f + e));
            dst[b * n + j] = a * w[b * stride + j];
        }
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
        case OP_EXPERTS:
            status = routed_experts(op, src, ws, dst, wd, B);
            break;
        case OP_HEADS_ROPE_KV:
            heads_rope_kv(op, d, src, dst, B, positions, slots);
            break;
        case OP_HEADS_ATTENTION: /* paged attention of a layer's own head counts and size (shape Hq, Hkv, D), rows packed */
            paged_decode_attention(src, op->k_cache, op->v_cache, tables, lens, dst, B, op->shape[0], op->shape[1],
                                   op->shape[2], d->block_size, max_blocks, op->scale, op->n, d->kv, NULL);
            break;
        case OP_GATED_ACT_N: /* the gated activation of n columns, rows packed (widths differing by layer) */
            ROWS(B, gated_act(src + b * 2 * op->n, dst + b * op->n, op->n, op->k));
            break;
        case OP_ACT_MUL:
            act_mul(op, src, dst, B);
            break;
        case OP_SCALE: /* dst *= scale (Gemma 4's layer scalar on the residual stream) */
            for (int64_t j = 0; j < B * wd; j++) dst[j] *= op->scale;
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
