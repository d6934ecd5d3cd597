/* The elementwise layers of the CPU path, float32, one pass each where PyTorch takes several
 * operators (and as many passes over memory, and as many OpenMP regions): RMSNorm with its residual
 * add, SiLU(gate) * up, and rotary embedding (the "neox" half rotation) in place.
 *
 * Numerics follow the PyTorch layers they stand in for: RMSNorm sums the squares in float32 (in
 * another order than PyTorch's reduction) and computes (x * rsqrt(mean + eps)) * weight; SiLU is
 * g / (1 + e^-g) with a vector e^x within 2 ulp of expf; RoPE is x1*cos - x2*sin and x2*cos + x1*sin
 * with each product rounded, then the sum (no fused multiply-add: -std=c11), bitwise PyTorch's.
 * Small calls (decode steps) stay on one thread: an OpenMP region costs more than their work.
 */
#include <math.h>
#include <stdint.h>

#include "vec_exp.h"

#define PARALLEL_MIN_ELEMENTS 65536

/* out = (x + residual) * rsqrt(mean((x + residual)^2) + eps) * weight, row by row; residual_out =
 * x + residual. residual NULL: no add (residual_out unused). x rows are x_stride floats apart; out,
 * residual and residual_out rows are contiguous. */
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                  int rows, int cols, int64_t x_stride, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * cols >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *restrict xr = x + (int64_t)r * x_stride;
        float *restrict o = out + (int64_t)r * cols;
        float sum = 0.0f;
        if (residual) {
            const float *restrict res = residual + (int64_t)r * cols;
            float *restrict s = residual_out + (int64_t)r * cols;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < cols; i++) {
                s[i] = xr[i] + res[i];
                sum += s[i] * s[i];
            }
            xr = s;
        } else {
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < cols; i++) sum += xr[i] * xr[i];
        }
        const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
        for (int i = 0; i < cols; i++) o[i] = (xr[i] * inv) * weight[i];
    }
}

/* out[r] = silu(x[r, :inter]) * x[r, inter:], x rows 2 * inter floats apart (the merged [gate | up]
 * projection), out contiguous. */
void silu_and_mul_f32(const float *x, float *out, int rows, int inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *restrict g = x + (int64_t)r * 2 * inter;
        const float *restrict u = g + inter;
        float *restrict o = out + (int64_t)r * inter;
        int i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i < inter; i += 16) {
            const __mmask16 m = inter - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (inter - i)) - 1u);
            const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
            const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(act, _mm512_maskz_loadu_ps(m, u + i)));
        }
#else
        for (; i < inter; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
#endif
    }
}

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
