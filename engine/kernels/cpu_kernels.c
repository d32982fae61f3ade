/* kiln's CPU kernels: paged attention read straight from the KV cache blocks, fused pointwise ops, and a
 * float32 GEMM over weights packed for decode-sized row counts.
 *
 * C99 with GCC vector extensions + OpenMP, compiled per ISA level (x86-64-v4, x86-64-v3, armv8-a) by
 * engine/kernels/native.py and called through ctypes with raw tensor pointers; no torch headers, so a
 * build takes about a second. The loops are written for the compiler's vectorizer: 16-wide FMAs over
 * transposed key blocks, head_dim-long axpys over value rows, a polynomial exp, and register-tiled
 * broadcast FMAs over weight panels.
 *
 * Threads: the OpenMP runtime is the one torch loaded (same soname, libgomp.so.1), so a parallel
 * region here uses torch's thread count (torch.set_num_threads) and its warm thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KILN_ABI_VERSION 6

int kiln_abi_version(void) { return KILN_ABI_VERSION; }

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* element i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float */
static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* e^x for x <= 0 (scores minus their max), Cephes' expf: about 1 ulp, vectorizable. */
#pragma omp declare simd notinbranch
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The attention loops' vector: the ISA's own width (16 floats on AVX-512, 8 on AVX2 / NEON). GCC lowers a
 * 64-byte vector on AVX2 through the stack, which made the x86-64-v3 attention 5-8x slower than this. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vnat __attribute__((vector_size(VW * 4), aligned(4)));
static inline vnat loadv(const float *p) { return *(const vnat *)p; }
static inline void storev(float *p, vnat v) { *(vnat *)p = v; }

/* One block's rows as float: the cache itself (float32) or a converted copy in `tmp` (bf16). */
static inline const float *block_rows(const void *cache, int bf16, int64_t offset, int64_t n, float *tmp) {
    if (!bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) tmp[i] = bf16_to_f32(src[i]);
    return tmp;
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4 /* how many blocks ahead the K and V passes prefetch (measured: 4 into L2 beats 1-2 into L1 by 1.2-1.4x) */
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2 /* prefetcht1: into L2 */
#endif
static inline void prefetch_block(const void *cache, int bf16, int64_t offset, int64_t n) {
    const char *p = (const char *)cache + offset * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < n * (bf16 ? 2 : 4); b += 64) __builtin_prefetch(p + b, 0, PREFETCH_LOCALITY);
}

/* acc[q] += sum_t p[q * stride + t] * v[t] for every query vector q of the task (head size D, a multiple of 16) */
#define VALUE_BODY(D)                                                                      \
    for (int64_t t = 0; t < n; t++) {                                                      \
        vnat vv[(D) / VW];                                                                 \
        for (int c = 0; c < (D) / VW; c++) vv[c] = loadv(vb + t * (D) + VW * c);           \
        for (int64_t g = 0; g < group; g++) {                                              \
            const float w = p[g * stride + t];                                             \
            for (int c = 0; c < (D) / VW; c++) acc[g * ((D) / VW) + c] += w * vv[c];       \
        }                                                                                  \
    }

static void values_d64(vnat *acc, const float *vb, const float *p, int64_t n, int64_t group, int64_t stride) { VALUE_BODY(64) }
static void values_d128(vnat *acc, const float *vb, const float *p, int64_t n, int64_t group, int64_t stride) { VALUE_BODY(128) }

/* Scores of `group` (pre-scaled) queries against one block of keys stored transposed, kt[i * bs + t]
 * (kiln_cache_write lays K out so): for every head dimension i, one broadcast FMA over the block's bs
 * tokens per query head -- no horizontal sums. Writes bs scores per head at s[g * stride + t]. */
