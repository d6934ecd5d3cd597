/* The CPU path's linear layers, float32: y = x @ W^T (+ bias) for any number of rows, batch-invariant,
 * faster than oneDNN where a decode step has few rows.
 *
 * Layout: W [N][K] is packed once into strips of 16 output columns, [ceil(N/16)][K][16] (zero columns
 * pad the last strip), so one k of a strip is one 64-byte vector. A tile of up to 6 rows x 4 strips
 * keeps its 24 sums in registers; for each k it loads the 4 strip vectors and multiplies them by each
 * row's x[k], broadcast.
 *
 * Order of the sums: each output is one fused multiply-add chain over k, restarted from zero at every
 * ``seg`` elements of K, the segments' sums then added left to right, the bias added last. A row's
 * sums never depend on the other rows or on the thread count (threads split the strips), so the
 * product is batch-invariant by construction, one row alone included. The Python side passes seg =
 * K up to 512, 512 up to 1,024 and 1,024 beyond: oneDNN's float32 order for two or more rows on the
 * AVX-512 development machines (measured for K from 64 to 8,192, N from 17 to 49,152, 2 to 1,024
 * rows, 1 and 2 threads), so there the two give the same bits. At packing it checks this kernel
 * against the scalar reference below for each weight shape (cpu_linear.py).
 *
 * Speed (2-core AMD EPYC development machine, SmolLM2-135M's 121 products of a decode step, weights
 * streamed from memory): 1.4-1.9x oneDNN at 1-4 rows, 1.1-1.3x at 8-64 rows, level at 471 and 1,024
 * rows. Where the compiler has no AVX-512 this file builds stubs and ``rows_linear_vectorized`` says 0.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#endif

#define STRIP 16 /* output columns per strip: one float32 vector */
#define MAX_TILE_ROWS 6
#define MAX_TILE_STRIPS 4
/* k steps a first row tile prefetches ahead (see TILE); a decode step's 121 products of SmolLM2-135M,
 * weights streamed from memory (Intel Xeon, 2 cores): 7-9 % faster at 8-32 rows than without, 2 % at
 * 1 row; 8, 16, 24 and 32 measured alike, and prefetching the next strip group instead gained less */
#ifndef AHEAD
#define AHEAD 32
#endif

int rows_linear_vectorized(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* The same product and order, one output at a time in scalar code (fmaf: one rounding, like the
 * vector FMA), reading W [n][k] as it is: the tests' oracle for the vector kernel on any machine
 * (the vector kernel must equal it bitwise; whether it also equals this machine's oneDNN is a
 * separate question). Not used by the engine. */
void rows_linear_reference_f32(const float *x, const float *w, const float *bias, float *y, int m, int n, int k,
                               int64_t ldx, int64_t ldy, int seg) {
    for (int i = 0; i < m; i++)
        for (int c = 0; c < n; c++) {
            float total = 0.0f;
            for (int k0 = 0; k0 < k; k0 += seg) {
                int k1 = k - k0 > seg ? k0 + seg : k;
                float chain = 0.0f;
                for (int kk = k0; kk < k1; kk++) chain = fmaf(x[i * ldx + kk], w[(int64_t)c * k + kk], chain);
                total = k0 == 0 ? chain : total + chain;
            }
            y[i * ldy + c] = bias ? total + bias[c] : total;
        }
}

#if defined(__AVX512F__)

/* Pack W [n][k] into [ceil(n/16)][k][16]: each strip's rows read in order, zero columns past n. */
void rows_pack_f32(const float *w, float *out, int n, int k, int num_threads) {
    int strips = (n + STRIP - 1) / STRIP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int s = 0; s < strips; s++) {
        float *o = out + (int64_t)s * k * STRIP;
        for (int c = 0; c < STRIP; c++) {
            int col = s * STRIP + c;
            const float *row = w + (int64_t)col * k;
            if (col < n)
                for (int kk = 0; kk < k; kk++) o[(int64_t)kk * STRIP + c] = row[kk];
            else
                for (int kk = 0; kk < k; kk++) o[(int64_t)kk * STRIP + c] = 0.0f;
        }
    }
}

/* Rows [0, MR) x strips [0, NR): one K segment [k0, k1) as a chain from zero, then stored into y
 * (the first segment) or added to what y holds; the last strip's columns past n masked off. With
 * ``ahead``, each strip's weights are prefetched AHEAD k further on: the first row tile of a strip
 * group reads them from memory (the later tiles find them in cache), and the prefetches keep its
 * loads in flight while it multiplies. */
