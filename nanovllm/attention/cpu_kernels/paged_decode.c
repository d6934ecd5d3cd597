/* Paged decode attention on the CPU: one query row per sequence, K and V read in place from a
 * head-major float32 cache ([num_blocks, num_kv_heads, block_size, head_dim]) through the block
 * table, no gathered copy.
 *
 * One work item is (sequence, kv head): the group of query heads that share that kv head walk the
 * sequence's slots 0 .. seq_len-1 in order, twice: scores = q . k * scale, then the softmax
 * (float32, max subtracted) and out = sum(p * v) / sum(p). A sequence's result depends only on its
 * own slots, in a fixed order, never on its batch-mates or the thread count: batch-invariant.
 *
 * Built with the OpenMP of the process (torch's libgomp), so its threads are torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* q, out: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, table_width] int32;
 * seq_lens: [num_seqs] int32; caches of num_blocks blocks; num_threads: torch's
 * (torch.get_num_threads()). Returns 0; -1 when scratch memory could not be allocated; -2 (before
 * reading anything) when a length does not fit its table or a block id used lies outside the cache. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     const int32_t *seq_lens, float *out, int num_seqs, int num_heads, int num_kv_heads,
                     int head_dim, int block_size, int table_width, float scale, int num_threads, int num_blocks) {
    for (int seq = 0; seq < num_seqs; seq++) {
        const int len = seq_lens[seq], used = (len + block_size - 1) / block_size;
        if (len < 1 || used > table_width) return -2;
        for (int j = 0; j < used; j++) {
            const int32_t block = block_tables[(int64_t)seq * table_width + j];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    const int group = num_heads / num_kv_heads;
    const int64_t head_stride = (int64_t)block_size * head_dim;
    const int64_t block_stride = head_stride * num_kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
        const int seq = (int)(item / num_kv_heads), kvh = (int)(item % num_kv_heads);
        const int len = seq_lens[seq];
        const int32_t *table = block_tables + (int64_t)seq * table_width;
        const float *qg = q + ((int64_t)seq * num_heads + (int64_t)kvh * group) * head_dim;
        float *og = out + ((int64_t)seq * num_heads + (int64_t)kvh * group) * head_dim;
        /* scratch: group rows of len scores, then group denominators */
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(len + 1));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
#define ITEM(HD) decode_item(qg, k_cache, v_cache, table, og, scores, len, group, kvh, HD, block_size, \
                             block_stride, head_stride, scale)
        switch (head_dim) {  /* the same code; constant bounds for the common sizes */
            case 64: ITEM(64); break;
            case 128: ITEM(128); break;
            default: ITEM(head_dim);
        }
#undef ITEM
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
