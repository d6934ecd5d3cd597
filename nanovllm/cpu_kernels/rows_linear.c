/* The CPU path's linear layers, float32: y = x @ W^T (+ bias) for any number of rows, batch-invariant,
 * faster than oneDNN where a decode step has few rows.
 *
 * Layout: W [N][K] is packed once into strips of 16 output columns, [ceil(N/16)][K][16] (zero columns
 * pad the last strip), so one k of a strip is one 64-byte vector. A tile of up to 6 rows x 4 strips
 * keeps its 24 sums in registers; for each k it loads the 4 strip vectors and multiplies them by each
 * row's x[k], broadcast. A decode step's 7-48 rows go through K in chunks of 24, every row tile through
 * a chunk before the next (partial sums spilled to a scratch buffer and reloaded, which is exact), so
 * the first tile's loads of the next chunk overlap the later tiles' arithmetic; more rows take whole
 * segments per tile.
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
 * Speed (SmolLM2-135M's 121 products of a decode step, weights streamed from memory): on a 2-core AMD
 * EPYC, before the K chunks, 1.4-1.9x oneDNN at 1-4 rows, 1.1-1.3x at 8-64 rows, level at 471 and 1,024
 * rows; the K chunks then gained 10-16 % at 7-16 rows and 7.5 % at 32 on a 2-core Intel Xeon.
 *
 * Without AVX-512, AVX2 with FMA (most laptops) runs the same layout and order with 8-float vectors,
 * two per strip, in tiles sized for its 16 registers (the AVX2 section below): the same bits as the
 * AVX-512 kernel and the scalar reference; on a 2-core AVX2 AMD EPYC, 1.4-1.7x oneDNN at 1-16 rows
 * and 1.1-1.2x at 32-1,024 (30 layers of SmolLM2-135M's products). With neither, this file builds
 * stubs and ``rows_linear_vectorized`` says 0.
 */
#include <math.h>
#include <stdint.h>
#include "cpu_kernels.h"
#include "rows_frame.h"

/* a prefetch address ``offset`` floats on from ``p``, made as an integer: near the end of the packed
 * weights it lies past them (prefetching there is harmless), where pointer arithmetic would be
 * undefined */
#define ahead_of(p, offset) ((const char *)((uintptr_t)(p) + (uintptr_t)((offset) * (int64_t)sizeof(float))))
#define MAX_TILE_ROWS 6
#define MAX_TILE_STRIPS 4
/* k steps a first row tile prefetches ahead (see TILE); a decode step's 121 products of SmolLM2-135M,
 * weights streamed from memory (Intel Xeon, 2 cores): 7-9 % faster at 8-32 rows than without, 2 % at
 * 1 row; 8, 16, 24 and 32 measured alike, and prefetching the next strip group instead gained less */
#ifndef AHEAD
#define AHEAD 32
#endif
/* 7 to CHUNK_MAX_ROWS rows (decode steps) go through K in chunks of KC (chunked_rows); a decode
 * step's 121 products of SmolLM2-135M, weights streamed from memory (Intel Xeon, 2 cores): 9-15 %
 * faster than whole segments per row tile at 7-24 rows, 4-7 % at 32-40, 3 % at 48; at 64 rows and more
 * the partial sums' loads and stores cost more than the overlap gains (+5 % at 64, +15 % at 512) */
#ifndef KC
#define KC 24
#endif
#ifndef CHUNK_MAX_ROWS
#define CHUNK_MAX_ROWS 48
#endif

/* the most rows the chunked path takes (the packing check probes it, and one row more: the other path) */
int rows_linear_chunk_max_rows(void) { return CHUNK_MAX_ROWS; }