#define BLK_NV (16 / VW) /* vectors per 16-token block */
static void scores_t16(const float *q, const float *kt, float *s, int64_t group, int64_t stride, int64_t d) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t ng = group - g0 < 4 ? group - g0 : 4;
        const float *q0 = q + g0 * d;
        vnat a[4][BLK_NV];
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < BLK_NV; c++) a[g][c] = (vnat){0};
        for (int64_t i = 0; i < d; i++) {
            vnat k[BLK_NV];
            for (int c = 0; c < BLK_NV; c++) k[c] = loadv(kt + i * 16 + c * VW);
            for (int c = 0; c < BLK_NV; c++) a[0][c] += q0[i] * k[c];
            if (ng > 1)
                for (int c = 0; c < BLK_NV; c++) a[1][c] += q0[d + i] * k[c];
            if (ng > 2)
                for (int c = 0; c < BLK_NV; c++) a[2][c] += q0[2 * d + i] * k[c];
            if (ng > 3)
                for (int c = 0; c < BLK_NV; c++) a[3][c] += q0[3 * d + i] * k[c];
        }
        for (int64_t g = 0; g < ng; g++)
            for (int c = 0; c < BLK_NV; c++) storev(s + (g0 + g) * stride + c * VW, a[g][c]);
    }
}

static void scores_t(const float *q, const float *kt, float *s, int64_t group, int64_t stride, int64_t d, int64_t bs) {
    for (int64_t g = 0; g < group; g++) {
        float *out = s + g * stride;
        for (int64_t t = 0; t < bs; t++) out[t] = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            const float w = q[g * d + i];
#pragma omp simd
            for (int64_t t = 0; t < bs; t++) out[t] += w * kt[i * bs + t];
        }
    }
}

static void values_any(float *acc, const float *vb, const float *p, int64_t n, int64_t group, int64_t stride, int64_t d) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < group; g++) {
            const float w = p[g * stride + t];
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[g * d + i] += w * vb[t * d + i];
        }
}

/* Paged attention, one query token per row, each over its own context in the cache blocks.
 *
 * q, out:         [rows, heads, d] with row strides q_stride / out_stride (elements)
 * k_cache/v_cache:[kv_heads, num_blocks, block_size, d]; K blocks stored transposed ([d][block_size],
 *                 kiln_cache_write), V blocks as rows
 * block_tables:   [rows, bt_stride] int32; ctx_lens: [rows] int32 (>= 1, <= bt_stride * block_size)
 * row_starts:     [num_groups + 1] int32: rows row_starts[i] .. row_starts[i+1]-1 form a group that shares
 *                 the first row's block table (a decode row alone; consecutive tokens of one prefill chunk,
 *                 whose causal contexts differ only in length). Each group's K/V blocks are read once.
 * bf16:           0 = every tensor float32, 1 = every tensor bfloat16 (math in float32)
 *
 * Each (group, KV head) is one task: the query heads of the KV head's GQA group, for every row of the
 * group, are scored against the keys (scores kept, then an exact softmax per query over its own context
 * length), then V is summed with those weights. Returns 0, or -1 when scratch memory could not be allocated.
 */
