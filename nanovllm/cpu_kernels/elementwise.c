/* Elementwise work of the CPU path, float32, one pass where PyTorch takes several operators (and as
 * many passes over memory, and as many OpenMP regions), with PyTorch's results bitwise: rotary
 * embedding (the "neox" half rotation) in place, RMSNorm with its residual add, and the greedy rows of
 * the sampler.
 *
 * RoPE is x1*cos - x2*sin and x2*cos + x1*sin with each product rounded, then the sum (no fused
 * multiply-add: -std=c11), as PyTorch computes it. RMSNorm adds its squares in the order of
 * PyTorch's float32 sum over a row (ATen's cascade sum, SumKernel.cpp), so it too is PyTorch's result
 * bitwise; the vector width that order depends on is found by the Python side, which also checks
 * the result against torch before using it. A first RMSNorm here summed in another order: its
 * last-bit differences moved a greedy token of the FP8-cache golden test (BENCHMARKS.md). SiLU times
 * up is PyTorch's too: x / (1 + e^-x) with torch's own Sleef e^x (its address handed in) in PyTorch's
 * vector blocks, libm's on the scalar tails, over the pieces torch's threads would take. Small
 * calls (decode steps) stay on one thread: an OpenMP region costs more than their work.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "cpu_kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

enum { SUM_MAX_LANES = 16, SUM_LEVELS = 4, SUM_ILP = 4 };

/* The sum of the squares of a row of n floats, added in the order of ATen's float32 sum over a
 * contiguous last dimension with ``lanes``-float vectors (SumKernel.cpp: vectorized_inner_sum ->
 * row_sum -> multi_row_sum): the row's vectors are read as rows of four (ILP); each of the four
 * accumulators adds its column in a cascade of up to four levels (level_step vectors per level-0
 * chunk); leftover vectors go to the first accumulator; the four are added in order; then the scalar
 * tail and the lanes in order onto a float starting at 0. Each square is rounded to float first
 * (PyTorch materialises x.pow(2)). Lane-wise sums: plain loops give the vector unit's results. */
static inline __attribute__((always_inline)) float cascade_sum_of_squares(const float *restrict x, int64_t n,
                                                                         int lanes) {
    const int64_t vec_size = n / lanes, size = vec_size / SUM_ILP;
    int64_t bits = 1; /* CeilLog2(size): 1 up to 2, else the bit width of size - 1 */
    if (size > 2)
        for (bits = 0; ((size - 1) >> bits) != 0; bits++) {
        }
    const int64_t level_power = bits / SUM_LEVELS > 4 ? bits / SUM_LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[SUM_LEVELS][SUM_ILP][SUM_MAX_LANES] = {{{0.0f}}};
    int64_t i = 0;
#define ADD_SQUARES(dst, v)                                                     \
    do {                                                                         \
        const float *restrict src = x + (int64_t)(v) * lanes;                    \
        for (int l = 0; l < lanes; l++) (dst)[l] += src[l] * src[l];             \
    } while (0)
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < SUM_ILP; k++) ADD_SQUARES(acc[0][k], SUM_ILP * i + k);
        for (int j = 1; j < SUM_LEVELS; j++) {
            for (int k = 0; k < SUM_ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < SUM_ILP; k++) ADD_SQUARES(acc[0][k], SUM_ILP * i + k);
    for (int j = 1; j < SUM_LEVELS; j++)
        for (int k = 0; k < SUM_ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = size * SUM_ILP; v < vec_size; v++) ADD_SQUARES(acc[0][0], v);
#undef ADD_SQUARES
    for (int k = 1; k < SUM_ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = vec_size * lanes; t < n; t++) {
        const float square = x[t] * x[t];
        total += square;
    }
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* RMSNorm of rows of n floats with PyTorch's float32 arithmetic (F.rms_norm), given the vector width
 * ``lanes`` (1..16) of PyTorch's row sum: with a residual, s = x + residual goes to res_out first
 * (else s = x); out = (s * (1 / sqrt(sum(s^2) / n + eps))) * weight. x, residual: rows x_stride /
 * r_stride floats apart; out, res_out contiguous. Returns 0, or -1 (nothing written) for a lane
 * count outside 1..16. */
int rms_norm_f32(const float *x, const float *residual, float *out, float *res_out, const float *weight, int rows,
                 int n, int64_t x_stride, int64_t r_stride, float eps, int lanes, int num_threads) {
    if (lanes < 1 || lanes > SUM_MAX_LANES) return -1;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * n >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *restrict s = x + (int64_t)r * x_stride;
        if (residual != NULL) {
            float *restrict sum = res_out + (int64_t)r * n;
            const float *restrict add = residual + (int64_t)r * r_stride;
#pragma omp simd
            for (int i = 0; i < n; i++) sum[i] = s[i] + add[i];
            s = sum;
        }
        /* the same code; a constant lane count for the widths PyTorch uses (AVX2, AVX-512) */
        const float sum = lanes == 8 ? cascade_sum_of_squares(s, n, 8)
                          : lanes == 16 ? cascade_sum_of_squares(s, n, 16)
                                        : cascade_sum_of_squares(s, n, lanes);
        const float mean = sum / (float)n;
        const float inv = 1.0f / sqrtf(mean + eps);
        float *restrict o = out + (int64_t)r * n;
#pragma omp simd
        for (int i = 0; i < n; i++) o[i] = (s[i] * inv) * weight[i];
    }
    return 0;
}

