/* The per-row operations of a prefill or mixed step (row_ops.h) over T rows, split over the
 * threads (OpenMP, torch's pool). In torch each is several passes over the step's activations
 * with a temporary per pass (rope: 4, the norm and the gate: 3); here each row is read and
 * written once, while it is in cache. */
#include <stdint.h>

#include "ferry_kernels.h"
#include "row_ops.h"

/* Below this many rows one thread does it: waking the pool costs more than the work. */
#define PARALLEL_ROWS 16

/* out[t] = rms_norm(x[t]) for T rows of H (x rows x_stride floats apart, out contiguous). */
void rms_norm_rows(const float *x, int64_t x_stride, const float *w, float *out, int64_t T, int64_t H, float eps) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * x_stride, w, out + t * H, 1, H, eps);
}

/* Rope in place on the first `heads` heads of T rows (row_stride floats apart), row t at position
 * positions[t] of the tables cos, sin [positions, D]. */
void rope_rows(float *x, int64_t row_stride, int64_t heads, int64_t D, const float *cos, const float *sin,
               const int64_t *positions, int64_t T) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) rope(x + t * row_stride, heads, D, cos + positions[t] * D, sin + positions[t] * D);
}

/* out [T, I] = act(gu[:, :I]) * gu[:, I:] for gu [T, 2 I]. */
void gated_act_rows(const float *gu, float *out, int64_t T, int64_t I, int64_t gelu) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) gated_act(gu + t * 2 * I, out + t * I, I, gelu);
}
