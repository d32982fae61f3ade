/* ---- attention of a prefill group on AMX tiles (bf16 cache in pair layout) ----
 *
 * A prefill chunk's tokens go in groups of 8 rows sharing a block table; with GQA each KV head serves 8 x g
 * query vectors, enough to fill AMX tiles of 16 rows. The pair layout (attention_bf16.c) is already what the
 * tiles take: a K block [d/2][16][2] is, per 32 head dimensions, one B tile of 16 pair-rows x 16 tokens, and
 * a V block [8][d][2] is, per 16 head dimensions, one B tile of 8 token-pair rows. So:
 *
 *   scores  S[q, t] = Q[q, :] . K[t, :]   C tile (16 queries x 16 tokens) per block, over d in steps of 32
 *   values  O[q, :] += P[q, t] V[t, :]     C tiles (16 queries x 16 dims) x d/16, over blocks of 16 tokens
 *
 * with the softmax between them in attention.c (float32), the weights rounded to bf16 as the vdpbf16ps
 * loops do. Each call configures the calling thread's tiles for its phase; kiln_amx_release ends them. */
#include "kiln_cpu.h"

#if KILN_HAVE_KV_PAIRS && (defined(__clang__) || __GNUC__ >= 11)
#include <immintrin.h>
#define ATT_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

struct att_tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* C tiles 0-3 (rows x 64 bytes), A tile 4 (rows x a_bytes), B tile 6 (b_rows x 64 bytes) */
ATT_AMX_TARGET static void att_configure(int rows, int a_bytes, int b_rows) {
    struct att_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    c.rows[4] = (uint8_t)rows, c.colsb[4] = (uint16_t)a_bytes;
    c.rows[6] = (uint8_t)b_rows, c.colsb[6] = 64;
    __asm__ volatile("" ::: "memory"); /* ldtilecfg's operand names 8 of the 64 bytes: keep all stores */
    _tile_loadconfig(&c);
}

/* scores[q * stride + j * 16 + t] = qb[q] . K(block j)[t] for every query q < nq (unscaled), d % 32 == 0 */
KILN_HIDDEN ATT_AMX_TARGET int kiln_scores_amx(const uint16_t *qb, int64_t nq, int64_t d, const uint16_t *k_cache,
                                               int64_t base, const int32_t *table, int64_t nblocks, float *scores,
                                               int64_t stride) {
    if (!kiln_amx_ready()) return 0;
    const int64_t bsd = 16 * d;
    for (int64_t q0 = 0; q0 < nq; q0 += 16) {
        const int rows = nq - q0 < 16 ? (int)(nq - q0) : 16;
        att_configure(rows, 64, 16);
        for (int64_t j = 0; j < nblocks; j++) {
            const uint16_t *kb = k_cache + (base + table[j]) * bsd;
            _tile_zero(0);
            for (int64_t i = 0; i < d; i += 32) {
                _tile_loadd(4, qb + q0 * d + i, d * 2);
                _tile_loadd(6, kb + i * 16, 64); /* 16 d-pairs x 16 tokens x 2 */
                _tile_dpbf16ps(0, 4, 6);
            }
            _tile_stored(0, scores + q0 * stride + j * 16, stride * 4);
        }
    }
    return 1;
}

/* acc[q][0:d] = sum over tokens t < len of p[q * stride + t] V[t] (p float32, rounded to bf16 here, 0 past each
 * query's own length already), for every query q < nq; pb: scratch of nq x nblocks * 16 bf16 */
KILN_HIDDEN ATT_AMX_TARGET int kiln_values_amx(float *acc, const float *p, int64_t stride, int64_t nq, int64_t d,
                                               const uint16_t *v_cache, int64_t base, const int32_t *table,
                                               int64_t nblocks, int64_t len, uint16_t *pb) {
    if (!kiln_amx_ready()) return 0;
    const int64_t bsd = 16 * d, width = nblocks * 16;
    for (int64_t q = 0; q < nq; q++)
        for (int64_t t = 0; t < width; t += 16) {
            const int64_t left = len - t;
            const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            __m512 v = _mm512_maskz_loadu_ps(live, p + q * stride + t);
            _mm256_storeu_si256((__m256i *)(pb + q * width + t), (__m256i)_mm512_cvtneps_pbh(v));
        }
    for (int64_t q0 = 0; q0 < nq; q0 += 16) {
        const int rows = nq - q0 < 16 ? (int)(nq - q0) : 16;
        att_configure(rows, 32, 8);
        for (int64_t c0 = 0; c0 < d; c0 += 64) { /* four 16-dim C tiles at a time */
            const int tiles = d - c0 >= 64 ? 4 : (int)((d - c0) / 16);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t j = 0; j < nblocks; j++) {
                const uint16_t *vb = v_cache + (base + table[j]) * bsd;
                _tile_loadd(4, pb + q0 * width + j * 16, width * 2); /* rows x 16 tokens */
                _tile_loadd(6, vb + (c0 + 0) * 2, d * 4);
                _tile_dpbf16ps(0, 4, 6);
                if (tiles > 1) {
                    _tile_loadd(6, vb + (c0 + 16) * 2, d * 4);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (tiles > 2) {
                    _tile_loadd(6, vb + (c0 + 32) * 2, d * 4);
                    _tile_dpbf16ps(2, 4, 6);
                }
                if (tiles > 3) {
                    _tile_loadd(6, vb + (c0 + 48) * 2, d * 4);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
            float *out = acc + q0 * d + c0;
            _tile_stored(0, out, d * 4);
            if (tiles > 1) _tile_stored(1, out + 16, d * 4);
            if (tiles > 2) _tile_stored(2, out + 32, d * 4);
            if (tiles > 3) _tile_stored(3, out + 48, d * 4);
        }
    }
    return 1;
}
#else
KILN_HIDDEN int kiln_scores_amx(const uint16_t *qb, int64_t nq, int64_t d, const uint16_t *k_cache, int64_t base,
                                const int32_t *table, int64_t nblocks, float *scores, int64_t stride) {
    (void)qb, (void)nq, (void)d, (void)k_cache, (void)base, (void)table, (void)nblocks, (void)scores, (void)stride;
    return 0;
}
KILN_HIDDEN int kiln_values_amx(float *acc, const float *p, int64_t stride, int64_t nq, int64_t d,
                                const uint16_t *v_cache, int64_t base, const int32_t *table, int64_t nblocks,
                                int64_t len, uint16_t *pb) {
    (void)acc, (void)p, (void)stride, (void)nq, (void)d, (void)v_cache, (void)base, (void)table, (void)nblocks,
        (void)len, (void)pb;
    return 0;
}
#endif
