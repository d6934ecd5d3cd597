/* The kernels one file of this directory calls in another (decode_layers.c runs the others): their
 * prototypes in one place, included by the files that define them too, so a signature that changes
 * in one file and not in its caller fails to compile instead of calling with the wrong arguments. */
#ifndef NANOVLLM_CPU_KERNELS_H
#define NANOVLLM_CPU_KERNELS_H
#include <stdint.h>

int rms_norm_f32(const float *x, const float *residual, float *out, float *res_out, const float *weight, int rows,
                 int n, int64_t x_stride, int64_t r_stride, float eps, int lanes, int num_threads);
int rows_linear_f32(const float *x, const float *w, const float *bias, float *y, int m, int n, int k, int64_t ldx,
                    int64_t ldy, int seg, int num_threads);
int rows_linear_quant(const float *x, const uint8_t *w, int format, const float *bias, float *y, int m, int n, int k,
                      int64_t ldx, int64_t ldy, int seg, int num_threads);
int rotary_neox_f32(float *q, float *k, const int64_t *pos, const float *cos_table, const float *sin_table,
                    int tokens, int heads, int kv_heads, int half_dim, int64_t q_stride, int64_t k_stride,
                    int64_t table_stride, int64_t table_rows, int num_threads);
int store_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache, const int64_t *slot_mapping,
                 int num_tokens, int num_kv_heads, int head_dim, int block_size, int64_t key_stride,
                 int64_t value_stride, int num_threads, int64_t num_slots);
int paged_attention_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                        const int32_t *seq_lens, const int32_t *row_seq, const int32_t *row_len, float *out,
                        int num_seqs, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                        int table_width, float scale, int num_threads, int num_blocks, int64_t q_row_stride);
int silu_and_mul_f32(const float *gate, const float *up, float *out, int rows, int n, int64_t gate_stride,
                     int64_t up_stride, int lanes, int pieces, int num_threads);

#endif
