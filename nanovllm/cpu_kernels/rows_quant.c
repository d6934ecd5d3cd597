/* The rows kernel over weights kept in a GGUF block format, for float32 weights that came from one:
 * the same product, to the bit, as rows_linear_f32 over the float32 strips, from a third to a fifth
 * of the bytes. A decode step streams every weight from memory for a few rows, so it runs at the rate
 * the weights are read.
 *
 * Formats (ggml's; a block is 32 weights of one output row along K, d a float16 value, m any float):
 *   Q4_1: w = (d * q) + m, q in [0, 15]   (the default model's layers)
 *   Q8_0: w = d * q,       q in [-128, 127] (its embedding, which is also its output layer)
 * d * q is exact in float32 (11 significant bits times 4 or 8), so a fused multiply-add of d, q and m
 * rounds once, as gguf's dequantization (a product then a sum) does.
 *
 * The formats are not read from the file: rows_pack_quant finds, for each block of the float32
 * weight, the d, m and q that give back its 32 values bitwise (m is the block's least value, which
 * has q = 0; d is (largest - least) / 15, or largest magnitude / 127, rounded to float16 and tried
 * with its neighbours), and reports how many blocks have none. Only a weight with none left over is
 * used so, so the product cannot differ from the float32 one; the tests compare the two bitwise.
 *
 * Layout (one strip = 16 output columns, as rows_linear.c): [ceil(n/16)][k/32] blocks; a block holds
 * 16 d (float32), for Q4_1 16 m (float32), then its 32 k of values. Q4_1: 16 pairs of k, 16 bytes
 * each, column c in byte c, the low nibble for the pair's first k and the high nibble for its second
 * (one 16-byte load gives two k); Q8_0: each k's 16 bytes in order. A block is 384 (Q4_1) or 576
 * (Q8_0) bytes where float32 takes 2,048.
 *
 * Product, by row count (KERNEL_NOTES, session 35): up to QUANT_REGISTER_ROWS rows (decode steps), AVX-512
 * dequantizes each pair of k of a strip in registers, in row tiles of up to 4 rows x 4 strips or 5-8
 * rows x 2 strips (2.3-2.9x the float32 strips at 1-4 rows, 1.05-1.5x at 8-48, SmolLM2-135M's 30
 * layers on a 2-core Zen 4); AVX2, up to QUANT_REGISTER_ROWS_AVX2 rows, in row tiles of up to 4 rows
 * x 1 strip (2.0-3.0x at 1-4 rows, 1.17x at 8, level at 16, the AVX2 build on the same machine).
 * More rows (prefill) dequantize a strip group into a per-thread float32 buffer once and run
 * rows_linear.c's product over it (level with float32 at 256 rows). All sum in rows_linear_f32's
 * order. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "rows_frame.h"

#define QBLOCK 32 /* weights of a row per block (ggml's QK4_1 and QK8_0) */
enum { ROWS_Q4_1 = 1, ROWS_Q8_0 = 2 };
#ifndef QUANT_REGISTER_ROWS
#define QUANT_REGISTER_ROWS 48
#endif

/* bytes of one block of one strip; 0 for an unknown format */
int rows_quant_block_bytes(int format) {
    return format == ROWS_Q4_1 ? 2 * STRIP * 4 + QBLOCK * STRIP / 2 : format == ROWS_Q8_0 ? STRIP * 4 + QBLOCK * STRIP : 0;
}

/* the scales' and values' byte offsets in a block */
static int values_at(int format) { return format == ROWS_Q4_1 ? 2 * STRIP * 4 : STRIP * 4; }

static float half_round(float x) { return (float)(_Float16)x; }

/* the float16 value ``steps`` float16 steps from ``h`` (a positive float16 value) */
static float half_step(float h, int steps) {
    _Float16 v = (_Float16)h;
    uint16_t bits;
    memcpy(&bits, &v, 2);
    bits = (uint16_t)(bits + steps);
    memcpy(&v, &bits, 2);
    return (float)v;
}