#define TILE(MR, NR)                                                                                        \
    static void tile_##MR##_##NR(const float *restrict x, int64_t ldx, const float *restrict w, int k,      \
                                 int k0, int k1, float *restrict y, int64_t ldy, int first, __mmask16 tail,  \
                                 int ahead) {                                                               \
        __m512 acc[MR][NR];                                                                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();           \
        const int64_t strip = (int64_t)k * STRIP;                                                           \
        const float *wk = w + (int64_t)k0 * STRIP;                                                          \
        for (int kk = k0; kk < k1; kk++, wk += STRIP) {                                                     \
            if (ahead)                                                                                      \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                        \
                    _mm_prefetch((const char *)(wk + AHEAD * STRIP + j * strip), _MM_HINT_T0);              \
            __m512 wv[NR];                                                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_ps(wk + j * strip);   \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                          \
                __m512 xv = _mm512_set1_ps(x[i * ldx + kk]);                                                \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] =                            \
                    _mm512_fmadd_ps(xv, wv[j], acc[i][j]);                                                  \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                          \
                float *dst = y + i * ldy + j * STRIP;                                                       \
                __mmask16 mask = j == NR - 1 ? tail : (__mmask16)0xFFFF;                                    \
                __m512 v = first ? acc[i][j] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), acc[i][j]);  \
                _mm512_mask_storeu_ps(dst, mask, v);                                                        \
            }                                                                                               \
    }

#define TILES_OF(MR) TILE(MR, 1) TILE(MR, 2) TILE(MR, 3) TILE(MR, 4)
TILES_OF(1) TILES_OF(2) TILES_OF(3) TILES_OF(4) TILES_OF(5) TILES_OF(6)

typedef void (*tile_fn)(const float *, int64_t, const float *, int, int, int, float *, int64_t, int, __mmask16, int);
#define ROW_OF(MR) {tile_##MR##_1, tile_##MR##_2, tile_##MR##_3, tile_##MR##_4}
static const tile_fn TILES[MAX_TILE_ROWS][MAX_TILE_STRIPS] = {ROW_OF(1), ROW_OF(2), ROW_OF(3),
                                                              ROW_OF(4), ROW_OF(5), ROW_OF(6)};

/* y [m][n] (rows ldy floats apart) = x [m][k] (rows ldx apart) @ W^T + bias (NULL: none), W packed by
 * rows_pack_f32. Each thread takes a contiguous run of strips; returns 0, or -1 for a bad argument
 * (nothing written). */
int rows_linear_f32(const float *x, const float *w, const float *bias, float *y, int m, int n, int k,
                    int64_t ldx, int64_t ldy, int seg, int num_threads) {
    if (m < 0 || n <= 0 || k <= 0 || seg <= 0 || ldx < k || ldy < n || num_threads < 1) return -1;
    int strips = (n + STRIP - 1) / STRIP;
    if (num_threads > strips) num_threads = strips;
#pragma omp parallel num_threads(num_threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int s0 = (int)((int64_t)strips * t / nt), s1 = (int)((int64_t)strips * (t + 1) / nt);
        for (int s = s0; s < s1; s += MAX_TILE_STRIPS) {
            int ns = s1 - s < MAX_TILE_STRIPS ? s1 - s : MAX_TILE_STRIPS;
            int tail_cols = n - (s + ns - 1) * STRIP;
            __mmask16 tail = tail_cols >= STRIP ? (__mmask16)0xFFFF : (__mmask16)((1u << tail_cols) - 1);
            const float *ws = w + (int64_t)s * k * STRIP;
            for (int m0 = 0; m0 < m; m0 += MAX_TILE_ROWS) {
                int mr = m - m0 < MAX_TILE_ROWS ? m - m0 : MAX_TILE_ROWS;
                float *ys = y + m0 * ldy + s * STRIP;
                for (int k0 = 0; k0 < k; k0 += seg) {
                    int k1 = k - k0 > seg ? k0 + seg : k;
                    TILES[mr - 1][ns - 1](x + m0 * ldx, ldx, ws, k, k0, k1, ys, ldy, k0 == 0, tail, m0 == 0);
                }
                if (bias) {
                    int c1 = (s + ns) * STRIP < n ? (s + ns) * STRIP : n;
                    for (int i = 0; i < mr; i++)
                        for (int c = s * STRIP; c < c1; c++) y[(m0 + i) * ldy + c] += bias[c];
                }
            }
        }
    }
    return 0;
}

#else /* no AVX-512: the Python side keeps oneDNN (rows_linear_vectorized() == 0) */

void rows_pack_f32(const float *w, float *out, int n, int k, int num_threads) {
    (void)w, (void)out, (void)n, (void)k, (void)num_threads;
}

int rows_linear_f32(const float *x, const float *w, const float *bias, float *y, int m, int n, int k,
                    int64_t ldx, int64_t ldy, int seg, int num_threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy, (void)seg;
    (void)num_threads;
    return -1;
}

#endif
