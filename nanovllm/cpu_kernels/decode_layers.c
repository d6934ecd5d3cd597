/* A decode step's decoder layers in one call (Llama family, float32): for each layer RMSNorm, the
 * q/k/v projection, RoPE, the cache write, paged attention, the o projection, RMSNorm with the
 * residual, the gate/up projection, SiLU-and-multiply and the down projection. Each is the kernel
 * the Python layers call (rows_linear.c, elementwise.c, paged_attention.c), given the arguments the
 * Python wrappers give it, in the same order, so the result is the same bitwise; what goes is the
 * Python between the kernels. On the 2-core development machine that was ~40 us per kernel (~12 ms
 * of a ~50 ms decode step of SmolLM2-135M): the interpreter's own code and data, fetched again after
 * each kernel has streamed weights or K/V through the caches, cost more than the work it does. */
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"

/* A weight packed by rows_pack_f32 (format 0) or rows_pack_quant (its format): y [m][n] = x [m][k] @ W^T
 * (+ bias), sums restarted every seg. */
typedef struct {
    const void *strips;
    const float *bias;
    int n, k, seg, format;
} DecodeLinear;

typedef struct {
    DecodeLinear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    float input_eps, post_eps;
    float *k_cache, *v_cache; /* head-major [num_blocks][kv_heads][block_size][head_dim] */
} DecodeLayer;

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    int num_blocks, block_size;
    const float *cos_table, *sin_table; /* [table_rows][>= head_dim / 2], rows table_stride floats apart */
    int64_t table_stride, table_rows;
    float scale;
    int norm_lanes, silu_lanes;
} DecodeModel;

/* One step: ``rows`` sequences of one token each, and the workspace the layers write (contiguous,
 * rows x the width named). ``embedded`` [rows][hidden] is layer 0's input and residual. */
typedef struct {
    int rows, table_width, threads, silu_pieces;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *seq_lens;
    const float *embedded;
    float *normed;       /* hidden */
    float *qkv;          /* (heads + 2 kv_heads) head_dim */
    float *attn;         /* heads head_dim */
    float *proj;         /* hidden: the o and down projections' output */
    float *gate_up;      /* 2 intermediate */
    float *act;          /* intermediate */
    float *residual[2];  /* hidden: written in turn, so a sum never overwrites its own input */
} DecodeStep;

/* which kernel stopped a step (decode_layers.py names them) */
enum { FAILED_NORM = 1, FAILED_QKV, FAILED_ROPE, FAILED_STORE, FAILED_ATTENTION, FAILED_O, FAILED_GATE_UP, FAILED_SILU, FAILED_DOWN };

static int linear(const DecodeLinear *w, const float *x, float *y, int m, int threads) {
    /* rows_linear's wrapper passes x's row stride, or K for a single row */
    if (w->format) return rows_linear_quant(x, w->strips, w->format, w->bias, y, m, w->n, w->k, w->k, w->n, w->seg, threads);
    return rows_linear_f32(x, w->strips, w->bias, y, m, w->n, w->k, w->k, w->n, w->seg, threads);
}

/* Runs every layer; returns 0 with *final_residual the index of the residual buffer that holds the
 * last layer's residual (its hidden state is in ``proj``), or the failing kernel's status with
 * failed[0] = the layer and failed[1] = the kernel (FAILED_*). Each kernel checks its arguments before it
 * writes: a bad position or slot stops layer 0 with nothing written; a bad sequence length stops layer
 * 0's attention after its cache write (as in the Python layers). */
int decode_layers_f32(const DecodeModel *m, const DecodeLayer *layers, const DecodeStep *s, int *final_residual,
                      int *failed) {
    const int rows = s->rows, threads = s->threads, d = m->head_dim;
    const int q_size = m->heads * d, kv_size = m->kv_heads * d, qkv_width = q_size + 2 * kv_size;
    const int64_t num_slots = (int64_t)m->num_blocks * m->block_size;
    const float *residual = s->embedded;
    int next = 0, status = 0;
#define RUN(kernel, call)                  \
    do {                                   \
        status = (call);                   \
        if (status != 0) {                 \
            failed[0] = l, failed[1] = kernel; \
            return status;                 \
        }                                  \
    } while (0)
    for (int l = 0; l < m->num_layers; l++) {
        const DecodeLayer *L = &layers[l];
        if (l == 0) {
            RUN(FAILED_NORM, rms_norm_f32(s->embedded, NULL, s->normed, NULL, L->input_norm, rows, m->hidden,
                                          m->hidden, 0, L->input_eps, m->norm_lanes, threads));
        } else {
            float *sum = s->residual[next];
            RUN(FAILED_NORM, rms_norm_f32(s->proj, residual, s->normed, sum, L->input_norm, rows, m->hidden,
                                          m->hidden, m->hidden, L->input_eps, m->norm_lanes, threads));
            residual = sum, next ^= 1;
        }
        RUN(FAILED_QKV, linear(&L->qkv, s->normed, s->qkv, rows, threads));
        float *q = s->qkv, *k = s->qkv + q_size, *v = s->qkv + q_size + kv_size;
        RUN(FAILED_ROPE, rotary_neox_f32(q, k, s->positions, m->cos_table, m->sin_table, rows, m->heads, m->kv_heads,
                                         d / 2, qkv_width, qkv_width, m->table_stride, m->table_rows, threads));
        RUN(FAILED_STORE, store_kv_f32(k, v, L->k_cache, L->v_cache, s->slots, rows, m->kv_heads, d, m->block_size,
                                       qkv_width, qkv_width, threads, num_slots));
        RUN(FAILED_ATTENTION,
            paged_attention_f32(q, L->k_cache, L->v_cache, s->block_tables, s->seq_lens, NULL, s->seq_lens, s->attn,
                                rows, rows, m->heads, m->kv_heads, d, m->block_size, s->table_width, m->scale,
                                threads, m->num_blocks, qkv_width));
        RUN(FAILED_O, linear(&L->o, s->attn, s->proj, rows, threads));
        float *sum = s->residual[next];
        RUN(FAILED_NORM, rms_norm_f32(s->proj, residual, s->normed, sum, L->post_norm, rows, m->hidden, m->hidden,
                                      m->hidden, L->post_eps, m->norm_lanes, threads));
        residual = sum, next ^= 1;
        RUN(FAILED_GATE_UP, linear(&L->gate_up, s->normed, s->gate_up, rows, threads));
        RUN(FAILED_SILU, silu_and_mul_f32(s->gate_up, s->gate_up + m->intermediate, s->act, rows, m->intermediate,
                                          2 * m->intermediate, 2 * m->intermediate, m->silu_lanes, s->silu_pieces,
                                          s->silu_pieces));
        RUN(FAILED_DOWN, linear(&L->down, s->act, s->proj, rows, threads));
    }
#undef RUN
    *final_residual = residual == s->residual[0] ? 0 : residual == s->residual[1] ? 1 : -1;
    return 0;
}
