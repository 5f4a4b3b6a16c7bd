/* The fused decode's op list (decode_layers.c): its op codes, row buffers and structs, included by
 * ferry_kernels.h. Mirrored by ferry/model/fused_decode.py (codes, buffers) and
 * ferry/model/kernels/__init__.py (the structs), both checked at load. */
#ifndef FERRY_DECODE_OPS_H
#define FERRY_DECODE_OPS_H
#include <stdint.h>

/* The ops. Each reads buffer src and writes buffer dst (rows of d->width floats). */
enum {
    OP_NORM,       /* dst = rms_norm(src) * w */
    OP_MATMUL,     /* dst[:, :n] = src[:, :k] @ w^T (w of type, or parts) */
    OP_BIAS,       /* dst += w */
    OP_ROPE_KV,    /* src's q, k heads normed by w, w2 where given, then rotated; q to dst; k, v into the cache */
    OP_ATTENTION,  /* dst = paged attention of src's q (window n, scale; w: per-head sink logits or NULL) */
    OP_GATED_ACT,  /* dst = act(src's gate) * src's up (n: 0 SiLU, 1 GELU-tanh) */
    OP_ADD,        /* dst += src (normed by w first where w) */
    OP_GDN,        /* dst = Gated DeltaNet's gated-normed heads of src's in-projection row (recurrent_decode.c) */
    OP_SHORT_CONV, /* dst = LFM2's c * conv(b * x) of src's in-projection row (recurrent_decode.c) */
    OP_GATE,       /* dst's heads *= sigmoid(their output gates in src) (Qwen3.5's gated attention) */
    OP_MAMBA2,     /* dst = Mamba2's gated-normed scan output of src's in-projection row (recurrent_decode.c) */
    OP_RELU2,      /* dst = max(src, 0)^2 */
    OP_EXPERTS,    /* dst = the routed experts of src's rows (router, top k, gated MLPs; decode_layers.c) */
    OP_HEADS_ROPE_KV,  /* rope_kv of a layer's own head counts and size, v normed, rows packed (Gemma 4) */
    OP_HEADS_ATTENTION, /* attention of a layer's own head counts and size, rows packed (Gemma 4) */
    OP_GATED_ACT_N,    /* dst = act(src's gate) * src's up of n columns, rows packed */
    OP_ACT_MUL,        /* dst = act(src) * w's rows (Gemma 4's per-layer inputs) */
    OP_SCALE,          /* dst *= scale */
    DECODE_OPS
};

/* The row buffers: x (the residual stream) and out (the caller's) are given, the others allocated. */
enum { BUF_X, BUF_OUT, BUF_H, BUF_QKV, BUF_Q, BUF_ATTN, BUF_GU, BUF_ACT, BUF_TMP, BUF_RIN, BUF_ROUT, DECODE_BUFFERS };

enum { DECODE_OOM = 1, DECODE_BAD_OP = 2 };

/* One run of rows of one type in a stack of weights (ferry.model.quant.RowStack). */
typedef struct {
    const void *w;
    int64_t type, rows;
} wpart_t;

typedef struct {
    int64_t code, src, dst, part; /* part: the profiler's slot its time is added to */
    const void *w, *w2;
    int64_t type;                 /* a product's weight type: -1 float32, else quant_gemm's */
    const wpart_t *parts;         /* a stack of types, or NULL */
    int64_t n_parts, n, k;
    float scale;
    void *k_cache, *v_cache;      /* a recurrent op's state tensors: its conv windows, its state matrices */
    const float *cos, *sin;
    const float *w3, *w4;         /* a recurrent op's further weights */
    const int64_t *shape;         /* a recurrent op's sizes */
} decode_op_t;

typedef struct {
    int64_t n_heads, n_kv_heads, head_dim, block_size;
    int64_t kv;                   /* the KV cache's element type (kv_types.h) */
    float eps;
    int64_t width[DECODE_BUFFERS];
    const int64_t *state_slots;   /* each row's recurrent-state slot (hybrid models), set every step */
} decode_dims_t;

#endif
