/* The kernel library's boundary with Python: every function ferry/model/kernels/__init__.py calls
 * through ctypes, and every struct that crosses with them, declared once. Each kernel source
 * includes this header, so the compiler checks its definitions against these prototypes.
 *
 * FERRY_KERNEL_FUNCTIONS and FERRY_KERNEL_STRUCTS restate the boundary as tables: ferry_abi.c
 * asserts at compile time that each function row is its prototype, and exports both tables, which
 * load_kernels() compares at load with its own ctypes table (SIGNATURES, STRUCTS in
 * kernels/__init__.py). A difference in a name, an argument count or kind, a return kind or a
 * struct's size raises a RuntimeError there, instead of a call with the wrong arguments.
 *
 * To add a function: its prototype below, a row (return type, name, parameter types) in
 * FERRY_KERNEL_FUNCTIONS, and an entry (restype, argtypes) in SIGNATURES. To add a struct: its
 * typedef below, a row in FERRY_KERNEL_STRUCTS, and a ctypes.Structure mirror in STRUCTS. */
#ifndef FERRY_KERNELS_H
#define FERRY_KERNELS_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_ops.h"

/* One quantized weight type's facts: a row of quant_types.h's FERRY_QUANT_TYPES, exported by
 * quant_type_traits for quant.QUANT_TYPES's load-time check (its QuantType fields, in order). */
typedef struct {
    char name[8];    /* GGUF's name, e.g. "Q4_K" */
    int64_t id;      /* the GGML type id, which is the kernels' type id */
    int64_t block;   /* weights per block: 32, or a K-quant's super-block of 256 */
    int64_t bytes;   /* bytes per block */
    int64_t group;   /* weights per scale group of the q8 products: 16 or 32 */
    int64_t offset;  /* 1: w = a q + b, the block's float16 min (m, dmin) 2 bytes after d */
    int64_t shift;   /* levels stored unsigned as the level plus this; 0: stored as they are */
    int64_t d_at;    /* byte offset of the block's float16 scale d */
} ferry_qt_traits_t;

/* Paged decode attention (paged_attention.c): q [B, Hq, D], the layer's caches k, v [slots, Hkv,
 * D] of element type kv (kv_types.h), tables [B, max_blocks], lens [B], out [B, Hq, D]; window 0
 * for none; sinks [Hq] per-head sink logits in every softmax denominator (NULL: none). */
void paged_decode_attention(const float *q, const void *k, const void *v, const int64_t *tables,
                            const int64_t *lens, float *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t window, int64_t kv,
                            const float *sinks);
/* n floats into a cache row of type kv, as the fused decode writes them (paged_attention.c). */
void kv_store(void *dst, const float *src, int64_t n, int64_t kv);
/* Prefill attention over spans [n_spans][4] (prefill_attention.c), sinks as decode's: 1 served, 0 a
 * head size it does not take, -1 out of memory (MemoryError on the Python side). */
int paged_prefill_attention(const float *q, int64_t q_stride, const void *k, const void *v, const int64_t *slots,
                            const int64_t *spans, int64_t n_spans, float *out, int64_t Hq, int64_t Hkv, int64_t D,
                            float scale, int64_t window, int64_t kv, const float *sinks);
/* y[M, N] = x[M, K] @ w[N, K]^T in float32 (skinny_gemm.c). */
void skinny_gemm(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K);
/* y[M, N] = x[M, K] @ dequant(w)^T, type a quant type id plus FERRY_QT_Q8 / FERRY_QT_PACKED (quant_gemm.c). */
void quant_gemm(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t type);
/* out[i] = dequant(w)[ids[i]], every row when ids is NULL (quant_gemm.c). */
void quant_dequant(const uint8_t *w, const int64_t *ids, float *out, int64_t n, int64_t K, int64_t type);
/* The q8 variant in use; isa >= 0 picks one, -1 the best, -2 asks (quant_q8.c). */
int64_t quant_q8_isa(int64_t isa);
/* The int8 multiply-add peak of variant isa, per second over all threads (int8_peak.c). */
double int8_peak(int64_t isa, int64_t iters);
/* Bytes per second the OpenMP team reads from a buffer of `bytes`, best of reps (int8_peak.c). */
double read_bandwidth(int64_t bytes, int64_t reps);
/* Where each byte of a 16-row group's blocks sits in its packed record; -1: type not packed
 * (quant_q8_packed.c). */
int64_t q8_packed_index(int64_t type, int64_t *idx);
/* Row i of the quant type table into out; returns the row count (quant_dequant.c). */
int64_t quant_type_traits(int64_t i, ferry_qt_traits_t *out);
/* The per-row operations of prefill and mixed steps (row_ops.c). */
void rms_norm_rows(const float *x, int64_t x_stride, const float *w, float *out, int64_t T, int64_t H, float eps);
void rope_rows(float *x, int64_t row_stride, int64_t heads, int64_t D, const float *cos, const float *sin,
               const int64_t *positions, int64_t T);
void gated_act_rows(const float *gu, float *out, int64_t T, int64_t I, int64_t gelu);
/* The recurrent layers' prefill work (recurrent_prefill.c): a chunk's causal depthwise convolution
 * over T rows of C channels from its window; a chunk's gated delta rule (Gated DeltaNet), shape
 * [T, hv, dk, dv, chunk, q/k, v, g/beta and out row strides, hk, tiled, norm]: 0, or 1 when out of memory. */
void conv_rows(const float *x, int64_t x_stride, const float *window, const float *w, const float *bias, float *y,
               float *new_window, int64_t T, int64_t C, int64_t K, int64_t silu);