static int same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* whether d (and for Q4_1 m) give back all 32 values with integer q in the format's range (q written
 * on success): Q4_1 as (d * q) + m, Q8_0 as d * q alone, as the kernels compute them */
static int fits(const float *v, int format, float d, float m, int *q) {
    const int lo = format == ROWS_Q4_1 ? 0 : -128, hi = format == ROWS_Q4_1 ? 15 : 127;
    for (int j = 0; j < QBLOCK; j++) {
        float t = d == 0.0f ? 0.0f : (v[j] - m) / d;
        if (!(t > lo - 1.0f && t < hi + 1.0f)) return 0; /* NaN included */
        int qi = (int)(t < 0 ? t - 0.5f : t + 0.5f);
        float back = format == ROWS_Q4_1 ? d * (float)qi + m : d * (float)qi;
        if (qi < lo || qi > hi || !same_bits(back, v[j])) return 0;
        q[j] = qi;
    }
    return 1;
}

/* d, m and q of one block of 32 values (m = 0 for Q8_0); 1 where they give it back bitwise */
static int recover_block(const float *v, int format, float *d, float *m, int *q) {
    float lo = v[0], hi = v[0], amax = 0.0f;
    for (int j = 0; j < QBLOCK; j++) {
        if (v[j] != v[j]) return 0;
        lo = v[j] < lo ? v[j] : lo, hi = v[j] > hi ? v[j] : hi;
        amax = (v[j] < 0 ? -v[j] : v[j]) > amax ? (v[j] < 0 ? -v[j] : v[j]) : amax;
    }
    *m = format == ROWS_Q4_1 ? lo : 0.0f;
    if ((format == ROWS_Q4_1 ? hi - lo : amax) == 0.0f) {
        *d = 0.0f;
        if (format == ROWS_Q4_1) return fits(v, format, 0.0f, *m, q);
        /* gguf's Q8_0 gives -0 where a block's float16 d rounded to 0 and q < 0: 0 * -1 is -0 */
        for (int j = 0; j < QBLOCK; j++) q[j] = signbit(v[j]) ? -1 : 0;
        for (int j = 0; j < QBLOCK; j++)
            if (!same_bits(0.0f * (float)q[j], v[j])) return 0;
        return 1;
    }
    int top = format == ROWS_Q4_1 ? 15 : 127; /* the largest q ggml's quantizers give */
    for (int t = top; t >= top - 2; t--) {
        float guess = half_round((format == ROWS_Q4_1 ? hi - lo : amax) / (float)t);
        if (!(guess > 0.0f)) continue;
        for (int s = 0; s <= 4; s++) {
            *d = half_step(guess, s % 2 ? (s + 1) / 2 : -(s / 2)); /* 0, +1, -1, +2, -2 steps */
            if (*d > 0.0f && fits(v, format, *d, *m, q))
                return 1;
        }
    }
    return 0;
}

/* Pack W [n][k] (float32) into ``format``'s strips (``out``: ceil(n/16) * k/32 blocks); columns past n
 * are zero. Returns 0 where the packing gives W back bitwise; else how many blocks were found without
 * an exact form before the packing stopped (at least one: a float32 checkpoint's weight stops at
 * once), or -1 for a bad argument (k not a multiple of 32, an unknown format). */
