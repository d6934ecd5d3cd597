/* Paged attention on the CPU: query rows (one per sequence in a decode step; a prefill chunk's rows,
 * each seeing its sequence's slots up to its own position), K and V read in place from a head-major
 * float32 cache ([num_blocks, num_kv_heads, block_size, head_dim]) through the block table, no
 * gathered copy.
 *
 * One work item is (query row, kv head): the group of query heads that share that kv head walk the
 * row's slots 0 .. len-1 in order, twice: scores = q . k * scale, then the softmax (float32, max
 * subtracted) and out = sum(p * v) / sum(p). With AVX-512 (head_dim a multiple of 16) the scores of
 * 16 slots come out of one vector reduction and e^x is a vector polynomial; elsewhere a portable
 * loop. A row's result depends only on its own slots, in a fixed order, never on its batch-mates or
 * the thread count: batch-invariant.
 *
 * Built with the OpenMP of the process (torch's libgomp), so its threads are torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_kernels.h"

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* One (sequence, kv head): its ``group`` query heads against the sequence's ``len`` slots. Inlined
 * into ``paged_decode_f32`` once per common head_dim, so those copies have constant loop bounds. */
static inline __attribute__((always_inline)) void decode_item(
    const float *restrict qg, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, float *restrict og, float *restrict scores, int len, int group, int kvh,
    const int head_dim, int block_size, int64_t block_stride, int64_t head_stride, float scale) {
    float *restrict denoms = scores + (int64_t)group * len;
    for (int first = 0, j = 0; first < len; first += block_size, j++) {
        const float *restrict k = k_cache + table[j] * block_stride + kvh * head_stride;
        const int n = len - first < block_size ? len - first : block_size;
        for (int t = 0; t < n; t++, k += head_dim)
            for (int g = 0; g < group; g++)
                scores[(int64_t)g * len + first + t] = dot(qg + g * head_dim, k, head_dim) * scale;
    }
    for (int g = 0; g < group; g++) {
        float *restrict s = scores + (int64_t)g * len;
        float peak = -INFINITY, denom = 0.0f;
        for (int pos = 0; pos < len; pos++) peak = s[pos] > peak ? s[pos] : peak;
        for (int pos = 0; pos < len; pos++) {
            s[pos] = expf(s[pos] - peak);
            denom += s[pos];
        }
        denoms[g] = denom;
        for (int i = 0; i < head_dim; i++) og[g * head_dim + i] = 0.0f;
    }
    for (int first = 0, j = 0; first < len; first += block_size, j++) {
        const float *restrict v = v_cache + table[j] * block_stride + kvh * head_stride;
        const int n = len - first < block_size ? len - first : block_size;
        for (int t = 0; t < n; t++, v += head_dim)
            for (int g = 0; g < group; g++) {
                const float p = scores[(int64_t)g * len + first + t];
                float *restrict o = og + g * head_dim;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) o[i] += p * v[i];
            }
    }
    for (int g = 0; g < group; g++)
        for (int i = 0; i < head_dim; i++) og[g * head_dim + i] /= denoms[g];
}

#include "vec_exp.h"

#if defined(__AVX512F__)

/* Lane t of the result = the sum of the 16 lanes of v[t]: a transposing tree (pairs of lanes, of
 * lane pairs, of 128-bit quarters), 30 shuffles and 15 adds for 16 sums. */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

enum { VEC_MAX_HEAD_DIM = 256, VEC_MAX_GROUP = 64, VEC_GROUP_TILE = 4 };

/* One (query row, kv head) with AVX-512, in two passes over the row's slots, 16 at a time (a chunk
 * never straddles a block): the scores of each query head (q . k: 16 products summed by hsum16),
 * then the softmax over the whole row (e^(s - max) as vectors), then the outputs, up to four heads
 * at a time with their accumulators in registers, each V row loaded once for them. ``scores``: group * len
 * floats (rounded up to 16) of scratch. Used where head_dim is a multiple of 16 up to 256 and group <= 64. */