int gdn_prefill(const float *q, const float *k, const float *v, const float *g, const float *beta,
                const float *state_in, float *state_out, float *out, const int64_t *shape);
/* The layers of a decode-only step as a list of ops over row buffers (decode_layers.c,
 * decode_ops.h): 0, or DECODE_OOM / DECODE_BAD_OP. */
int decode_ops(const decode_op_t *ops, int64_t n_ops, const decode_dims_t *d, float *x, float *out, int64_t B,
               const int64_t *positions, const int64_t *tables, int64_t max_blocks, const int64_t *lens,
               const int64_t *slots, double *times);
/* One decode token of a Gated DeltaNet layer for B rows, each in its state slot (recurrent_decode.c):
 * 0, or 1 when out of memory. */
int gdn_decode(const float *in, int64_t in_stride, float *out, int64_t out_stride, int64_t B, const int64_t *slots,
               float *windows, float *states, const float *conv_w, const float *neg_a, const float *dt_bias,
               const float *norm_w, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t K, int64_t tiled,
               float eps);
/* One decode token of LFM2's gated short convolution for B rows (recurrent_decode.c): 0, or 1 when out of memory. */
int short_conv_decode(const float *in, int64_t in_stride, float *out, int64_t out_stride, int64_t B,
                      const int64_t *slots, float *windows, const float *conv_w, const float *conv_b, int64_t H,
                      int64_t K);
/* One decode token of a Mamba2 layer for B rows (recurrent_decode.c): 0, or 1 when out of memory. */
int mamba2_decode(const float *in, int64_t in_stride, float *out, int64_t out_stride, int64_t B, const int64_t *slots,
                  float *windows, float *states, const float *conv_w, const float *conv_b, const float *params,
                  const float *norm_w, const int64_t *shape, float eps);
/* DECODE_OPS and DECODE_BUFFERS into out[2], for the Python side's op and buffer names. */
void decode_counts(int64_t *out);
/* Row i of FERRY_KERNEL_FUNCTIONS: its name and signature ("v:ppi": return kind, then one kind per
 * argument: v void, p pointer, i int64_t, I int, f float, d double); returns the row count. */
int64_t ferry_abi_function(int64_t i, const char **name, const char **sig);
/* Row i of FERRY_KERNEL_STRUCTS: its name and sizeof; returns the row count. */
int64_t ferry_abi_struct(int64_t i, const char **name, int64_t *size);

/* The prototypes above as rows X(return type, name, (parameter types)). */
#define FERRY_KERNEL_FUNCTIONS(X)                                                                           \
    X(void, paged_decode_attention, (const float *, const void *, const void *, const int64_t *,            \
                                     const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                     int64_t, float, int64_t, int64_t, const float *))                      \
    X(void, kv_store, (void *, const float *, int64_t, int64_t))                                            \
    X(int, paged_prefill_attention, (const float *, int64_t, const void *, const void *, const int64_t *,   \
                                     const int64_t *, int64_t, float *, int64_t, int64_t, int64_t, float,   \
                                     int64_t, int64_t, const float *))                                      \
    X(void, skinny_gemm, (const float *, const float *, float *, int64_t, int64_t, int64_t))                \
    X(void, quant_gemm, (const float *, const uint8_t *, float *, int64_t, int64_t, int64_t, int64_t))      \
    X(void, quant_dequant, (const uint8_t *, const int64_t *, float *, int64_t, int64_t, int64_t))          \
    X(int64_t, quant_q8_isa, (int64_t))                                                                     \
    X(double, int8_peak, (int64_t, int64_t))                                                                \
    X(double, read_bandwidth, (int64_t, int64_t))                                                           \
    X(int64_t, q8_packed_index, (int64_t, int64_t *))                                                       \
    X(int64_t, quant_type_traits, (int64_t, ferry_qt_traits_t *))                                           \
    X(void, rms_norm_rows, (const float *, int64_t, const float *, float *, int64_t, int64_t, float))       \
    X(void, rope_rows, (float *, int64_t, int64_t, int64_t, const float *, const float *, const int64_t *,  \
                        int64_t))                                                                           \
    X(void, gated_act_rows, (const float *, float *, int64_t, int64_t, int64_t))                            \
    X(void, conv_rows, (const float *, int64_t, const float *, const float *, const float *, float *,       \
                        float *, int64_t, int64_t, int64_t, int64_t))                                       \
    X(int, gdn_prefill, (const float *, const float *, const float *, const float *, const float *,         \
                         const float *, float *, float *, const int64_t *))                                 \
    X(int, decode_ops, (const decode_op_t *, int64_t, const decode_dims_t *, float *, float *, int64_t,     \
                        const int64_t *, const int64_t *, int64_t, const int64_t *, const int64_t *, double *)) \
    X(void, decode_counts, (int64_t *))                                                                     \
    X(int64_t, ferry_abi_function, (int64_t, const char **, const char **))                                 \
    X(int64_t, ferry_abi_struct, (int64_t, const char **, int64_t *))

/* The structs above as rows X(type). */
#define FERRY_KERNEL_STRUCTS(X) X(ferry_qt_traits_t) X(decode_op_t) X(decode_dims_t) X(wpart_t)

/* Inside the library, not called from Python: an allocation that fails in a function that returns
 * nothing ends the process with a message naming what and how much (ferry_abi.c); functions that
 * return an int report it as an error code instead. */
__attribute__((noreturn, cold)) void ferry_oom(const char *what, size_t bytes);
static inline void *ferry_alloc(size_t bytes, const char *what) {
    void *p = malloc(bytes);
    if (!p && bytes) ferry_oom(what, bytes);
    return p;
}
#endif