/* 2: AVX-512, 1: AVX2 with FMA, 0: neither (stubs; the Python side keeps oneDNN) */
int rows_linear_vectorized(void) {
#if defined(__AVX512F__)
    return 2;
#elif ROWS_VECTORIZED
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

#if ROWS_VECTORIZED

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

#endif

#if defined(__AVX512F__)

/* Rows [0, MR) x strips [0, NR): the k range [kc0, kc1) of one K segment. ``start``: the chain
 * starts from zero, else it goes on from the partial sums in ``acc`` (``lda`` floats a row apart).
 * ``finish``: the segment ends here, and its sums are stored into y (the first segment, ``first``) or
 * added to what y holds; else they go back to ``acc``. Spilling a chain to memory and reloading it
 * is exact, so splitting a segment into chunks leaves every output's order as it is. The last
 * strip's columns past n are masked off in y. With ``ahead`` > 0, each strip's weights are
 * prefetched ``ahead`` k further on, into L1, so its loads stay in flight while the tile multiplies. */
#define TILE(MR, NR)                                                                                        \
    static void tile_##MR##_##NR(const float *restrict x, int64_t ldx, const float *restrict w, int k,      \
                                 int kc0, int kc1, float *restrict acc_buf, int64_t lda, float *restrict y, \
                                 int64_t ldy, int start, int finish, int first, __mmask16 tail, int ahead) { \
        __m512 acc[MR][NR];                                                                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] =                                \
                start ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + i * lda + j * STRIP);               \
        const int64_t strip = (int64_t)k * STRIP;                                                           \
        const float *wk = w + (int64_t)kc0 * STRIP;                                                         \
        for (int kk = kc0; kk < kc1; kk++, wk += STRIP) {                                                   \
            if (ahead)                                                                                      \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                        \
                    _mm_prefetch(ahead_of(wk, (int64_t)ahead * STRIP + j * strip), _MM_HINT_T0);     \
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
                if (!finish) {                                                                              \
                    _mm512_storeu_ps(acc_buf + i * lda + j * STRIP, acc[i][j]);                             \
                    continue;                                                                               \
                }                                                                                           \
                float *dst = y + i * ldy + j * STRIP;                                                       \
                __mmask16 mask = j == NR - 1 ? tail : (__mmask16)0xFFFF;                                    \
                __m512 v = first ? acc[i][j] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), acc[i][j]);  \
                _mm512_mask_storeu_ps(dst, mask, v);                                                        \
            }                                                                                               \
    }

#define TILES_OF(MR) TILE(MR, 1) TILE(MR, 2) TILE(MR, 3) TILE(MR, 4)
TILES_OF(1) TILES_OF(2) TILES_OF(3) TILES_OF(4) TILES_OF(5) TILES_OF(6)

typedef void (*tile_fn)(const float *, int64_t, const float *, int, int, int, float *, int64_t, float *, int64_t,
                        int, int, int, __mmask16, int);
#define ROW_OF(MR) {tile_##MR##_1, tile_##MR##_2, tile_##MR##_3, tile_##MR##_4}
static const tile_fn TILES[MAX_TILE_ROWS][MAX_TILE_STRIPS] = {ROW_OF(1), ROW_OF(2), ROW_OF(3),
                                                              ROW_OF(4), ROW_OF(5), ROW_OF(6)};

/* One strip group (ns strips at ws, output columns from ys), all m rows (more than one tile, at most
 * CHUNK_MAX_ROWS): K in chunks of KC, every row tile through a chunk before the next chunk, the partial
 * sums kept in ``scratch``. The first row tile prefetches the next chunk while it multiplies this one,
 * so the weights stream from memory while the later tiles multiply from L1, where whole segments per
 * tile would leave the later tiles waiting for the first. */
static void chunked_rows(const float *x, int64_t ldx, const float *ws, int k, int m, float *ys, int64_t ldy,
                         int seg, __mmask16 tail, int ns, float *scratch) {
    const int lda = MAX_TILE_STRIPS * STRIP;
    for (int k0 = 0; k0 < k; k0 += seg) {
        int k1 = k - k0 > seg ? k0 + seg : k;
        for (int kc0 = k0; kc0 < k1; kc0 += KC) {
            int kc1 = k1 - kc0 > KC ? kc0 + KC : k1;
            for (int m0 = 0; m0 < m; m0 += MAX_TILE_ROWS) {
                int mr = m - m0 < MAX_TILE_ROWS ? m - m0 : MAX_TILE_ROWS;
                TILES[mr - 1][ns - 1](x + m0 * ldx, ldx, ws, k, kc0, kc1, scratch + m0 * lda, lda, ys + m0 * ldy,
                                      ldy, kc0 == k0, kc1 == k1, k0 == 0, tail, m0 == 0 ? KC : 0);
            }
        }
    }
}

int rows_group_strips(int m) {
    (void)m;
    return MAX_TILE_STRIPS;
}