int rows_pack_quant(const float *w, uint8_t *out, int format, int n, int k, int num_threads) {
    int bytes = rows_quant_block_bytes(format);
    if (bytes == 0 || n <= 0 || k <= 0 || k % QBLOCK || num_threads < 1) return -1;
    const int strips = (n + STRIP - 1) / STRIP, blocks = k / QBLOCK, at = values_at(format);
    int missed = 0, stop = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : missed)
    for (int sb = 0; sb < strips * blocks; sb++) {
        int stopped;
#pragma omp atomic read
        stopped = stop;
        if (stopped) continue; /* a block had no exact form: the rest need not be tried */
        int s = sb / blocks, b = sb % blocks;
        uint8_t *block = out + (int64_t)sb * bytes;
        float d[STRIP], m[STRIP];
        int q[STRIP][QBLOCK];
        for (int c = 0; c < STRIP; c++) {
            int col = s * STRIP + c;
            d[c] = m[c] = 0.0f;
            memset(q[c], 0, sizeof q[c]);
            if (col < n && !recover_block(w + (int64_t)col * k + b * QBLOCK, format, &d[c], &m[c], q[c])) missed++;
        }
        if (missed) {
#pragma omp atomic write
            stop = 1;
        }
        memcpy(block, d, sizeof d);
        if (format == ROWS_Q4_1) memcpy(block + sizeof d, m, sizeof m);
        for (int kk = 0; kk < QBLOCK; kk++)
            for (int c = 0; c < STRIP; c++) {
                if (format == ROWS_Q4_1) {
                    uint8_t *byte = block + at + kk / 2 * STRIP + c;
                    *byte = (uint8_t)(kk % 2 ? (*byte | q[c][kk] << 4) : q[c][kk]);
                } else {
                    block[at + kk * STRIP + c] = (uint8_t)(int8_t)q[c][kk];
                }
            }
    }
    return missed;
}

#if ROWS_VECTORIZED

/* A thread's float32 buffer for dequantized strips, kept for the thread's life and grown as needed
 * (a decode step's products would otherwise map and unmap it ~120 times); NULL if memory is short. */
static float *thread_buffer(size_t floats) {
    static _Thread_local float *buffer;
    static _Thread_local size_t size;
    if (floats > size) {
        free(buffer);
        buffer = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        size = buffer ? floats : 0;
    }
    return buffer;
}

#if defined(__AVX512F__)

/* Two k (2p and 2p + 1) of one strip: 16 weights each, dequantized. Q4_1's 16 bytes hold column c's
 * q for 2p in byte c's low nibble and for 2p + 1 in its high one. */
static inline void pair_of_k(int format, const uint8_t *values, int p, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    if (format == ROWS_Q4_1) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(values + p * STRIP)));
        /* d * q is exact: one rounding, as (d * q) + m */
        *w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), m);
        *w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);
    } else {
        const uint8_t *two = values + 2 * p * STRIP;
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)two))));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(two + STRIP)))));
    }
}

/* Strips [0, ns) of packed weights (each ``strip_bytes`` apart) into float32 strips [ns][k][16]. */
static void dequantize_strips(const uint8_t *wq, int format, int64_t strip_bytes, int k, int ns, float *out) {
    const int bytes = rows_quant_block_bytes(format), at = values_at(format);
    for (int j = 0; j < ns; j++)
        for (int b = 0; b < k / QBLOCK; b++) {
            const uint8_t *block = wq + j * strip_bytes + (int64_t)b * bytes;
            __m512 d = _mm512_loadu_ps((const float *)block), m = _mm512_loadu_ps((const float *)block + STRIP);
            float *o = out + ((int64_t)j * k + b * QBLOCK) * STRIP;
            for (int p = 0; p < QBLOCK / 2; p++) {
                __m512 w0, w1;
                pair_of_k(format, block + at, p, d, m, &w0, &w1);
                _mm512_store_ps(o + 2 * p * STRIP, w0);
                _mm512_store_ps(o + (2 * p + 1) * STRIP, w1);
            }
        }
}

/* Rows [0, MR) x strips [0, NR): the k range [k0, k1) of one K segment (whole blocks), each pair of k
 * of each strip dequantized in registers; the sums stored into y (``first``: the first segment) or
 * added to it, the last strip's columns past n masked off. The same chains as rows_linear.c's TILE. */