int kiln_paged_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                         const int32_t *ctx_lens, const int32_t *row_starts, void *out, int64_t num_groups,
                         int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t d,
                         int64_t bt_stride, int64_t q_stride, int64_t out_stride, float scale, int bf16) {
    const int64_t group = heads / kv_heads;
    int64_t max_ctx = 0, max_rows = 0;
    for (int64_t i = 0; i < num_groups; i++) {
        const int64_t n = row_starts[i + 1] - row_starts[i];
        max_rows = n > max_rows ? n : max_rows;
        for (int64_t r = row_starts[i]; r < row_starts[i + 1]; r++) max_ctx = ctx_lens[r] > max_ctx ? ctx_lens[r] : max_ctx;
    }
    /* a score row holds whole blocks: the transposed-K score loop writes block_size scores per block */
    const int64_t stride = (max_ctx + block_size - 1) / block_size * block_size;
    const int64_t tasks = num_groups * kv_heads, bsd = block_size * d, max_q = max_rows * group;
    int failed = 0;
#pragma omp parallel if (tasks > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_q * stride));
        float *qf = malloc(sizeof(float) * (size_t)(max_q * d));
        float *acc = malloc(sizeof(float) * (size_t)(max_q * d));
        float *tmp = malloc(sizeof(float) * (size_t)bsd);
        if (!scores || !qf || !acc || !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed) continue;
            const int64_t grp = task / kv_heads, h = task % kv_heads;
            const int64_t r0 = row_starts[grp], nrows = row_starts[grp + 1] - r0, nq = nrows * group;
            int64_t len = 0; /* the group's longest context */
            for (int64_t i = 0; i < nrows; i++) len = ctx_lens[r0 + i] > len ? ctx_lens[r0 + i] : len;
            const int64_t nblocks = (len + block_size - 1) / block_size;
            const int32_t *table = block_tables + r0 * bt_stride;
            const int64_t base = h * num_blocks;
            for (int64_t i = 0; i < nrows; i++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t src = (r0 + i) * q_stride + (h * group + g) * d;
                    float *dst = qf + (i * group + g) * d;
                    for (int64_t e = 0; e < d; e++)
                        dst[e] = scale * ld(q, src + e, bf16);
                }
            for (int64_t j = 0; j < PREFETCH_BLOCKS && j < nblocks; j++) prefetch_block(k_cache, bf16, (base + table[j]) * bsd, bsd);
            for (int64_t j = 0; j < nblocks; j++) {
                const int64_t ahead = j + PREFETCH_BLOCKS;
                if (ahead < nblocks) prefetch_block(k_cache, bf16, (base + table[ahead]) * bsd, bsd);
                else if (ahead - nblocks < nblocks) prefetch_block(v_cache, bf16, (base + table[ahead - nblocks]) * bsd, bsd);
                const float *kb = block_rows(k_cache, bf16, (base + table[j]) * bsd, bsd, tmp);
                if (block_size == 16) scores_t16(qf, kb, scores + j * 16, nq, stride, d);
                else scores_t(qf, kb, scores + j * block_size, nq, stride, d, block_size);
            }
            for (int64_t qi = 0; qi < nq; qi++) {
                const int64_t n = ctx_lens[r0 + qi / group];
                float *s = scores + qi * stride, m = s[0], sum = 0.0f;
                for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; t++) {
                    s[t] = exp_nonpos(s[t] - m);
                    sum += s[t];
                }
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t t = 0; t < n; t++) s[t] *= inv;
                for (int64_t t = n; t < len; t++) s[t] = 0.0f; /* past this row's causal end */
            }
            memset(acc, 0, sizeof(float) * (size_t)(nq * d));
            for (int64_t j = 0; j < nblocks; j++) {
                const int64_t n = len - j * block_size < block_size ? len - j * block_size : block_size;
                if (j + PREFETCH_BLOCKS < nblocks) prefetch_block(v_cache, bf16, (base + table[j + PREFETCH_BLOCKS]) * bsd, bsd);
                const float *vb = block_rows(v_cache, bf16, (base + table[j]) * bsd, n * d, tmp);
                const float *p = scores + j * block_size;
                if (d == 64) values_d64((vnat *)acc, vb, p, n, nq, stride);
                else if (d == 128) values_d128((vnat *)acc, vb, p, n, nq, stride);
                else values_any(acc, vb, p, n, nq, stride, d);
            }
            for (int64_t qi = 0; qi < nq; qi++) {
                const int64_t dst = (r0 + qi / group) * out_stride + (h * group + qi % group) * d;
                for (int64_t e = 0; e < d; e++) st(out, dst + e, acc[qi * d + e], bf16);
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(tmp);
    }
    return failed ? -1 : 0;
}

/* ---- pointwise kernels: one pass over the data instead of torch's several ops ----------------------------
 * They compute what the eager torch ops compute, rounding where those round (bf16: after every op), with no
 * fused multiply-add, so rotary and the residual add are bit-identical to torch; RMSNorm's sum of squares and
 * SiLU's exp differ from torch's in the last bits only. Rows are split across threads.
 */
#define NOCONTRACT __attribute__((optimize("fp-contract=off")))

