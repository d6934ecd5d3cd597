/* What the rows kernel's two weight forms share (rows_linear.c: float32 strips; rows_quant.c: the
 * strips kept in a quantized format and dequantized as they are read): the strip width, the
 * instruction-set test, the drivers' frame (the argument check, each thread's run of strips, the bias
 * added last) and the float32 product of one strip group, which rows_quant.c runs over strips it has
 * dequantized. */
#ifndef NANOVLLM_ROWS_FRAME_H
#define NANOVLLM_ROWS_FRAME_H
#include <stdint.h>

#define STRIP 16 /* output columns per strip: one AVX-512 float32 vector, two AVX2 ones */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ROWS_VECTORIZED 1
#include <immintrin.h>
#include <omp.h>

/* A bad argument: m < 0, an empty output or K, a segment or thread count below one, or a row stride
 * shorter than its row. */
static inline int rows_bad_arguments(int m, int n, int k, int64_t ldx, int64_t ldy, int seg, int num_threads) {
    return m < 0 || n <= 0 || k <= 0 || seg <= 0 || ldx < k || ldy < n || num_threads < 1;
}

/* The calling thread's contiguous run of strips, [*s0, *s1): the strips split evenly over the team. */
static inline void thread_strips(int strips, int *s0, int *s1) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    *s0 = (int)((int64_t)strips * t / nt), *s1 = (int)((int64_t)strips * (t + 1) / nt);
}

/* The bias, added last (after every segment's sum) to the strips [s, s + ns) of rows [0, m). */
static inline void add_bias_strips(float *y, int64_t ldy, const float *bias, int m, int n, int s, int ns) {
    int c1 = (s + ns) * STRIP < n ? (s + ns) * STRIP : n;
    for (int i = 0; i < m; i++)
        for (int c = s * STRIP; c < c1; c++) y[i * ldy + c] += bias[c];
}

/* How many strips a driver takes at a time for m rows (as many as one row tile spans). */
int rows_group_strips(int m);

/* One strip group of float32 strips: ns (1 to rows_group_strips(m)) strips from ``ws``, each k x 16
 * floats, the next k * 16 floats on; all m rows of x into the output columns from ``ys``, the last
 * strip's first ``tail_cols`` (1-16) of them. No bias. */
void rows_strip_group_f32(const float *x, int64_t ldx, const float *ws, int k, int m, float *ys, int64_t ldy, int seg,
                          int ns, int tail_cols);
#else
#define ROWS_VECTORIZED 0
#endif

#endif