#define QTILE(NAME, FORMAT, MR, NR)                                                                            \
    static void qtile_##NAME##_##MR##_##NR(const float *restrict x, int64_t ldx, const uint8_t *restrict w,  \
                                           int64_t strip_bytes, int k0, int k1, float *restrict y,           \
                                           int64_t ldy, int first, __mmask16 tail) {                         \
        const int bytes = rows_quant_block_bytes(FORMAT), at = values_at(FORMAT);                           \
        __m512 acc[MR][NR];                                                                                  \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                 \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();            \
        for (int b = k0 / QBLOCK; b < k1 / QBLOCK; b++) {                                                    \
            __m512 d[NR], m[NR];                                                                             \
            const uint8_t *values[NR];                                                                       \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                           \
                const uint8_t *block = w + j * strip_bytes + (int64_t)b * bytes;                             \
                d[j] = _mm512_loadu_ps((const float *)block);                                                \
                m[j] = FORMAT == ROWS_Q4_1 ? _mm512_loadu_ps((const float *)block + STRIP) : d[j];           \
                values[j] = block + at;                                                                      \
            }                                                                                                \
            for (int p = 0; p < QBLOCK / 2; p++) {                                                           \
                __m512 w0[NR], w1[NR];                                                                       \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++)                                         \
                    pair_of_k(FORMAT, values[j], p, d[j], m[j], &w0[j], &w1[j]);                             \
                const float *xk = x + b * QBLOCK + 2 * p;                                                    \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                       \
                    __m512 x0 = _mm512_set1_ps(xk[i * ldx]), x1 = _mm512_set1_ps(xk[i * ldx + 1]);           \
                    _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] =                         \
                        _mm512_fmadd_ps(x1, w1[j], _mm512_fmadd_ps(x0, w0[j], acc[i][j]));                   \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                 \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                           \
                float *dst = y + i * ldy + j * STRIP;                                                        \
                __mmask16 mask = j == NR - 1 ? tail : (__mmask16)0xFFFF;                                     \
                __m512 v = first ? acc[i][j] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), acc[i][j]);   \
                _mm512_mask_storeu_ps(dst, mask, v);                                                         \
            }                                                                                                \
    }

/* tiles of up to 4 rows take up to 4 strips; of 5 to 8 rows, up to 2 (the sums, scales and weights of
 * a tile fit the 32 registers) */
#define QTILES_OF4(NAME, FORMAT, MR) \
    QTILE(NAME, FORMAT, MR, 1) QTILE(NAME, FORMAT, MR, 2) QTILE(NAME, FORMAT, MR, 3) QTILE(NAME, FORMAT, MR, 4)
#define QTILES_OF2(NAME, FORMAT, MR) QTILE(NAME, FORMAT, MR, 1) QTILE(NAME, FORMAT, MR, 2)
#define QTILES(NAME, FORMAT)                                                                                  \
    QTILES_OF4(NAME, FORMAT, 1) QTILES_OF4(NAME, FORMAT, 2) QTILES_OF4(NAME, FORMAT, 3)                       \
    QTILES_OF4(NAME, FORMAT, 4) QTILES_OF2(NAME, FORMAT, 5) QTILES_OF2(NAME, FORMAT, 6)                       \
    QTILES_OF2(NAME, FORMAT, 7) QTILES_OF2(NAME, FORMAT, 8)
QTILES(q4_1, ROWS_Q4_1)
QTILES(q8_0, ROWS_Q8_0)

#define QTILE_ROWS 8
typedef void (*qtile_fn)(const float *, int64_t, const uint8_t *, int64_t, int, int, float *, int64_t, int,
                         __mmask16);
#define QROW4(NAME, MR) {qtile_##NAME##_##MR##_1, qtile_##NAME##_##MR##_2, qtile_##NAME##_##MR##_3, qtile_##NAME##_##MR##_4}
#define QROW2(NAME, MR) {qtile_##NAME##_##MR##_1, qtile_##NAME##_##MR##_2, NULL, NULL}
#define QROWS(NAME)                                                                                         \
    {QROW4(NAME, 1), QROW4(NAME, 2), QROW4(NAME, 3), QROW4(NAME, 4), QROW2(NAME, 5), QROW2(NAME, 6), QROW2(NAME, 7), \
     QROW2(NAME, 8)}