static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* out[r, i] = silu(x[r, i]) * x[r, n + i]  (the fused gate|up projection output) */
NOCONTRACT void kiln_silu_mul(const void *x, void *out, int64_t rows, int64_t n, int64_t x_stride, int64_t out_stride,
                              int bf16) {
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
 * offset = slot % bs, so decode scores a whole block with bs-wide FMAs (scores_t16). k/v rows strided. */
void kiln_cache_write(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
                      int64_t tokens, int64_t kv_heads, int64_t d, int64_t k_stride, int64_t v_stride,
                      int64_t num_blocks, int64_t block_size, int bf16) {
    const size_t esz = bf16 ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t first = ((h * num_blocks + block) * block_size) * d;
            memcpy((char *)v_cache + (size_t)(first + offset * d) * esz, (const char *)v + (size_t)(t * v_stride + h * d) * esz,
                   (size_t)d * esz);
            const char *src = (const char *)k + (size_t)(t * k_stride + h * d) * esz;
            char *dst = (char *)k_cache + (size_t)(first + offset) * esz;
            for (int64_t i = 0; i < d; i++) memcpy(dst + (size_t)(i * block_size) * esz, src + (size_t)i * esz, esz);
        }
    }
}

/* ---- float32 linear: y[M, N] = x[M, K] W^T (+ b), W packed once into 64-column panels (16 on AVX2/NEON) ----
 *
 * oneDNN's and MKL's GEMMs are tuned for large M; a decode step multiplies a few rows by every weight of
 * the model, which then streams from memory once per step. Here W is packed (kiln_pack_linear_f32) as
 * panels [ceil(N / 64)][K][64] (the last one zero-padded), so a panel's K x 64 slice is one contiguous
 * stream, and a register tile of LIN_MR rows x LIN_PANEL columns accumulates over K with broadcast FMAs:
 * every weight loaded is used LIN_MR times from registers, and a row tile re-reads its panel from L2,
 * not from memory; while they do, they prefetch the next panel's weights (a lone tile streams its own
 * faster with the hardware prefetcher alone). Rows go in chunks of LIN_MC (their x slice stays in L2
 * across panels), K in blocks of LIN_KC (a panel's slice stays in L2 across row tiles). Measured against
 * oneDNN's prepacked sgemm (one thread, AVX-512 EPYC, a llama-bench layer stack streaming from memory):
 * 1.7x at 1 row, 1.45x at 8, 1.2x at 16, equal from 256 to 2048 rows. */
#if defined(__AVX512F__)
typedef float vlin __attribute__((vector_size(64), aligned(4))); /* 6 rows x 4 zmm = 24 accumulators of 32 registers */
#define LIN_VEC 16
#define LIN_PANEL 64
#else
typedef float vlin __attribute__((vector_size(32), aligned(4))); /* AVX2 / NEON: 6 rows x 2 vectors of 8 = 12 of 16 ymm */
#define LIN_VEC 8
#define LIN_PANEL 16
#endif
#define LIN_NV (LIN_PANEL / LIN_VEC)
#define LIN_MR 6
#ifndef LIN_KC
#define LIN_KC 1024
#endif
#ifndef LIN_PF_ROWS
#if defined(__AVX512F__)
#define LIN_PF_ROWS (LIN_MR + 1) /* one tile alone streams its weights best with the hardware prefetcher alone */
#else
/* 16-column panels are 4x the streams of 64-column ones: left to the hardware prefetcher, 4-6 rows ran at
 * 55-60 % of the prefetched rate (one thread, Zen 4 at x86-64-v3); one row still streams best alone */
#define LIN_PF_ROWS 2
#endif
#endif
#ifndef LIN_MC
#define LIN_MC 192
#endif

