#include "kiln_cpu.h"

/* ---- a pipeline stage's decoder layers in one call ---------------------------------------------------------
 *
 * The Llama-family decoder layer of models/llama.py, run with kiln's kernels in the order the per-module
 * path calls them, so the results are the same bit for bit; what goes away is the Python between the
 * kernels (module calls, tensor allocations, ctypes argument conversion: ~15 % of a 1-thread bf16 step on
 * the bench model, more with two threads, where the kernels halve and the Python does not). Per layer:
 *
 *   h, res = RMSNorm(x + res)            (the first layer of the first stage: res = x, h = RMSNorm(x))
 *   qkv = h Wqkv^T + bqkv;  (Qwen3: each q and k head RMS-normed);  RoPE(q, k) (not in SmolLM3's NoPE layers);
 *   K/V into the cache;  a = attention(q)
 *   x = a Wo^T (+ bo);  h, res = RMSNorm(x + res)
 *   x = down(SiLU(gate) * up) (+ bdown), gate|up = h Wgu^T + bgu, in slices of mlp_rows rows
 *
 * Column-parallel biases (qkv, gate|up) are float32 and fused into the GEMM (as Kernels.linear); row-parallel
 * ones (o, down) are in the model dtype and added after it (as RowParallelLinear), one rounding each. */
struct kiln_layer {
    const void *input_norm, *post_norm;    /* [hidden], model dtype */
    const struct kiln_weight *qkv, *o, *gate_up, *down; /* packed, with their tactics (gemm_dispatch.c) */
    const float *qkv_bias, *gate_up_bias;  /* float32 or NULL */
    const void *o_bias, *down_bias;        /* model dtype or NULL */
    void *k_cache, *v_cache;               /* [kv_heads, num_blocks, block_size, head_dim], as kiln_cache_write */
    const void *q_norm, *k_norm;           /* [head_dim], model dtype, or NULL: Qwen3's per-head RMSNorms */
    int64_t rope;                          /* 0: no rotary in this layer (SmolLM3's NoPE layers) */
};

struct kiln_stack {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, mlp_rows, attn_amx_queries;
    float eps, scale;
    int32_t bf16;
};

/* y [m, w->n] = x [m, w->k] W^T (+ bias), both contiguous: the kernel the weight's tactics pick for m rows */
static int stack_linear(const struct kiln_weight *w, const void *x, const float *bias, void *y, int64_t m) {
    return kiln_gemm(w, x, bias, y, m, w->k, w->n);
}

NOCONTRACT static void add_row_bias(void *y, const void *b, int64_t rows, int64_t n, int bf16) {
    KILN_TIMED(KILN_T_BIAS);
#pragma omp parallel for schedule(static) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) st(y, r * n + i, rnd(ld(y, r * n + i, bf16) + ld(b, i, bf16), bf16), bf16);
}

/* Qwen3: each token's query heads, then its key heads, RMS-normed in place, one head a row (as the module
 * path's kiln_add_rms_norm over [tokens x heads, head_dim]: the same sums, so the same values). */
static void norm_heads(const struct kiln_stack *s, const struct kiln_layer *L, char *qkv, int64_t tokens) {
    const int64_t esz = s->bf16 ? 2 : 4, d = s->head_dim, row = (s->heads + 2 * s->kv_heads) * d * esz;
    for (int64_t t = 0; t < tokens; t++) {
        char *q = qkv + t * row, *k = q + s->heads * d * esz;
        kiln_add_rms_norm(q, 0, L->q_norm, q, 0, s->heads, d, s->eps, s->bf16);
        kiln_add_rms_norm(k, 0, L->k_norm, k, 0, s->kv_heads, d, s->eps, s->bf16);
    }
}