void rows_strip_group_f32(const float *x, int64_t ldx, const float *ws, int k, int m, float *ys, int64_t ldy, int seg,
                          int ns, int tail_cols) {
    float scratch[CHUNK_MAX_ROWS * MAX_TILE_STRIPS * STRIP] __attribute__((aligned(64)));
    __mmask16 tail = tail_cols >= STRIP ? (__mmask16)0xFFFF : (__mmask16)((1u << tail_cols) - 1);
    if (m > MAX_TILE_ROWS && m <= CHUNK_MAX_ROWS) {
        chunked_rows(x, ldx, ws, k, m, ys, ldy, seg, tail, ns, scratch);
        return;
    }
    for (int m0 = 0; m0 < m; m0 += MAX_TILE_ROWS) {
        int mr = m - m0 < MAX_TILE_ROWS ? m - m0 : MAX_TILE_ROWS;
        for (int k0 = 0; k0 < k; k0 += seg) {
            int k1 = k - k0 > seg ? k0 + seg : k;
            TILES[mr - 1][ns - 1](x + m0 * ldx, ldx, ws, k, k0, k1, NULL, 0, ys + m0 * ldy, ldy, 1, 1, k0 == 0, tail,
                                  m0 == 0 ? AHEAD : 0);
        }
    }
}

#elif ROWS_VECTORIZED /* AVX2 with FMA: a strip is two 8-float vectors */

/* 16 vector registers (AVX-512 has 32): a tile keeps at most 12 sums, 2 x rows x strips. Rows x
 * strips per tile by the call's row count (rows_tile_shape): 1 x 3 and 2 x 2 for one and two rows (as
 * many weight streams in flight as the registers allow), else up to 6 x 1, the shape of the classic
 * Haswell SGEMM kernel (12 sums, the strip's two vectors, one broadcast row value). Each output lane
 * runs the same fused multiply-add chain as the AVX-512 kernel's, so the two give the same bits. */
#define AVX2_TILE_ROWS 6
#define AVX2_TILE_STRIPS 3

static void rows_tile_shape(int m, int *rows, int *strips) {
    if (m == 1)
        *rows = 1, *strips = 3;
    else if (m == 2)
        *rows = 2, *strips = 2;
    else
        *rows = AVX2_TILE_ROWS, *strips = 1;
}

/* tail[0] / tail[1]: the lanes of the last strip's low / high vector that are columns below n */
#define TILE2(MR, NR)                                                                                          \
    static void tile2_##MR##_##NR(const float *restrict x, int64_t ldx, const float *restrict w, int k,        \
                                  int kc0, int kc1, float *restrict acc_buf, int64_t lda, float *restrict y,   \
                                  int64_t ldy, int start, int finish, int first, const __m256i *tail,          \
                                  int full, int ahead) {                                                       \
        __m256 acc[MR][NR][2];                                                                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                               \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) acc[i][j][h] =                             \
                    start ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_buf + i * lda + j * STRIP + h * 8);      \
        const int64_t strip = (int64_t)k * STRIP;                                                              \
        const float *wk = w + (int64_t)kc0 * STRIP;                                                            \
        for (int kk = kc0; kk < kc1; kk++, wk += STRIP) {                                                      \
            if (ahead)                                                                                         \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                           \
                    _mm_prefetch(ahead_of(wk, (int64_t)ahead * STRIP + j * strip), _MM_HINT_T0);        \
            __m256 wv[NR][2];                                                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                             \
                wv[j][0] = _mm256_loadu_ps(wk + j * strip);                                                    \
                wv[j][1] = _mm256_loadu_ps(wk + j * strip + 8);                                                \
            }                                                                                                  \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                             \
                __m256 xv = _mm256_broadcast_ss(x + i * ldx + kk);                                             \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                           \
                    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) acc[i][j][h] =                         \
                        _mm256_fmadd_ps(xv, wv[j][h], acc[i][j][h]);                                           \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                               \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                          \
                    if (!finish) {                                                                             \
                        _mm256_storeu_ps(acc_buf + i * lda + j * STRIP + h * 8, acc[i][j][h]);                 \
                        continue;                                                                              \
                    }                                                                                          \
                    if (j == NR - 1 && !full && h == 1 && _mm256_testz_si256(tail[1], tail[1]))              \
                        continue; /* a last strip of 8 columns or fewer: its high half is past y's row */      \
                    float *dst = y + i * ldy + j * STRIP + h * 8;                                              \
                    if (j < NR - 1 || full) {                                                                  \
                        __m256 v = first ? acc[i][j][h] : _mm256_add_ps(_mm256_loadu_ps(dst), acc[i][j][h]);   \
                        _mm256_storeu_ps(dst, v);                                                              \
                    } else {                                                                                   \
                        __m256 v = first ? acc[i][j][h]                                                        \
                                         : _mm256_add_ps(_mm256_maskload_ps(dst, tail[h]), acc[i][j][h]);      \
                        _mm256_maskstore_ps(dst, tail[h], v);                                                  \
                    }                                                                                          \
                }                                                                                              \
    }

TILE2(1, 1) TILE2(1, 2) TILE2(1, 3) TILE2(2, 1) TILE2(2, 2) TILE2(3, 1) TILE2(4, 1) TILE2(5, 1) TILE2(6, 1)