/* tile[r][0:ncols] of rows r < mr: ys[r * ldy + j] = (prev ? prev[r * ldp + j] : 0) + acc */
#define LIN_TILE(MR)                                                                                          \
    static void lin_tile##MR(const float *x, int64_t ldx, const float *w, int64_t kn, float *y, int64_t ldy,  \
                             const float *prev, int64_t ldp, int ncols, const float *pf, int64_t pf_rows) {   \
        vlin acc[MR][LIN_NV];                                                                                 \
        for (int r = 0; r < MR; r++)                                                                          \
            for (int c = 0; c < LIN_NV; c++) acc[r][c] = (vlin){0};                                           \
        int64_t pf_acc = 0;                                                                                   \
        for (int64_t k = 0; k < kn; k++) {                                                                    \
            for (pf_acc += pf_rows; pf && pf_acc >= kn; pf_acc -= kn, pf += LIN_PANEL)                        \
                for (int b = 0; b < LIN_PANEL * 4; b += 64) __builtin_prefetch((const char *)pf + b, 0, 2);   \
            vlin wv[LIN_NV];                                                                                  \
            for (int c = 0; c < LIN_NV; c++) wv[c] = *(const vlin *)(w + k * LIN_PANEL + c * LIN_VEC);        \
            for (int r = 0; r < MR; r++) {                                                                    \
                const float xv = x[r * ldx + k];                                                              \
                for (int c = 0; c < LIN_NV; c++) acc[r][c] += xv * wv[c];                                     \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < MR; r++) {                                                                        \
            float *o = y + r * ldy;                                                                           \
            const float *pr = prev ? prev + r * ldp : 0;                                                      \
            if (ncols == LIN_PANEL) {                                                                          \
                for (int c = 0; c < LIN_NV; c++)                                                              \
                    *(vlin *)(o + c * LIN_VEC) = pr ? *(const vlin *)(pr + c * LIN_VEC) + acc[r][c] : acc[r][c]; \
            } else {                                                                                          \
                float t[LIN_PANEL];                                                                            \
                memcpy(t, acc[r], sizeof t);                                                                  \
                for (int j = 0; j < ncols; j++) o[j] = pr ? pr[j] + t[j] : t[j];                              \
            }                                                                                                 \
        }                                                                                                     \
    }
LIN_TILE(1) LIN_TILE(2) LIN_TILE(3) LIN_TILE(4) LIN_TILE(5) LIN_TILE(6)
typedef void (*lin_tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, int64_t, int,
                            const float *, int64_t);
static const lin_tile_fn lin_tiles[LIN_MR + 1] = {0, lin_tile1, lin_tile2, lin_tile3, lin_tile4, lin_tile5, lin_tile6};

int64_t kiln_linear_panel(void) { return LIN_PANEL; }

/* w [N, K] (row stride ldw) -> packed [ceil(N / LIN_PANEL)][K][LIN_PANEL], columns past N zero */
void kiln_pack_linear_f32(const float *w, float *packed, int64_t n, int64_t k, int64_t ldw) {
    const int64_t panels = (n + LIN_PANEL - 1) / LIN_PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++) {
            float *dst = packed + (p * k + i) * LIN_PANEL;
            for (int64_t j = 0; j < LIN_PANEL; j++) {
                const int64_t col = p * LIN_PANEL + j;
                dst[j] = col < n ? w[col * ldw + i] : 0.0f;
            }
        }
}

/* One tile of a linear: rows [m0, m0 + mr) x panel u over rows [k0, k0 + kn) of the panel's packed K;
 * it also prefetches rows [k0 + pf_lo, + pf_rows) of the next panel (pf_rows 0: nothing). */
typedef void (*lin_tile_call)(const void *args, int64_t u, int64_t m0, int64_t mr, int64_t k0, int64_t kn,
                              int64_t pf_lo, int64_t pf_rows);

/* The schedule both linears run: rows in chunks of LIN_MC of (near) equal height, so no thread gets a short
 * one; (chunk, panel) pairs split between threads; packed K in blocks of kc; in each, tiles of near-equal
 * height (13 rows = 5 + 4 + 4, not 6 + 6 + 1: a 1-row tile waits on loads). When the rows come in one chunk
 * (a decode step's) with more than one tile, the tiles prefetch the next panel's block while they use
 * this one's from L2, each its share by rows. */