#if defined(__AVX2__)
typedef __m256 (*exp8_fn)(__m256);
static exp8_fn sleef_exp8; /* torch's Sleef_expf8_u10, set by set_sleef_exp */
#if defined(__AVX512F__)
typedef __m512 (*exp16_fn)(__m512);
static exp16_fn sleef_exp16; /* Sleef_expf16_u10 */
#endif
#endif

/* The e^x that torch's vectorised float kernels call (8 and 16 lanes; NULL where absent). */
void set_sleef_exp(void *exp8, void *exp16) {
#if defined(__AVX2__)
    sleef_exp8 = (exp8_fn)exp8;
#if defined(__AVX512F__)
    sleef_exp16 = (exp16_fn)exp16;
#endif
#endif
    (void)exp8, (void)exp16;
}

/* PyTorch's scalar SiLU (a loop's tail): not vectorised by the compiler, whose vector e^x would differ */
static __attribute__((noinline)) float silu_scalar(float x) { return x / (1.0f + expf(-x)); }

/* out = silu(gate) * up over one run of m floats, in PyTorch's blocks: two vectors of ``lanes``
 * floats at a time from the run's start, then the tail one float at a time. */
static void silu_mul_run(const float *restrict x, const float *restrict y, float *restrict o, int m, int lanes) {
    int i = 0;
#if defined(__AVX2__)
    if (lanes == 8 && sleef_exp8 != NULL) {
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i <= m - 16; i += 16)
            for (int h = i; h < i + 16; h += 8) {
                const __m256 v = _mm256_loadu_ps(x + h);
                const __m256 silu = _mm256_div_ps(v, _mm256_add_ps(one, sleef_exp8(_mm256_sub_ps(zero, v))));
                _mm256_storeu_ps(o + h, _mm256_mul_ps(silu, _mm256_loadu_ps(y + h)));
            }
    }
#if defined(__AVX512F__)
    if (lanes == 16 && sleef_exp16 != NULL) {
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        for (; i <= m - 32; i += 32)
            for (int h = i; h < i + 32; h += 16) {
                const __m512 v = _mm512_loadu_ps(x + h);
                const __m512 silu = _mm512_div_ps(v, _mm512_add_ps(one, sleef_exp16(_mm512_sub_ps(zero, v))));
                _mm512_storeu_ps(o + h, _mm512_mul_ps(silu, _mm512_loadu_ps(y + h)));
            }
    }
#endif
#endif
    for (; i < m; i++) {
        const float silu = silu_scalar(x[i]);
        o[i] = silu * y[i];
    }
}

/* out = silu(gate) * up for rows of n floats (gate, up: rows gate_stride / up_stride floats apart, as
 * the halves of the merged [gate | up] projection; out contiguous), as PyTorch's F.silu(gate).mul_(up)
 * computes it, bitwise: the rows taken as one flat range cut into ``pieces`` equal pieces (torch's
 * threads' shares), each piece's part of a row one run. ``lanes``: the vector width of torch's
 * kernel (8 or 16; 1: every float scalar). Returns 0, or -1 (nothing written) where that width has
 * no e^x here. */
int silu_and_mul_f32(const float *gate, const float *up, float *out, int rows, int n, int64_t gate_stride,
                     int64_t up_stride, int lanes, int pieces, int num_threads) {
    if (lanes != 1) {
#if defined(__AVX2__)
        if (lanes == 8 && sleef_exp8 == NULL) return -1;
#if defined(__AVX512F__)
        if (lanes == 16 && sleef_exp16 == NULL) return -1;
#else
        if (lanes == 16) return -1;
#endif
        if (lanes != 8 && lanes != 16) return -1;
#else
        return -1;
#endif
    }
    const int64_t numel = (int64_t)rows * n, piece = (numel + pieces - 1) / pieces;
#pragma omp parallel for num_threads(num_threads) if (pieces > 1) schedule(static)
    for (int p = 0; p < pieces; p++) {
        const int64_t end = (p + 1) * piece < numel ? (p + 1) * piece : numel;
        for (int64_t e = p * piece; e < end;) {
            const int64_t r = e / n, i = e % n, run = (r + 1) * n < end ? (r + 1) * n - e : end - e;
            silu_mul_run(gate + r * gate_stride + i, up + r * up_stride + i, out + e, (int)run, lanes);
            e += run;
        }
    }
    return 0;
}