static inline __attribute__((always_inline)) void vec_item(
    const float *restrict qg, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, float *restrict og, float *restrict scores, int len, int group, int kvh,
    const int head_dim, int block_size, int64_t block_stride, int64_t head_stride, float scale) {
    const int nv = head_dim / 16;
    const int stride = (len + 15) & ~15; /* each head's scores start on a 16-float boundary */
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    for (int first = 0, j = 0; first < len; first += block_size, j++) {
        const float *restrict kb = k_cache + table[j] * block_stride + kvh * head_stride;
        const int in_block = len - first < block_size ? len - first : block_size;
        for (int c = 0; c < in_block; c += 16) {
            const float *restrict k = kb + (int64_t)c * head_dim;
            const int n = in_block - c < 16 ? in_block - c : 16;
            const __mmask16 valid = (__mmask16)((1u << n) - 1u);
            for (int g = 0; g < group; g++) {
                const float *restrict q = qg + g * head_dim;
                __m512 part[16];
                for (int t = 0; t < 16; t++) {
                    __m512 s = _mm512_setzero_ps();
                    if (t < n)
                        for (int i = 0; i < nv; i++)
                            s = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), _mm512_loadu_ps(k + t * head_dim + 16 * i), s);
                    part[t] = s;
                }
                /* chunks of a block are 16-aligned within the row only when block_size is: store unaligned */
                _mm512_mask_storeu_ps(scores + (int64_t)g * stride + first + c, valid,
                                      _mm512_mul_ps(hsum16(part), vscale));
            }
        }
    }
    const int tail = len & 15;
    float inv[VEC_MAX_GROUP];
    /* registers: tile x nv accumulators + nv for the V row, within the 32 vector registers */
    const int group_tile = nv <= 4 ? VEC_GROUP_TILE : nv <= 8 ? 2 : 1;
    for (int g = 0; g < group; g++) {
        float *restrict s = scores + (int64_t)g * stride;
        if (tail) _mm512_mask_storeu_ps(s + len - tail, (__mmask16)~((1u << tail) - 1u), minus_inf);
        __m512 m = minus_inf;
        for (int t = 0; t < stride; t += 16) m = _mm512_max_ps(_mm512_load_ps(s + t), m);
        const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < stride; t += 16) {
            const __m512 x = _mm512_load_ps(s + t);
            /* -inf padding: e^-87 is not 0, so zero it */
            const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, minus_inf, _CMP_NEQ_UQ), exp16(_mm512_sub_ps(x, peak)));
            _mm512_store_ps(s + t, p);
            sum = _mm512_add_ps(sum, p);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* out = sum(p * v) / sum(p): the heads of the group in turn (up to VEC_GROUP_TILE at a time, their
     * accumulators in registers), each V row loaded once per tile of heads */
    for (int g0 = 0; g0 < group; g0 += group_tile) {
        const int gn = group - g0 < group_tile ? group - g0 : group_tile;
        __m512 acc[VEC_GROUP_TILE][VEC_MAX_HEAD_DIM / 16];
        for (int g = 0; g < VEC_GROUP_TILE; g++)
            for (int i = 0; i < nv; i++) acc[g][i] = _mm512_setzero_ps();
        for (int first = 0, j = 0; first < len; first += block_size, j++) {
            const float *restrict v = v_cache + table[j] * block_stride + kvh * head_stride;
            const int in_block = len - first < block_size ? len - first : block_size;
            for (int t = 0; t < in_block; t++, v += head_dim) {
                __m512 vt[VEC_MAX_HEAD_DIM / 16];
                for (int i = 0; i < nv; i++) vt[i] = _mm512_loadu_ps(v + 16 * i);
                for (int g = 0; g < gn; g++) {
                    const __m512 w = _mm512_set1_ps(scores[(int64_t)(g0 + g) * stride + first + t]);
                    for (int i = 0; i < nv; i++) acc[g][i] = _mm512_fmadd_ps(w, vt[i], acc[g][i]);
                }
            }
        }
        for (int g = 0; g < gn; g++) {
            const __m512 scale_out = _mm512_set1_ps(inv[g0 + g]);
            for (int i = 0; i < nv; i++)
                _mm512_storeu_ps(og + (g0 + g) * head_dim + 16 * i, _mm512_mul_ps(acc[g][i], scale_out));
        }
    }
}
#define HAVE_VEC_ITEM 1
#else
#define HAVE_VEC_ITEM 0
#endif

/* Paged attention for query rows: row r belongs to sequence row_seq[r] (NULL: row r is sequence r,
 * the decode case) and sees that sequence's slots 0 .. row_len[r]-1 (a prefill chunk's row j of n
 * sees seq_len - n + j + 1 of them: causal, bottom-right aligned). q: [num_rows, num_heads, head_dim],
 * rows q_row_stride floats apart (a view of the fused qkv projection), each row's heads contiguous;
 * out: [num_rows, num_heads, head_dim] contiguous; block_tables: [num_seqs, table_width] int32; seq_lens: [num_seqs] int32 (the lengths the
 * tables cover); num_threads: torch's (torch.get_num_threads()). Returns 0; -1 when scratch memory
 * could not be allocated; -2 (before reading anything) when a length does not fit its table, a row
 * reaches past its sequence or names none, or a block id used lies outside the cache. */
