/* Paged decode attention on the CPU: each query reads its request's K/V in place,
 * through the block table, instead of gathering the context into a new tensor.
 *
 * q:      [B, Hq, D]      one query token per request
 * k, v:   [S, Hkv, D]     the layer's cache, S = num_blocks * block_size slots
 * tables: [B, max_blocks] block ids of each request
 * lens:   [B]             context length of each request (the query's own token included)
 * out:    [B, Hq, D]
 * Work is split over (request, KV head) pairs with OpenMP, sharing torch's thread pool: one
 * request alone still uses every thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* The G query heads that share KV head h, for one request: each context slot's K (then V) row
 * of that head, D floats, is read once for all G queries. */
static void one_group(const float *q, const float *k, const float *v, const int64_t *table,
                      int64_t L, float *o, int64_t h, int64_t G, int64_t Hkv, int64_t D,
                      int64_t block_size, float scale, float *scores) {
    const int64_t row = Hkv * D;
    for (int64_t j0 = 0, blk = 0; j0 < L; j0 += block_size, blk++) {
        const int64_t n = L - j0 < block_size ? L - j0 : block_size;
        const float *kb = k + table[blk] * block_size * row + h * D;
        for (int64_t t = 0; t < n; t++) {
            const float *kh = kb + t * row;
            for (int64_t g = 0; g < G; g++) {
                const float *qh = q + g * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                scores[g * L + j0 + t] = s * scale;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sh = scores + g * L;
        float m = sh[0];
        for (int64_t j = 1; j < L; j++) m = sh[j] > m ? sh[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < L; j++) { sh[j] = expf(sh[j] - m); sum += sh[j]; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < L; j++) sh[j] *= inv;
    }
    for (int64_t i = 0; i < G * D; i++) o[i] = 0.f;
    for (int64_t j0 = 0, blk = 0; j0 < L; j0 += block_size, blk++) {
        const int64_t n = L - j0 < block_size ? L - j0 : block_size;
        const float *vb = v + table[blk] * block_size * row + h * D;
        for (int64_t t = 0; t < n; t++) {
            const float *vh = vb + t * row;
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * L + j0 + t];
                float *oh = o + g * D;
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
}

void paged_decode_attention(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *lens, float *out,
                            int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale) {
    const int64_t G = Hq / Hkv;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * G * max_len);
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hkv; h++)
                one_group(q + (b * Hq + h * G) * D, k, v, tables + b * max_blocks, lens[b],
                          out + (b * Hq + h * G) * D, h, G, Hkv, D, block_size, scale, scores);
        free(scores);
    }
}
