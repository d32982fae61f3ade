/* Paged attention read straight from the KV cache blocks (one query token per row). */
#include "kiln_cpu.h"

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
 * bf16:           0 = every tensor float32, 1 = every tensor bfloat16 (math in float32), 2 = bfloat16 with the
 *                 cache in pair layout where kv_pairs holds (scores and weighted values on vdpbf16ps)
 *
 * Each (group, KV head) is one task: the query heads of the KV head's GQA group, for every row of the
 * group, are scored against the keys (scores kept, then an exact softmax per query over its own context
 * length), then V is summed with those weights. amx_queries (0: never): a task of at least that many query
 * vectors on a cache in pair layout runs its scores and values on AMX tiles (attention_amx.c; the caller's
 * tactic table says where that pays). Returns 0, or -1 when scratch memory could not be allocated.
 */
int kiln_paged_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                         const int32_t *ctx_lens, const int32_t *row_starts, void *out, int64_t num_groups,
                         int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t d,
                         int64_t bt_stride, int64_t q_stride, int64_t out_stride, float scale, int bf16,
                         int64_t amx_queries) {
    KILN_TIMED(KILN_T_ATTENTION);
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
    const int pairs = kv_pairs(bf16, block_size, d); /* bf16 cache in pair layout: attention_bf16.c's loops */
    int failed = 0;
#pragma omp parallel if (tasks > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_q * stride));
        float *qf = malloc(sizeof(float) * (size_t)(max_q * d));
        float *acc = malloc(sizeof(float) * (size_t)(max_q * d));
        float *tmp = malloc(sizeof(float) * (size_t)bsd);
        uint16_t *pb = pairs && amx_queries ? malloc(sizeof(uint16_t) * (size_t)(max_q * stride)) : 0;
        int tiles_used = 0; /* this thread configured AMX tiles (attention_amx.c): release them at the end */
        if (!scores || !qf || !acc || !tmp || (pairs && amx_queries && !pb)) {
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
                    if (pairs) { /* the bf16 rows as they are; the scale multiplies the scores */
                        memcpy((uint16_t *)qf + (i * group + g) * d, (const uint16_t *)q + src, (size_t)d * 2);
                        continue;
                    }
                    float *dst = qf + (i * group + g) * d;
                    for (int64_t e = 0; e < d; e++)
                        dst[e] = scale * ld(q, src + e, bf16);
                }
            /* enough queries to fill AMX tiles (a prefill group): scores and values on them, unscaled scores */
            const int tiles = pairs && amx_queries && nq >= amx_queries &&
                              kiln_scores_amx((const uint16_t *)qf, nq, d, k_cache, base, table, nblocks, scores, stride);
            tiles_used |= tiles;
            for (int64_t j = 0; j < PREFETCH_BLOCKS && j < nblocks && !tiles; j++)
                prefetch_block(k_cache, bf16, (base + table[j]) * bsd, bsd);
            for (int64_t j = 0; j < nblocks && !tiles; j++) {
                const int64_t ahead = j + PREFETCH_BLOCKS;
                if (ahead < nblocks) prefetch_block(k_cache, bf16, (base + table[ahead]) * bsd, bsd);
                else if (ahead - nblocks < nblocks) prefetch_block(v_cache, bf16, (base + table[ahead - nblocks]) * bsd, bsd);
                if (pairs) {
                    kiln_scores_pairs((const uint16_t *)qf, (const uint16_t *)k_cache + (base + table[j]) * bsd,
                                      scores + j * 16, nq, stride, d, scale);
                    continue;
                }
                const float *kb = block_rows(k_cache, bf16, (base + table[j]) * bsd, bsd, tmp);
                if (block_size == 16) scores_t16(qf, kb, scores + j * 16, nq, stride, d);
                else scores_t(qf, kb, scores + j * block_size, nq, stride, d, block_size);
            }
            for (int64_t qi = 0; qi < nq; qi++) {
                const int64_t n = ctx_lens[r0 + qi / group];
                float *s = scores + qi * stride, m, sum = 0.0f;
                if (tiles)
#pragma omp simd
                    for (int64_t t = 0; t < n; t++) s[t] *= scale;
                m = s[0];
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
            if (tiles) kiln_values_amx(acc, scores, stride, nq, d, v_cache, base, table, nblocks, len, pb);
            for (int64_t j = 0; j < nblocks && !tiles; j++) {
                const int64_t n = len - j * block_size < block_size ? len - j * block_size : block_size;
                if (j + PREFETCH_BLOCKS < nblocks) prefetch_block(v_cache, bf16, (base + table[j + PREFETCH_BLOCKS]) * bsd, bsd);
                if (pairs) {
                    kiln_values_pairs(acc, (const uint16_t *)v_cache + (base + table[j]) * bsd, scores + j * 16, n, nq,
                                      stride, d);
                    continue;
                }
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
        if (tiles_used) kiln_amx_release();
        free(scores);
        free(qf);
        free(acc);
        free(tmp);
        free(pb);
    }
    return failed ? -1 : 0;
}