static void lin_schedule(int64_t m, int64_t units, int64_t k, int64_t kc, const void *args, lin_tile_call tile) {
    const int64_t chunks = (m + LIN_MC - 1) / LIN_MC;
    const int64_t mc = (m + chunks - 1) / chunks;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t ch = 0; ch < chunks; ch++)
        for (int64_t u = 0; u < units; u++) {
            const int64_t m1 = ch * mc + mc < m ? ch * mc + mc : m, rows = m1 - ch * mc;
            const int prefetch = chunks == 1 && u + 1 < units && rows >= LIN_PF_ROWS;
            const int64_t tiles = (rows + LIN_MR - 1) / LIN_MR;
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t kn = k - k0 < kc ? k - k0 : kc;
                for (int64_t t = 0, m0 = ch * mc, mr; t < tiles; t++, m0 += mr) {
                    mr = rows / tiles + (t < rows % tiles);
                    const int64_t lo = (m0 - ch * mc) * kn / rows, hi = (m0 - ch * mc + mr) * kn / rows;
                    tile(args, u, m0, mr, k0, kn, lo, prefetch ? hi - lo : 0);
                }
            }
        }
}

static int lin_cols(int64_t n, int64_t col) { return (int)(n - col < LIN_PANEL ? n - col : LIN_PANEL); }

struct lin_f32_args {
    const float *x, *packed, *bias;
    float *y;
    int64_t n, k, ldx, ldy;
};

static void lin_f32_tile(const void *args, int64_t u, int64_t m0, int64_t mr, int64_t k0, int64_t kn, int64_t pf_lo,
                         int64_t pf_rows) {
    const struct lin_f32_args *a = args;
    const int64_t col = u * LIN_PANEL;
    const float *wp = a->packed + u * LIN_PANEL * a->k, *next = wp + LIN_PANEL * a->k;
    float *out = a->y + m0 * a->ldy + col;
    const float *prev = k0 ? out : (a->bias ? a->bias + col : 0); /* later K blocks add to the partial sums */
    lin_tiles[mr](a->x + m0 * a->ldx + k0, a->ldx, wp + k0 * LIN_PANEL, kn, out, a->ldy, prev, k0 ? a->ldy : 0,
                  lin_cols(a->n, col), pf_rows ? next + (k0 + pf_lo) * LIN_PANEL : 0, pf_rows);
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) W^T + bias (bias may be NULL) */
void kiln_linear_f32(const float *x, const float *packed, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t ldx, int64_t ldy) {
    const struct lin_f32_args args = {x, packed, bias, y, n, k, ldx, ldy};
    lin_schedule(m, (n + LIN_PANEL - 1) / LIN_PANEL, k, LIN_KC, &args, lin_f32_tile);
}

/* ---- bfloat16 linear on AVX512-BF16: y = bf16(x W^T + b), fp32 accumulation ----
 *
 * The same panels, tiles and prefetch as the float32 linear, with W packed in K pairs,
 * [ceil(N / 64)][ceil(K / 2)][64][2] (zero-padded), so one vdpbf16ps multiplies a broadcast pair of x by
 * the pairs of 16 columns and adds both products into float32 lanes. Each output is rounded to bf16
 * once, at the end (round to nearest even, as torch). oneDNN runs the same instruction; its results
 * match these bit for bit at K <= 1024 and to within one bf16 ulp past it (another K blocking).
 * Measured against oneDNN's prepacked bf16 linear (one thread, AVX-512 BF16 EPYC, the llama-bench layer
 * stack): 1.7x at 1 row, 1.6x at 8, 1.6x at 16, 1.3x at 32, equal from 256 rows. Compiled into the
 * x86-64-v4 library only; kiln_linear_bf16_available() says so, and the caller checks the CPU's
 * avx512_bf16 flag before calling. */
#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define BF_PAIR (2 * LIN_PANEL) /* elements of one K pair of a panel */

#define BF_STEP(R, i, pair_of_row)                                                                           \
    do {                                                                                                     \
        __m512bh wv[4];                                                                                      \
        for (int c = 0; c < 4; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + (i) * BF_PAIR + 32 * c);        \
        for (int r = 0; r < R; r++) {                                                                        \
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)(pair_of_row));                             \
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);                  \
        }                                                                                                    \
    } while (0)