typedef void (*tile2_fn)(const float *, int64_t, const float *, int, int, int, float *, int64_t, float *, int64_t,
                         int, int, int, const __m256i *, int, int);
/* [rows - 1][strips - 1]: only the shapes rows_tile_shape picks (and their smaller edges) exist */
static const tile2_fn TILES2[AVX2_TILE_ROWS][AVX2_TILE_STRIPS] = {
    {tile2_1_1, tile2_1_2, tile2_1_3}, {tile2_2_1, tile2_2_2, NULL}, {tile2_3_1, NULL, NULL},
    {tile2_4_1, NULL, NULL},           {tile2_5_1, NULL, NULL},      {tile2_6_1, NULL, NULL}};

/* One strip group, rows [0, m): whole K segments per row tile, or (chunked) K in chunks of KC with
 * every row tile through a chunk before the next, as the AVX-512 kernel's chunked_rows. */
static void strip_group2(const float *x, int64_t ldx, const float *ws, int k, int m, float *ys, int64_t ldy,
                         int seg, const __m256i *tail, int full, int ns, int tile_rows, int chunked,
                         float *scratch) {
    const int lda = AVX2_TILE_STRIPS * STRIP;
    for (int k0 = 0; k0 < k; k0 += seg) {
        int k1 = k - k0 > seg ? k0 + seg : k;
        int step = chunked ? KC : k1 - k0;
        for (int kc0 = k0; kc0 < k1; kc0 += step) {
            int kc1 = k1 - kc0 > step ? kc0 + step : k1;
            for (int m0 = 0; m0 < m; m0 += tile_rows) {
                int mr = m - m0 < tile_rows ? m - m0 : tile_rows;
                TILES2[mr - 1][ns - 1](x + m0 * ldx, ldx, ws, k, kc0, kc1, chunked ? scratch + m0 * lda : NULL, lda, ys + m0 * ldy,
                                       ldy, kc0 == k0, kc1 == k1, k0 == 0, tail, full,
                                       m0 == 0 ? (chunked ? KC : AHEAD) : 0);
            }
        }
    }
}

int rows_group_strips(int m) {
    int tile_rows, group;
    rows_tile_shape(m, &tile_rows, &group);
    return group;
}

void rows_strip_group_f32(const float *x, int64_t ldx, const float *ws, int k, int m, float *ys, int64_t ldy, int seg,
                          int ns, int tail_cols) {
    float scratch[CHUNK_MAX_ROWS * AVX2_TILE_STRIPS * STRIP] __attribute__((aligned(64)));
    int tile_rows, group;
    rows_tile_shape(m, &tile_rows, &group);
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i tail[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(tail_cols), lanes),
                       _mm256_cmpgt_epi32(_mm256_set1_epi32(tail_cols - 8), lanes)};
    strip_group2(x, ldx, ws, k, m, ys, ldy, seg, tail, tail_cols >= STRIP, ns, tile_rows,
                 m > tile_rows && m <= CHUNK_MAX_ROWS, scratch);
}

#endif

#if ROWS_VECTORIZED

/* y [m][n] (rows ldy floats apart) = x [m][k] (rows ldx apart) @ W^T + bias (NULL: none), W packed by
 * rows_pack_f32. Each thread takes a contiguous run of strips, a group of strips at a time (as many as
 * a row tile takes: rows_group_strips); returns 0, or -1 for a bad argument (nothing written). */
int rows_linear_f32(const float *x, const float *w, const float *bias, float *y, int m, int n, int k,
                    int64_t ldx, int64_t ldy, int seg, int num_threads) {
    if (rows_bad_arguments(m, n, k, ldx, ldy, seg, num_threads)) return -1;
    int strips = (n + STRIP - 1) / STRIP;
    if (num_threads > strips) num_threads = strips;
    int group = rows_group_strips(m);
#pragma omp parallel num_threads(num_threads)
    {
        int s0, s1;
        thread_strips(strips, &s0, &s1);
        for (int s = s0; s < s1; s += group) {
            int ns = s1 - s < group ? s1 - s : group;
            rows_strip_group_f32(x, ldx, w + (int64_t)s * k * STRIP, k, m, y + s * STRIP, ldy, seg, ns,
                                 n - (s + ns - 1) * STRIP);
            if (bias) add_bias_strips(y, ldy, bias, m, n, s, ns);
        }
    }
    return 0;
}

#else /* neither AVX-512 nor AVX2 with FMA: the Python side keeps oneDNN (rows_linear_vectorized() == 0) */

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
