/* A probe, not the engine: how fast the CPU's decode products could run if the rows kernel read
 * the default model's Q4_1 blocks (4-bit values, a float16 scale d and minimum m per 32 weights of
 * a row) and dequantized them in registers, against the float32 strips it reads now. Built and run
 * by scripts/q4_rows_probe.py (AVX-512 only); see docs/KERNEL_NOTES.md, session 34.
 *
 * Both variants compute y[i][c] = sum_k x[i][k] * w[c][k] over strips of 16 output columns, one
 * fused multiply-add chain per output, with the weight w = (d * q) + m rounded twice in float32, as
 * gguf's dequantize does, so the two give the same bits where the float32 weights came from Q4_1.
 *
 * Layouts (one strip = 16 columns):
 *   f32: [strip][k][16] floats (64 bytes per k)
 *   q4:  [strip][k/32] blocks of {16 d, 16 m as float32 (128 bytes), 32 k x 16 nibbles (256 bytes)}:
 *        per k, 16 nibbles = 8 bytes; the scales are float32 here (converted at packing), so a
 *        block reads 384 bytes for 32 k against 2,048 for float32. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define STRIP 16

/* rows x 1 strip tiles; rows <= 4 here (the decode steps' few rows) */
static inline void f32_strip(const float *x, int64_t ldx, const float *w, int k, int rows, float *y, int64_t ldy) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int kk = 0; kk < k; kk++) {
        __m512 wv = _mm512_loadu_ps(w + (int64_t)kk * STRIP);
        for (int i = 0; i < rows; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + kk]), wv, acc[i]);
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

static inline void q4_strip(const float *x, int64_t ldx, const uint8_t *w, int k, int rows, float *y, int64_t ldy) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int b = 0; b < k / 32; b++) {
        const uint8_t *block = w + (int64_t)b * 384;
        __m512 d = _mm512_loadu_ps((const float *)block), m = _mm512_loadu_ps((const float *)block + 16);
        const uint8_t *qs = block + 128;
        for (int kk = 0; kk < 32; kk++) {
            /* 16 nibbles: 8 bytes, column c's value in byte c/2, low nibble for even c */
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(qs + kk * 8));
            __m512i wide = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  /* each byte twice */
            __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
            __m512i q = _mm512_and_si512(_mm512_srlv_epi32(wide, shift), low);
            __m512 wv = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)), m);
            const int k0 = b * 32 + kk;
            for (int i = 0; i < rows; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k0]), wv, acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* y [m][n] = x [m][k] @ W^T, strips split over the threads, row tiles of up to 4 */
void probe_f32(const float *x, const float *w, float *y, int m, int n, int k, int threads) {
    int strips = n / STRIP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int s = 0; s < strips; s++)
        for (int m0 = 0; m0 < m; m0 += 4)
            f32_strip(x + (int64_t)m0 * k, k, w + (int64_t)s * k * STRIP, k, m - m0 < 4 ? m - m0 : 4,
                      y + (int64_t)m0 * n + s * STRIP, n);
}

/* Q4_1 dequantized once per strip into a float32 scratch strip (L1/L2-resident, [k][16]), then every
 * row tile over it as over the float32 strips: the dequantization paid once, not per row tile */
void probe_q4_once(const float *x, const uint8_t *w, float *y, int m, int n, int k, int threads) {
    int strips = n / STRIP;
#pragma omp parallel num_threads(threads)
    {
        float scratch[1536 * STRIP] __attribute__((aligned(64)));
        const __m512i low = _mm512_set1_epi32(0x0F);
        const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
#pragma omp for schedule(static)
        for (int s = 0; s < strips; s++) {
            const uint8_t *ws = w + (int64_t)s * (k / 32) * 384;
            for (int b = 0; b < k / 32; b++) {
                const uint8_t *block = ws + (int64_t)b * 384;
                __m512 d = _mm512_loadu_ps((const float *)block), mn = _mm512_loadu_ps((const float *)block + 16);
                for (int kk = 0; kk < 32; kk++) {
                    __m128i bytes = _mm_loadl_epi64((const __m128i *)(block + 128 + kk * 8));
                    __m512i q = _mm512_and_si512(
                        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes)), shift), low);
                    _mm512_store_ps(scratch + (b * 32 + kk) * STRIP,
                                    _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)), mn));
                }
            }
            for (int m0 = 0; m0 < m; m0 += 4)
                f32_strip(x + (int64_t)m0 * k, k, scratch, k, m - m0 < 4 ? m - m0 : 4, y + (int64_t)m0 * n + s * STRIP, n);
        }
    }
}

void probe_q4(const float *x, const uint8_t *w, float *y, int m, int n, int k, int threads) {
    int strips = n / STRIP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int s = 0; s < strips; s++)
        for (int m0 = 0; m0 < m; m0 += 4)
            q4_strip(x + (int64_t)m0 * k, k, w + (int64_t)s * (k / 32) * 384, k, m - m0 < 4 ? m - m0 : 4,
                     y + (int64_t)m0 * n + s * STRIP, n);
}
