/* Paged decode attention on the CPU: each query reads its request's K/V in place,
 * through the block table, instead of gathering the context into a new tensor.
 *
 * q:      [B, Hq, D]      one query token per request
 * k, v:   [S, Hkv, D]     the layer's cache, S = num_blocks * block_size slots
 * tables: [B, max_blocks] block ids of each request
 * lens:   [B]             context length of each request (the query's own token included)
 * out:    [B, Hq, D]
 * Work is split over requests with OpenMP, sharing torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* All heads of one request: each context slot's K (then V) row, Hkv * D floats, is read
 * once and whole, so every cache line fetched from memory is used. */
static void one_request(const float *q, const float *k, const float *v, const int64_t *table,
                        int64_t L, float *o, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t block_size, float scale, float *scores) {
    const int64_t G = Hq / Hkv, row = Hkv * D;
    for (int64_t j0 = 0, blk = 0; j0 < L; j0 += block_size, blk++) {
        const int64_t n = L - j0 < block_size ? L - j0 : block_size;
        const float *kb = k + table[blk] * block_size * row;
        for (int64_t t = 0; t < n; t++) {
            const float *kj = kb + t * row;
            for (int64_t h = 0, hq = 0; h < Hkv; h++) {
                const float *kh = kj + h * D;
                for (int64_t g = 0; g < G; g++, hq++) {
                    const float *qh = q + hq * D;
                    float s = 0.f;
                    for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                    scores[hq * L + j0 + t] = s * scale;
                }
            }
        }
    }
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sh = scores + hq * L;
        float m = sh[0];
        for (int64_t j = 1; j < L; j++) m = sh[j] > m ? sh[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < L; j++) { sh[j] = expf(sh[j] - m); sum += sh[j]; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < L; j++) sh[j] *= inv;
    }
    for (int64_t i = 0; i < Hq * D; i++) o[i] = 0.f;
    for (int64_t j0 = 0, blk = 0; j0 < L; j0 += block_size, blk++) {
        const int64_t n = L - j0 < block_size ? L - j0 : block_size;
        const float *vb = v + table[blk] * block_size * row;
        for (int64_t t = 0; t < n; t++) {
            const float *vj = vb + t * row;
            for (int64_t h = 0, hq = 0; h < Hkv; h++) {
                const float *vh = vj + h * D;
                for (int64_t g = 0; g < G; g++, hq++) {
                    const float p = scores[hq * L + j0 + t];
                    float *oh = o + hq * D;
                    for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
                }
            }
        }
    }
}

void paged_decode_attention(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *lens, float *out,
                            int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t block_size, int64_t max_blocks, float scale) {
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * Hq * max_len);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++)
            one_request(q + b * Hq * D, k, v, tables + b * max_blocks, lens[b], out + b * Hq * D,
                        Hq, Hkv, D, block_size, scale, scores);
        free(scores);
    }
}
