/* ---- pointwise kernels: one pass over the data instead of torch's several ops ----------------------------
 * They compute what the eager torch ops compute, rounding where those round (bf16: after every op), with no
 * fused multiply-add, so rotary and the residual add are bit-identical to torch; RMSNorm's sum of squares and
 * SiLU's exp differ from torch's in the last bits only. Rows are split across threads.
 */
#include "kiln_cpu.h"


/* out[r, i] = silu(x[r, i]) * x[r, n + i]  (the fused gate|up projection output) */
NOCONTRACT void kiln_silu_mul(const void *x, void *out, int64_t rows, int64_t n, int64_t x_stride, int64_t out_stride,
                              int bf16) {
    KILN_TIMED(KILN_T_ACTIVATION);
#pragma omp parallel for schedule(static) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t xo = r * x_stride, oo = r * out_stride;
        if (!bf16) {
            const float *g = (const float *)x + xo, *u = g + n;
            float *o = (float *)out + oo;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                const float e = exp_nonpos(g[i] < 0.0f ? g[i] : -g[i]); /* exp(-|g|) */
                const float sig = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e); /* one division, either branch's value */
                o[i] = (g[i] * sig) * u[i];
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                const float g = ld(x, xo + i, 1), e = exp_nonpos(g < 0.0f ? g : -g);
                const float silu = rnd(g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)), 1);
                st(out, oo + i, silu * ld(x, xo + n + i, 1), 1);
            }
        }
    }
}

/* s = x (+ residual); res_out = s when residual is given; out = weight * (s / sqrt(mean(s^2) + eps)),
 * the normalized value rounded to the dtype before the weight multiply (as torch.rms_norm then mul). */
NOCONTRACT void kiln_add_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *res_out,
                                  int64_t rows, int64_t dim, float eps, int bf16) {
    KILN_TIMED(KILN_T_NORM);
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r * dim;
        float ss = 0.0f;
        if (!bf16) {
            const float *a = (const float *)x + o;
            float *s = residual ? (float *)res_out + o : (float *)out + o;
            if (residual) {
                const float *b = (const float *)residual + o;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) s[i] = a[i] + b[i];
            } else {
                s = (float *)a;
            }
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += s[i] * s[i];
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
            const float *w = (const float *)weight;
            float *y = (float *)out + o;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) y[i] = w[i] * (s[i] * inv);
        } else { /* the sum first (rounded as torch's bf16 add), then the scaled values, vectorized */
            const void *s = residual ? res_out : x;
            if (residual) {
#pragma omp simd reduction(+ : ss)
                for (int64_t i = 0; i < dim; i++) {
                    const float v = rnd(ld(x, o + i, 1) + ld(residual, o + i, 1), 1);
                    st(res_out, o + i, v, 1);
                    ss += v * v;
                }
            } else {
#pragma omp simd reduction(+ : ss)
                for (int64_t i = 0; i < dim; i++) ss += ld(x, o + i, 1) * ld(x, o + i, 1);
            }
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) st(out, o + i, ld(weight, i, 1) * rnd(ld(s, o + i, 1) * inv, 1), 1);
        }
    }
}

/* Rotate-half RoPE in place over every head of x [tokens, heads, d] (row stride x_stride), with per-token
 * cos/sin [tokens, d] (row stride cs_stride): x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1). */
NOCONTRACT void kiln_rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads, int64_t d,
                            int64_t x_stride, int64_t cs_stride, int bf16) {
    KILN_TIMED(KILN_T_ROPE);
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * d > 32768)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t c = t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t b = t * x_stride + h * d;
            if (!bf16) {
                float *v = (float *)x + b;
                const float *cs = (const float *)cos + c, *sn = (const float *)sin + c;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * cs[i] + (-x2) * sn[i];
                    v[i + half] = x2 * cs[i + half] + x1 * sn[i + half];
                }
            } else {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = ld(x, b + i, 1), x2 = ld(x, b + i + half, 1);
                    st(x, b + i, rnd(x1 * ld(cos, c + i, 1), 1) + rnd(-x2 * ld(sin, c + i, 1), 1), 1);
                    st(x, b + i + half, rnd(x2 * ld(cos, c + i + half, 1), 1) + rnd(x1 * ld(sin, c + i + half, 1), 1), 1);
                }
            }
        }
    }
}

/* The step's new keys and values into their cache slots. v_cache[h, slot] = v[t, h, :] (rows of d, as torch
 * lays it out); K blocks are stored transposed, k_cache[h, block][i][offset] = k[t, h, i] with block = slot / bs,
 * offset = slot % bs, so decode scores a whole block with bs-wide FMAs (scores_t16). A bf16 cache in pair
 * layout (kv_pairs) is written as attention_bf16.c reads it. k/v rows strided. */
void kiln_cache_write(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
                      int64_t tokens, int64_t kv_heads, int64_t d, int64_t k_stride, int64_t v_stride,
                      int64_t num_blocks, int64_t block_size, int bf16) {
    KILN_TIMED(KILN_T_KV_WRITE);
    const size_t esz = bf16 ? 2 : 4;
    const int pairs = kv_pairs(bf16, block_size, d);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t first = ((h * num_blocks + block) * block_size) * d;
            if (pairs) { /* K [d/2][16][2], V [8][d][2] (attention_bf16.c) */
                const uint16_t *ks = (const uint16_t *)k + t * k_stride + h * d, *vs = (const uint16_t *)v + t * v_stride + h * d;
                uint16_t *kd = (uint16_t *)k_cache + first, *vd = (uint16_t *)v_cache + first;
                for (int64_t i = 0; i < d; i++) {
                    kd[((i / 2) * block_size + offset) * 2 + i % 2] = ks[i];
                    vd[((offset / 2) * d + i) * 2 + offset % 2] = vs[i];
                }
                continue;
            }
            memcpy((char *)v_cache + (size_t)(first + offset * d) * esz, (const char *)v + (size_t)(t * v_stride + h * d) * esz,
                   (size_t)d * esz);
            const char *src = (const char *)k + (size_t)(t * k_stride + h * d) * esz;
            char *dst = (char *)k_cache + (size_t)(first + offset) * esz;
            for (int64_t i = 0; i < d; i++) memcpy(dst + (size_t)(i * block_size) * esz, src + (size_t)i * esz, esz);
        }
    }
}
