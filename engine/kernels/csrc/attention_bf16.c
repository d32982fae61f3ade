/* ---- bf16 KV cache in pair layout: attention on vdpbf16ps ----
 *
 * A bf16 cache whose blocks are 16 tokens and whose head size is a multiple of 32 is laid out for the
 * instruction that multiplies bf16 pairs into float32 lanes (kv_pairs in kiln_cpu.h; kiln_cache_write
 * writes it, the Python side never reads it in place): a K block is [d/2][16][2] (for each pair of head
 * dimensions, the 16 tokens' values side by side), a V block [8][d][2] (for each pair of tokens, the head
 * dimensions side by side). Then one vdpbf16ps scores 16 tokens against two head dimensions of a query, and
 * one adds two tokens' weighted values into 16 outputs, with no conversion of the cache to float32 (which
 * cost more than the multiplies in the float32 layout's loops). Scores are exact products summed in
 * float32, as before; the softmax weights are rounded to bf16 before they multiply V, as transformers' bf16
 * eager attention and vLLM's CPU kernels do. */
#include "kiln_cpu.h"

#if KILN_HAVE_KV_PAIRS
#include <immintrin.h>
#define PAIRS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static inline uint32_t pair_at(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* s[q * stride + t] = scale * (q-th bf16 query row of qb [nq][d]) . K[t] for the 16 tokens t of block kb */
KILN_HIDDEN PAIRS_TARGET void kiln_scores_pairs(const uint16_t *qb, const uint16_t *kb, float *s, int64_t nq,
                                                int64_t stride, int64_t d, float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t q0 = 0; q0 < nq; q0 += 4) {
        const int nqb = nq - q0 < 4 ? (int)(nq - q0) : 4;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t p = 0; p < d / 2; p++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + p * 32);
            for (int i = 0; i < nqb; i++)
                a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32((int)pair_at(qb + (q0 + i) * d + 2 * p)), kv);
        }
        for (int i = 0; i < nqb; i++) _mm512_storeu_ps(s + (q0 + i) * stride, _mm512_mul_ps(a[i], sc));
    }
}

/* acc[q][0:d] += sum over the block's first n tokens of p[q * stride + t] V[t], the weights rounded to bf16 */
KILN_HIDDEN PAIRS_TARGET void kiln_values_pairs(float *acc, const uint16_t *vb, const float *p, int64_t n, int64_t nq,
                                                int64_t stride, int64_t d) {
    const __mmask16 live = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    const int64_t pairs = (n + 1) / 2;
    for (int64_t q = 0; q < nq; q++) {
        uint32_t w[8]; /* the 16 weights as bf16 pairs, zero past n */
        _mm256_storeu_si256((__m256i *)w, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, p + q * stride)));
        float *out = acc + q * d;
        for (int64_t c = 0; c < d; c += 64) {
            const int nv = d - c >= 64 ? 4 : (int)((d - c) / 16);
            __m512 a[4];
            for (int v = 0; v < nv; v++) a[v] = _mm512_loadu_ps(out + c + 16 * v);
            for (int64_t tp = 0; tp < pairs; tp++) {
                const __m512bh wp = (__m512bh)_mm512_set1_epi32((int)w[tp]);
                for (int v = 0; v < nv; v++)
                    a[v] = _mm512_dpbf16_ps(a[v], wp, (__m512bh)_mm512_loadu_si512(vb + (tp * d + c + 16 * v) * 2));
            }
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(out + c + 16 * v, a[v]);
        }
    }
}
#else /* never called: kv_pairs is 0 without AVX-512 */
KILN_HIDDEN void kiln_scores_pairs(const uint16_t *qb, const uint16_t *kb, float *s, int64_t nq, int64_t stride,
                                   int64_t d, float scale) {
    (void)qb, (void)kb, (void)s, (void)nq, (void)stride, (void)d, (void)scale;
}
KILN_HIDDEN void kiln_values_pairs(float *acc, const uint16_t *vb, const float *p, int64_t n, int64_t nq,
                                   int64_t stride, int64_t d) {
    (void)acc, (void)vb, (void)p, (void)n, (void)nq, (void)stride, (void)d;
}
#endif