static const qtile_fn QTILES_TABLE[2][QTILE_ROWS][4] = {QROWS(q4_1), QROWS(q8_0)};

/* whether a call of m rows dequantizes in registers (else into the thread's buffer), and how many
 * strips it takes at a time: 4 for up to 4 rows (one row tile), else 2 (row tiles of up to 8) */
static int in_registers(int m) { return m <= QUANT_REGISTER_ROWS; }
static int register_strips(int m) { return m <= 4 ? 4 : 2; }

static void register_group(const float *x, int64_t ldx, const uint8_t *wq, int format, int64_t strip_bytes, int k,
                           int m, float *ys, int64_t ldy, int seg, int ns, int tail_cols) {
    __mmask16 tail = tail_cols >= STRIP ? (__mmask16)0xFFFF : (__mmask16)((1u << tail_cols) - 1);
    for (int m0 = 0; m0 < m; m0 += QTILE_ROWS) {
        int mr = m - m0 < QTILE_ROWS ? m - m0 : QTILE_ROWS;
        for (int k0 = 0; k0 < k; k0 += seg) {
            int k1 = k - k0 > seg ? k0 + seg : k;
            QTILES_TABLE[format - 1][mr - 1][ns - 1](x + m0 * ldx, ldx, wq, strip_bytes, k0, k1, ys + m0 * ldy, ldy,
                                                     k0 == 0, tail);
        }
    }
}

#else /* AVX2: a strip is two 8-float halves; register tiles of one strip, up to QTILE2_ROWS rows */

/* two k (2p, 2p + 1) of one strip dequantized, as rows [2p] and [2p + 1] of ``out`` (16 floats each), in
 * 8-float halves */
static inline void pair_of_k2(int format, const uint8_t *values, int p, const float *d, const float *m, float *out) {
    const __m256i low = _mm256_set1_epi32(15);
    __m128i q4 = _mm_loadu_si128((const __m128i *)(values + p * STRIP));
    for (int h = 0; h < 2; h++) {
        __m256 dh = _mm256_loadu_ps(d + 8 * h);
        if (format == ROWS_Q4_1) {
            __m256i v = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(q4, 8) : q4);
            __m256 mh = _mm256_loadu_ps(m + 8 * h);
            _mm256_store_ps(out + 8 * h, _mm256_fmadd_ps(dh, _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), mh));
            _mm256_store_ps(out + STRIP + 8 * h, _mm256_fmadd_ps(dh, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), mh));
        } else {
            for (int r = 0; r < 2; r++) {
                __m128i q8 = _mm_loadu_si128((const __m128i *)(values + (2 * p + r) * STRIP));
                __m256i v = _mm256_cvtepi8_epi32(h ? _mm_srli_si128(q8, 8) : q8);
                _mm256_store_ps(out + r * STRIP + 8 * h, _mm256_mul_ps(dh, _mm256_cvtepi32_ps(v)));
            }
        }
    }
}

static void dequantize_strips(const uint8_t *wq, int format, int64_t strip_bytes, int k, int ns, float *out) {
    const int bytes = rows_quant_block_bytes(format), at = values_at(format);
    for (int j = 0; j < ns; j++)
        for (int b = 0; b < k / QBLOCK; b++) {
            const uint8_t *block = wq + j * strip_bytes + (int64_t)b * bytes;
            const float *d = (const float *)block, *m = d + STRIP;
            float *o = out + ((int64_t)j * k + b * QBLOCK) * STRIP;
            for (int p = 0; p < QBLOCK / 2; p++) pair_of_k2(format, block + at, p, d, m, o + 2 * p * STRIP);
        }
}

/* Rows [0, MR) x one strip: the k range [k0, k1) of one K segment, each pair of k dequantized in
 * registers (two halves of 8 floats), as the AVX-512 QTILE; the last strip's columns past n masked
 * off (tail[h]: the lanes of half h below n; ``full``: none masked), as rows_linear.c's TILE2. */