static inline uint32_t bf_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define BF_TILE(R)                                                                                           \
    BF16_TARGET static void bf_tile##R(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k,         \
                                       uint16_t *y, int64_t ldy, const float *bias, int ncols,               \
                                       const uint16_t *pf, int64_t pf_rows) {                                \
        __m512 acc[R][4];                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();                                     \
        const int64_t kp = k / 2;                                                                            \
        int64_t pf_acc = 0;                                                                                  \
        for (int64_t i = 0; i < kp; i++) {                                                                   \
            for (pf_acc += pf_rows; pf && pf_acc >= kp; pf_acc -= kp, pf += BF_PAIR)                         \
                for (int b = 0; b < BF_PAIR * 2; b += 64) __builtin_prefetch((const char *)pf + b, 0, 2);    \
            BF_STEP(R, i, bf_pair(x + r * ldx + 2 * i));                                                     \
        }                                                                                                    \
        if (k & 1) BF_STEP(R, kp, (uint32_t)x[r * ldx + 2 * kp]); /* the last pair's second half is 0 */    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int c = 0; c < 4 && 16 * c < ncols; c++) {                                                  \
                const int left = ncols - 16 * c;                                                             \
                const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);                  \
                __m512 v = acc[r][c];                                                                        \
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * c));                  \
                _mm256_mask_storeu_epi16(y + r * ldy + 16 * c, mask, (__m256i)_mm512_cvtneps_pbh(v));        \
            }                                                                                                \
    }
BF_TILE(1) BF_TILE(2) BF_TILE(3) BF_TILE(4) BF_TILE(5) BF_TILE(6)
typedef void (*bf_tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *, int64_t, const float *, int,
                           const uint16_t *, int64_t);
static const bf_tile_fn bf_tiles[LIN_MR + 1] = {0, bf_tile1, bf_tile2, bf_tile3, bf_tile4, bf_tile5, bf_tile6};

int kiln_linear_bf16_available(void) { return 1; }

/* w [N, K] bf16 (row stride ldw) -> packed [ceil(N / 64)][ceil(K / 2)][64][2] */
void kiln_pack_linear_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int64_t ldw) {
    const int64_t panels = (n + LIN_PANEL - 1) / LIN_PANEL, kp = (k + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < kp; i++)
            for (int64_t j = 0; j < LIN_PANEL; j++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t col = p * LIN_PANEL + j, kk = 2 * i + e;
                    packed[(p * kp + i) * BF_PAIR + 2 * j + e] = col < n && kk < k ? w[col * ldw + kk] : 0;
                }
}

struct lin_bf16_args {
    const uint16_t *x, *packed;
    const float *bias;
    uint16_t *y;
    int64_t n, k, ldx, ldy;
};

/* k0 = 0, kn = every K pair: the outputs are rounded to bf16 once, so K is not blocked */
BF16_TARGET static void lin_bf16_tile(const void *args, int64_t u, int64_t m0, int64_t mr, int64_t k0, int64_t kn,
                                      int64_t pf_lo, int64_t pf_rows) {
    const struct lin_bf16_args *a = args;
    const int64_t col = u * LIN_PANEL;
    const uint16_t *wp = a->packed + u * BF_PAIR * kn, *next = wp + BF_PAIR * kn;
    (void)k0;
    bf_tiles[mr](a->x + m0 * a->ldx, a->ldx, wp, a->k, a->y + m0 * a->ldy + col, a->ldy, a->bias ? a->bias + col : 0,
                 lin_cols(a->n, col), pf_rows ? next + pf_lo * BF_PAIR : 0, pf_rows);
}

/* y [m, n] bf16 (row stride ldy) = x [m, k] bf16 (row stride ldx) W^T + bias (float32, may be NULL) */
void kiln_linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                      int64_t k, int64_t ldx, int64_t ldy) {
    const struct lin_bf16_args args = {x, packed, bias, y, n, k, ldx, ldy};
    const int64_t kp = (k + 1) / 2;
    lin_schedule(m, (n + LIN_PANEL - 1) / LIN_PANEL, kp, kp, &args, lin_bf16_tile);
}
#else
int kiln_linear_bf16_available(void) { return 0; }
void kiln_pack_linear_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int64_t ldw) {
    (void)w, (void)packed, (void)n, (void)k, (void)ldw;
}
void kiln_linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                      int64_t k, int64_t ldx, int64_t ldy) {
    (void)x, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy;
}
#endif

