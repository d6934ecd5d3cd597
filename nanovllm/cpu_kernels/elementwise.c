/* Elementwise work of the CPU path, float32, one pass where PyTorch takes several operators (and as
 * many passes over memory, and as many OpenMP regions), with PyTorch's results bitwise: rotary
 * embedding (the "neox" half rotation) in place, and the greedy rows of the sampler.
 *
 * RoPE is x1*cos - x2*sin and x2*cos + x1*sin with each product rounded, then the sum (no fused
 * multiply-add: -std=c11), as PyTorch computes it. RMSNorm and SiLU were tried here too and dropped:
 * their float32 results differ from PyTorch's in the last bit (the order of a sum, a polynomial
 * e^x), which moved a greedy token of the FP8-cache golden test, for a gain the noise of the
 * development machine hid (BENCHMARKS.md). Small calls (decode steps) stay on one thread: an
 * OpenMP region costs more than their work.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMENTS 65536

/* Rotary embedding in place: for token t at position pos[t], each head's halves (x1, x2) become
 * (x1*cos - x2*sin, x2*cos + x1*sin) with the first half_dim entries of the position's cos / sin
 * table rows (table_stride floats apart). q: [tokens, heads, 2 * half_dim], rows q_stride floats
 * apart; k likewise. Returns 0, or -2 (before writing) when a position lies outside the tables. */
int rotary_neox_f32(float *q, float *k, const int64_t *pos, const float *cos_table, const float *sin_table,
                    int tokens, int heads, int kv_heads, int half_dim, int64_t q_stride, int64_t k_stride,
                    int64_t table_stride, int64_t table_rows, int num_threads) {
    for (int t = 0; t < tokens; t++)
        if (pos[t] < 0 || pos[t] >= table_rows) return -2;
    const int head_dim = 2 * half_dim;
#pragma omp parallel for num_threads(num_threads) \
    if ((int64_t)tokens * (heads + kv_heads) * head_dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int t = 0; t < tokens; t++) {
        const float *restrict c = cos_table + pos[t] * table_stride;
        const float *restrict s = sin_table + pos[t] * table_stride;
        for (int h = 0; h < heads + kv_heads; h++) {
            float *restrict x = h < heads ? q + (int64_t)t * q_stride + (int64_t)h * head_dim
                                          : k + (int64_t)t * k_stride + (int64_t)(h - heads) * head_dim;
#pragma omp simd
            for (int i = 0; i < half_dim; i++) {
                const float x1 = x[i], x2 = x[i + half_dim];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half_dim] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return 0;
}

/* Greedy rows of the sampler in one pass over each row: tokens[r] = the first index of the row's
 * maximum (torch.argmax's rule), finite[r] = 1 when every logit of the row is finite, else 0 (the
 * engine ends such a request; its token is discarded). logits rows row_stride floats apart. Two
 * vector passes: the maximum and the finiteness, then the first index holding the maximum. */
void greedy_f32(const float *logits, int64_t *tokens, uint8_t *finite, int rows, int vocab, int64_t row_stride,
                int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * vocab >= 4 * PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *restrict x = logits + (int64_t)r * row_stride;
        float best = -INFINITY, nonfinite = 0.0f;
#pragma omp simd reduction(max : best) reduction(+ : nonfinite)
        for (int i = 0; i < vocab; i++) {
            best = x[i] > best ? x[i] : best;
            nonfinite += x[i] - x[i]; /* 0 for a finite logit, NaN for inf or NaN */
        }
        int64_t arg = 0;
        for (int i = 0; i < vocab; i++)
            if (x[i] == best) {
                arg = i;
                break;
            }
        const int all_finite = nonfinite == 0.0f;
        tokens[r] = arg;
        finite[r] = (uint8_t)all_finite;
    }
}