#define QTILE2(NAME, FORMAT, MR)                                                                               \
    static void qtile2_##NAME##_##MR(const float *restrict x, int64_t ldx, const uint8_t *restrict w, int k0,  \
                                     int k1, float *restrict y, int64_t ldy, int first, const __m256i *tail,   \
                                     int full) {                                                              \
        const int bytes = rows_quant_block_bytes(FORMAT), at = values_at(FORMAT);                            \
        __m256 acc[MR][2];                                                                                    \
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();     \
        for (int b = k0 / QBLOCK; b < k1 / QBLOCK; b++) {                                                     \
            const uint8_t *block = w + (int64_t)b * bytes, *values = block + at;                              \
            const float *scale = (const float *)block;                                                        \
            __m256 d[2] = {_mm256_loadu_ps(scale), _mm256_loadu_ps(scale + 8)};                               \
            __m256 m[2] = {d[0], d[1]};                                                                       \
            if (FORMAT == ROWS_Q4_1) m[0] = _mm256_loadu_ps(scale + STRIP), m[1] = _mm256_loadu_ps(scale + STRIP + 8); \
            for (int p = 0; p < QBLOCK / 2; p++) {                                                            \
                __m256 wv[2][2]; /* [k of the pair][half] */                                                  \
                if (FORMAT == ROWS_Q4_1) {                                                                    \
                    __m128i q = _mm_loadu_si128((const __m128i *)(values + p * STRIP));                       \
                    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                     \
                        __m256i v = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(q, 8) : q);                       \
                        wv[0][h] = _mm256_fmadd_ps(d[h], _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), m[h]); \
                        wv[1][h] = _mm256_fmadd_ps(d[h], _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), m[h]);  \
                    }                                                                                         \
                } else {                                                                                      \
                    _Pragma("GCC unroll 2") for (int r = 0; r < 2; r++) {                                     \
                        __m128i q = _mm_loadu_si128((const __m128i *)(values + (2 * p + r) * STRIP));         \
                        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) wv[r][h] = _mm256_mul_ps(         \
                            d[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(q, 8) : q)));    \
                    }                                                                                         \
                }                                                                                             \
                const float *xk = x + b * QBLOCK + 2 * p;                                                     \
                _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++) {                                        \
                    __m256 x0 = _mm256_broadcast_ss(xk + i * ldx), x1 = _mm256_broadcast_ss(xk + i * ldx + 1); \
                    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) acc[i][h] =                           \
                        _mm256_fmadd_ps(x1, wv[1][h], _mm256_fmadd_ps(x0, wv[0][h], acc[i][h]));              \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++)                                                  \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                             \
                if (!full && h == 1 && _mm256_testz_si256(tail[1], tail[1]))                                  \
                    continue; /* a last strip of 8 columns or fewer: its high half is past y's row */         \
                float *dst = y + i * ldy + h * 8;                                                             \
                if (full) {                                                                                   \
                    _mm256_storeu_ps(dst, first ? acc[i][h] : _mm256_add_ps(_mm256_loadu_ps(dst), acc[i][h])); \
                } else {                                                                                      \
                    __m256 v = first ? acc[i][h] : _mm256_add_ps(_mm256_maskload_ps(dst, tail[h]), acc[i][h]); \
                    _mm256_maskstore_ps(dst, tail[h], v);                                                     \
                }                                                                                             \
            }                                                                                                 \
    }

#define QTILE2_ROWS 4
#define QTILES2(NAME, FORMAT) QTILE2(NAME, FORMAT, 1) QTILE2(NAME, FORMAT, 2) QTILE2(NAME, FORMAT, 3) QTILE2(NAME, FORMAT, 4)
QTILES2(q4_1, ROWS_Q4_1)
QTILES2(q8_0, ROWS_Q8_0)

typedef void (*qtile2_fn)(const float *, int64_t, const uint8_t *, int, int, float *, int64_t, int, const __m256i *,
                          int);
static const qtile2_fn QTILES2_TABLE[2][QTILE2_ROWS] = {
    {qtile2_q4_1_1, qtile2_q4_1_2, qtile2_q4_1_3, qtile2_q4_1_4},
    {qtile2_q8_0_1, qtile2_q8_0_2, qtile2_q8_0_3, qtile2_q8_0_4},
};