/* ---- a pipeline stage's decoder layers in one call ---------------------------------------------------------
 *
 * The Llama-family decoder layer of models/llama.py, run with the kernels above in the order the per-module
 * path calls them, so the results are the same bit for bit; what goes away is the Python between the
 * kernels (module calls, tensor allocations, ctypes argument conversion: ~15 % of a 1-thread bf16 step on
 * the bench model, more with two threads, where the kernels halve and the Python does not). Per layer:
 *
 *   h, res = RMSNorm(x + res)            (the first layer of the first stage: res = x, h = RMSNorm(x))
 *   qkv = h Wqkv^T + bqkv;  RoPE(q, k);  K/V into the cache;  a = attention(q)
 *   x = a Wo^T (+ bo);  h, res = RMSNorm(x + res)
 *   x = down(SiLU(gate) * up) (+ bdown), gate|up = h Wgu^T + bgu, in slices of mlp_rows rows
 *
 * Column-parallel biases (qkv, gate|up) are float32 and fused into the GEMM (as Kernels.linear); row-parallel
 * ones (o, down) are in the model dtype and added after it (as RowParallelLinear), one rounding each. */
struct kiln_layer {
    const void *input_norm, *post_norm;    /* [hidden], model dtype */
    const void *qkv, *o, *gate_up, *down;  /* packed weights (kiln_pack_linear_*) */
    const float *qkv_bias, *gate_up_bias;  /* float32 or NULL */
    const void *o_bias, *down_bias;        /* model dtype or NULL */
    void *k_cache, *v_cache;               /* [kv_heads, num_blocks, block_size, head_dim], as kiln_cache_write */
};

struct kiln_stack {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, mlp_rows;
    float eps, scale;
    int32_t bf16;
};

static void stack_linear(const struct kiln_stack *s, const void *x, const void *w, const float *bias, void *y,
                         int64_t m, int64_t n, int64_t k) {
    if (s->bf16) kiln_linear_bf16(x, w, bias, y, m, n, k, k, n);
    else kiln_linear_f32(x, w, bias, y, m, n, k, k, n);
}

NOCONTRACT static void add_row_bias(void *y, const void *b, int64_t rows, int64_t n, int bf16) {
#pragma omp parallel for schedule(static) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) st(y, r * n + i, rnd(ld(y, r * n + i, bf16) + ld(b, i, bf16), bf16), bf16);
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
 * attention could not allocate its scratch memory. */
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
        stack_linear(s, h, L->qkv, L->qkv_bias, qkv, tokens, qkv_n, hid);
        kiln_rotary(qkv, cos, sin, tokens, s->heads + s->kv_heads, d, qkv_n, cs_stride, bf16);
        kiln_cache_write(qkv + q_n * esz, qkv + (q_n + kv_n) * esz, L->k_cache, L->v_cache, slots, tokens, s->kv_heads,
                         d, qkv_n, qkv_n, s->num_blocks, s->block_size, bf16);
        if (kiln_paged_attention(qkv, L->k_cache, L->v_cache, block_tables, ctx_lens, row_starts, attn, num_groups,
                                 s->heads, s->kv_heads, s->num_blocks, s->block_size, d, bt_stride, qkv_n, q_n, s->scale,
                                 bf16))
            return -1;
        stack_linear(s, attn, L->o, 0, x, tokens, hid, q_n);
        if (L->o_bias) add_row_bias(x, L->o_bias, tokens, hid, bf16);
        kiln_add_rms_norm(x, residual, L->post_norm, h, residual, tokens, hid, s->eps, bf16);
        for (int64_t r0 = 0; r0 < tokens; r0 += mlp) {
            const int64_t rows = tokens - r0 < mlp ? tokens - r0 : mlp;
            void *xr = (char *)x + r0 * hid * esz;
            stack_linear(s, h + r0 * hid * esz, L->gate_up, L->gate_up_bias, gate_up, rows, 2 * inter, hid);
            kiln_silu_mul(gate_up, act, rows, inter, 2 * inter, inter, bf16);
            stack_linear(s, act, L->down, 0, xr, rows, hid, inter);
            if (L->down_bias) add_row_bias(xr, L->down_bias, rows, hid, bf16);
        }
    }
    return 0;
}