static int64_t stack_align(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* kiln_decoder_stack's scratch for `tokens` rows, in order: the normed rows, q|k|v, the attention output,
 * one MLP slice's gate|up and its SiLU x up. Sets parts[i] to each one's start in `base` (when parts is
 * given); returns the bytes in all. */
static int64_t stack_layout(const struct kiln_stack *s, int64_t tokens, char *base, char **parts) {
    const int64_t mlp = tokens < s->mlp_rows ? tokens : s->mlp_rows;
    const int64_t sizes[5] = {tokens * s->hidden, tokens * (s->heads + 2 * s->kv_heads) * s->head_dim,
                              tokens * s->heads * s->head_dim, mlp * 2 * s->inter, mlp * s->inter};
    int64_t bytes = 0;
    for (int i = 0; i < 5; i++) {
        if (parts) parts[i] = base + bytes;
        bytes += stack_align(sizes[i] * (s->bf16 ? 2 : 4));
    }
    return bytes;
}

/* Bytes of scratch kiln_decoder_stack needs for `tokens` rows. */
int64_t kiln_stack_workspace(const struct kiln_stack *s, int64_t tokens) { return stack_layout(s, tokens, 0, 0); }

/* x [tokens, hidden] (in: the layers' input; out: the last layer's MLP output) and residual [tokens, hidden]
 * (in: the running residual, or nothing when residual_empty; out: the residual after the last layer), both
 * contiguous, overwritten in place. cos/sin [tokens, head_dim] with row stride cs_stride; slots, block tables,
 * context lengths and row groups as kiln_cache_write and kiln_paged_attention take them. Returns 0, or -1 when
 * attention or an int8 GEMM could not allocate its scratch memory. */
int kiln_decoder_stack(const struct kiln_stack *s, const struct kiln_layer *layers, int64_t num_layers, void *x,
                       void *residual, int residual_empty, int64_t tokens, const void *cos, const void *sin,
                       int64_t cs_stride, const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *ctx_lens, const int32_t *row_starts, int64_t num_groups, void *workspace) {
    const int bf16 = s->bf16;
    const int64_t esz = bf16 ? 2 : 4, hid = s->hidden, d = s->head_dim, inter = s->inter;
    const int64_t q_n = s->heads * d, kv_n = s->kv_heads * d, qkv_n = q_n + 2 * kv_n;
    const int64_t mlp = tokens < s->mlp_rows ? tokens : s->mlp_rows;
    char *part[5];
    stack_layout(s, tokens, workspace, part);
    char *h = part[0], *qkv = part[1], *attn = part[2], *gate_up = part[3], *act = part[4];
    for (int64_t l = 0; l < num_layers; l++) {
        const struct kiln_layer *L = layers + l;
        if (l == 0 && residual_empty) {
            kiln_add_rms_norm(x, 0, L->input_norm, h, 0, tokens, hid, s->eps, bf16);
            memcpy(residual, x, (size_t)(tokens * hid * esz));
        } else {
            kiln_add_rms_norm(x, residual, L->input_norm, h, residual, tokens, hid, s->eps, bf16);
        }
        if (stack_linear(L->qkv, h, L->qkv_bias, qkv, tokens)) return -1;
        if (L->q_norm) norm_heads(s, L, qkv, tokens);
        if (L->rope) kiln_rotary(qkv, cos, sin, tokens, s->heads + s->kv_heads, d, qkv_n, cs_stride, bf16);
        kiln_cache_write(qkv + q_n * esz, qkv + (q_n + kv_n) * esz, L->k_cache, L->v_cache, slots, tokens, s->kv_heads,
                         d, qkv_n, qkv_n, s->num_blocks, s->block_size, bf16);
        if (kiln_paged_attention(qkv, L->k_cache, L->v_cache, block_tables, ctx_lens, row_starts, attn, num_groups,
                                 s->heads, s->kv_heads, s->num_blocks, s->block_size, d, bt_stride, qkv_n, q_n, s->scale,
                                 bf16, s->attn_amx_queries))
            return -1;
        if (stack_linear(L->o, attn, 0, x, tokens)) return -1;
        if (L->o_bias) add_row_bias(x, L->o_bias, tokens, hid, bf16);
        kiln_add_rms_norm(x, residual, L->post_norm, h, residual, tokens, hid, s->eps, bf16);
        for (int64_t r0 = 0; r0 < tokens; r0 += mlp) {
            const int64_t rows = tokens - r0 < mlp ? tokens - r0 : mlp;
            void *xr = (char *)x + r0 * hid * esz;
            if (stack_linear(L->gate_up, h + r0 * hid * esz, L->gate_up_bias, gate_up, rows)) return -1;
            kiln_silu_mul(gate_up, act, rows, inter, 2 * inter, inter, bf16);
            if (stack_linear(L->down, act, 0, xr, rows)) return -1;
            if (L->down_bias) add_row_bias(xr, L->down_bias, rows, hid, bf16);
        }
    }
    return 0;
}