#ifndef QUANT_REGISTER_ROWS_AVX2
#define QUANT_REGISTER_ROWS_AVX2 16
#endif
static int in_registers(int m) { return m <= QUANT_REGISTER_ROWS_AVX2; }
static int register_strips(int m) { return (void)m, 1; }

static void register_group(const float *x, int64_t ldx, const uint8_t *wq, int format, int64_t strip_bytes, int k,
                           int m, float *ys, int64_t ldy, int seg, int ns, int tail_cols) {
    (void)strip_bytes, (void)ns; /* one strip */
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i tail[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(tail_cols), lanes),
                       _mm256_cmpgt_epi32(_mm256_set1_epi32(tail_cols - 8), lanes)};
    for (int m0 = 0; m0 < m; m0 += QTILE2_ROWS) {
        int mr = m - m0 < QTILE2_ROWS ? m - m0 : QTILE2_ROWS;
        for (int k0 = 0; k0 < k; k0 += seg) {
            int k1 = k - k0 > seg ? k0 + seg : k;
            QTILES2_TABLE[format - 1][mr - 1](x + m0 * ldx, ldx, wq, k0, k1, ys + m0 * ldy, ldy, k0 == 0, tail,
                                              tail_cols >= STRIP);
        }
    }
}

#endif

/* y [m][n] = x [m][k] @ W^T + bias, W packed by rows_pack_quant in ``format``: rows_linear_f32's
 * arguments and result (every bit) for the float32 weight the packing gave back. Returns 0; -1 for a
 * bad argument (also k or a segment short of k not a multiple of 32), -2 where a thread's buffer could
 * not be allocated (nothing valid written). */
int rows_linear_quant(const float *x, const uint8_t *w, int format, const float *bias, float *y, int m, int n, int k,
                      int64_t ldx, int64_t ldy, int seg, int num_threads) {
    const int bytes = rows_quant_block_bytes(format);
    if (rows_bad_arguments(m, n, k, ldx, ldy, seg, num_threads) || bytes == 0 || k % QBLOCK ||
        (seg < k && seg % QBLOCK))
        return -1;
    if (m == 0) return 0;
    const int strips = (n + STRIP - 1) / STRIP, registers = in_registers(m);
    const int group = registers ? register_strips(m) : rows_group_strips(m);
    const int64_t strip_bytes = (int64_t)(k / QBLOCK) * bytes;
    if (num_threads > strips) num_threads = strips;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int s0, s1;
        thread_strips(strips, &s0, &s1);
        float *buffer = registers ? NULL : thread_buffer((size_t)group * k * STRIP);
        if (!registers && buffer == NULL) failed = 1;
        for (int s = s0; s < s1 && !failed; s += group) {
            int ns = s1 - s < group ? s1 - s : group, tail_cols = n - (s + ns - 1) * STRIP;
            const uint8_t *wq = w + s * strip_bytes;
            if (registers) {
                register_group(x, ldx, wq, format, strip_bytes, k, m, y + s * STRIP, ldy, seg, ns, tail_cols);
            } else {
                dequantize_strips(wq, format, strip_bytes, k, ns, buffer);
                rows_strip_group_f32(x, ldx, buffer, k, m, y + s * STRIP, ldy, seg, ns, tail_cols);
            }
            if (bias) add_bias_strips(y, ldy, bias, m, n, s, ns);
        }
    }
    return failed ? -2 : 0;
}

#else /* neither AVX-512 nor AVX2 with FMA (rows_linear_vectorized() == 0) */

int rows_linear_quant(const float *x, const uint8_t *w, int format, const float *bias, float *y, int m, int n, int k,
                      int64_t ldx, int64_t ldy, int seg, int num_threads) {
    (void)x, (void)w, (void)format, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy;
    (void)seg, (void)num_threads;
    return -1;
}

#endif