int paged_attention_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                        const int32_t *seq_lens, const int32_t *row_seq, const int32_t *row_len, float *out,
                        int num_seqs, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                        int table_width, float scale, int num_threads, int num_blocks, int64_t q_row_stride) {
    for (int seq = 0; seq < num_seqs; seq++) {
        const int len = seq_lens[seq], used = (len + block_size - 1) / block_size;
        if (len < 1 || used > table_width) return -2;
        for (int j = 0; j < used; j++) {
            const int32_t block = block_tables[(int64_t)seq * table_width + j];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    for (int r = 0; r < num_rows; r++) {
        const int seq = row_seq ? row_seq[r] : r;
        if (seq < 0 || seq >= num_seqs || row_len[r] < 1 || row_len[r] > seq_lens[seq]) return -2;
    }
    const int group = num_heads / num_kv_heads;
    const int64_t head_stride = (int64_t)block_size * head_dim;
    const int64_t block_stride = head_stride * num_kv_heads;
    const int vec = HAVE_VEC_ITEM && head_dim % 16 == 0 && head_dim <= 256 && group <= 64;
    int failed = 0, max_len = 0;
    for (int r = 0; r < num_rows; r++) max_len = row_len[r] > max_len ? row_len[r] : max_len;
    /* scratch, one allocation per thread for either loop: group rows of max_len scores rounded up to 16
     * (the vector loop's chunks), which also leaves room for the portable loop's group denominators */
    const size_t scratch_floats = (size_t)group * (size_t)((max_len + 16) & ~15);
    /* a prefill chunk's thousands of small items are handed out 16 at a time (one at a time, a
     * grab per item cost ~6 % of a 4,096-row chunk); a decode step's few larger ones singly */
    const int64_t num_items = (int64_t)num_rows * num_kv_heads;
    const int grab = num_items >= 1024 * (int64_t)num_threads ? 16 : 1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = aligned_alloc(64, sizeof(float) * scratch_floats);
        failed = scores == NULL;
#pragma omp for schedule(dynamic, grab)
        for (int64_t item = 0; item < num_items; item++) {
            if (scores == NULL) continue;
            const int row = (int)(item / num_kv_heads), kvh = (int)(item % num_kv_heads);
            const int len = row_len[row];
            const int32_t *table = block_tables + (int64_t)(row_seq ? row_seq[row] : row) * table_width;
            const float *qg = q + (int64_t)row * q_row_stride + (int64_t)kvh * group * head_dim;
            float *og = out + ((int64_t)row * num_heads + (int64_t)kvh * group) * head_dim;
#if HAVE_VEC_ITEM
            if (vec) {
#define VEC(HD) vec_item(qg, k_cache, v_cache, table, og, scores, len, group, kvh, HD, block_size, block_stride, \
                             head_stride, scale)
                switch (head_dim) { /* the same code; constant bounds for the common sizes */
                    case 64: VEC(64); break;
                    case 128: VEC(128); break;
                    default: VEC(head_dim);
                }
#undef VEC
            } else
#endif
            {
#define ITEM(HD) decode_item(qg, k_cache, v_cache, table, og, scores, len, group, kvh, HD, block_size, \
                                 block_stride, head_stride, scale)
                switch (head_dim) {
                    case 64: ITEM(64); break;
                    case 128: ITEM(128); break;
                    default: ITEM(head_dim);
                }
#undef ITEM
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Write each new token's key and value into its slot of the head-major caches; slot -1 writes
 * nothing (any negative slot, as in the PyTorch path). key, value: [num_tokens, num_kv_heads, head_dim] rows ``key_stride`` / ``value_stride``
 * floats apart (views of the fused qkv projection), each row's heads contiguous. Returns 0, or -2
 * (having written nothing) when a slot lies outside the cache's num_slots. */
int store_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache, const int64_t *slot_mapping,
                 int num_tokens, int num_kv_heads, int head_dim, int block_size, int64_t key_stride,
                 int64_t value_stride, int num_threads, int64_t num_slots) {
    for (int t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots) return -2; /* nothing written */
    const int64_t head_stride = (int64_t)block_size * head_dim;
    const int64_t block_stride = head_stride * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 256)
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * head_dim;
        for (int h = 0; h < num_kv_heads; h++) {
            memcpy(k_cache + base + h * head_stride, key + t * key_stride + h * head_dim, sizeof(float) * head_dim);
            memcpy(v_cache + base + h * head_stride, value + t * value_stride + h * head_dim, sizeof(float) * head_dim);
        }
    }
    return 0;
}
