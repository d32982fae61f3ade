/* ---- W8A8: int8 weights x int8 activations, int32 sums on the int8 units ----
 *
 * y[m, n] = s[n] * sum_b dx[m, b] (sum_{k in b} xq[m, k] q[n, k]) + bias[n]: the activations are quantized on
 * each call per row and per 32-block of K (llama.cpp's Q8_0 activations), symmetric: dx = max|x_b| / 127,
 * xq = round_half_even(x * (127 / max|x_b|)) in float32, clamped to +-127; q and s are the weight's per-channel
 * int8 values and scales (weight-only int8's). A block scale keeps an outlier channel from flattening the rest
 * of its token (one scale per token lost a third of SmolLM2's greedy agreement; per block it is within a point
 * of weight-only int8). This still changes what the linear computes, which is why a tactic table may be told
 * not to pick it (kiln.engine.kernels.candidates.EXCLUDE_ENV) where a quality gate says so.
 *
 * The weight is the int8 weight-only kernel's copy, same bytes (gemm_int8.c): panels of KILN_PANEL output
 * columns with K in groups of 4, [ceil(N / KILN_PANEL)][K quads][KILN_PANEL][4], so one vector load is 16
 * (zmm) or 8 (ymm) columns x 4 K values: what vpdpbusd multiplies against 4 bytes of one activation row
 * broadcast, adding the four products into each column's int32 lane. vpdpbusd takes unsigned x signed bytes:
 * the activations are stored as xq + 128 (0..255) and 128 * (each column's sum of q over the block) is
 * subtracted before the block's scale: ``bsums`` [panels][K quads / 8][KILN_PANEL] int16, made at pack time
 * (|sum| <= 32 x 128). The K quads are a multiple of 8 (i8_quads), so the blocks are whole; K past the weight is
 * zero in the panels and its blocks' scales are 0.
 *
 * Three instructions do the int8 products, each summing the same integers exactly (so all three give the same
 * int32 sums, and the float epilogue runs in the same order):
 *   - AVX512-VNNI (the x86-64-v4 library, 64-column panels): vpdpbusd on zmm, tiles of up to 3 rows x 64
 *     columns (4 zmm int32 accumulators for a block, 4 float32 ones for the row); on an AVX-512 CPU without
 *     VNNI (Skylake-SP) the same tiles with AVX2's sign trick below on zmm (AVX512BW);
 *   - AVX-VNNI (the x86-64-v3 library, 16-column panels; Intel's client parts from Alder Lake on, Sierra
 *     Forest: AVX-VNNI without AVX-512): vpdpbusd on ymm, tiles of up to 4 rows x 16 columns;
 *   - AVX2 (the x86-64-v3 library on any other CPU): vpmaddubsw + vpmaddwd, whose int16 pair sums would
 *     overflow on 255 x 127, so there the sign trick: |q| x sign(xq, q), which is q xq, pairs at most
 *     2 x 128 x 127; no offset to subtract.
 * And where the tactic table picked the AMX-INT8 kernel (KILN_GEMM_W8A8_AMX) and the caller allowed it
 * (kiln_w8a8_allow_amx), the x86-64-v4 library sums on AMX tiles of up to 16 rows (gemm_w8a8_amx.c, tdpbusd:
 * vpdpbusd's integers) and runs the zmm tiles' epilogue on them.
 * Rows are split into tiles of near-equal height, chunks of W8_MC rows and the panels shared out between
 * threads as gemm.c does. kiln_w8a8_available() says the library has a W8A8 kernel; which of its instructions
 * may run is the caller's to say (kiln_w8a8_allow_vnni: the CPU's flags and $KILN_CPU_ISA, kernels/isa.py), and
 * the library checks the CPU once more so a caller that skipped the check gets AVX2 or the fallback, never a
 * fault. */
#include "kiln_cpu.h"

#define W8_MC 192

/* kiln_w8a8_allow_vnni: whether the tiles may use vpdpbusd (the caller's leave, from the CPU's flags and
 * $KILN_CPU_ISA): AVX-VNNI in the x86-64-v3 library, AVX512-VNNI in the x86-64-v4 one */
static int w8_vnni = 0;
void kiln_w8a8_allow_vnni(int on) { w8_vnni = on; }

#if !(defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10))
/* The scalar form of the quantization (the vector one below computes the same bits): row r of x -> xq + 128
 * into q [kq4] (the bytes past k: 128, i.e. zero), each block's scale into sx [kq4 / 32]. */
static void w8_quantize_row(const void *x, int64_t k, int64_t kq4, int bf16, uint8_t *q, float *sx) {
    for (int64_t b0 = 0; b0 < kq4; b0 += W8_BLOCK) {
        const int64_t end = b0 + W8_BLOCK < k ? b0 + W8_BLOCK : k;
        float amax = 0.0f;
        for (int64_t i = b0; i < end; i++) {
            const float a = fabsf(ld(x, i, bf16));
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        sx[b0 / W8_BLOCK] = amax / 127.0f;
        for (int64_t i = b0; i < b0 + W8_BLOCK; i++) {
            float v = i < end ? nearbyintf(ld(x, i, bf16) * inv) : 0.0f;
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[i] = (uint8_t)((int)v + 128);
        }
    }
}
#endif

#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
#define W8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define W8_QTARGET __attribute__((target("avx512f,avx512bw,avx512vl"))) /* the x86-64-v4 library's own */
#define W8_QUAD (4 * KILN_PANEL) /* bytes of one K quad of a panel */
#define W8_MR 3                    /* rows of a tile */

/* acc += u8 x s8 quads of xb and w, the accumulators typed as the instruction's own int32 lanes: with GCC 12
 * the intrinsic (__m512i, cast inside) makes every accumulator live on the stack and be moved each step
 * (3x the loop's instructions); the builtin on __v16si keeps them in registers. */
#if defined(__clang__)
#define W8_DPBUSD(acc, xb, w) ((acc) = (__v16si)_mm512_dpbusd_epi32((__m512i)(acc), (xb), (w)))
#else
#define W8_DPBUSD(acc, xb, w) ((acc) = __builtin_ia32_vpdpbusd_v16si((acc), (__v16si)(xb), (__v16si)(w)))
#endif

/* bf16 of 16 floats, round to nearest even as f32_to_bf16 (NaN stays NaN), without AVX512-BF16 */
W8_QTARGET static inline __m256i w8_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 outputs at element i of y (bf16 or float32), the lanes of mask */
W8_QTARGET static inline void w8_store(void *y, int64_t i, __m512 v, __mmask16 mask, int bf16) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)y + i, mask, w8_to_bf16(v));
    else _mm512_mask_storeu_ps((float *)y + i, mask, v);
}

/* 16 values of x from element i (bf16 or float32) as float32 */
W8_QTARGET static inline __m512 w8_load(const void *x, int64_t i, int bf16, __mmask16 mask) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + i)), 16));
    return _mm512_maskz_loadu_ps(mask, (const float *)x + i);
}

static inline __mmask16 w8_mask(int64_t left) { return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); }

W8_QTARGET static void w8_quantize_row_vec(const void *x, int64_t k, int64_t kq4, int bf16, uint8_t *q, float *sx) {
    const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    for (int64_t b0 = 0; b0 < kq4; b0 += W8_BLOCK) {
        const __mmask16 m0 = w8_mask(k - b0), m1 = w8_mask(k - b0 - 16);
        const __m512 v0 = w8_load(x, b0, bf16, m0), v1 = w8_load(x, b0 + 16, bf16, m1);
        const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 vinv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
        sx[b0 / W8_BLOCK] = a / 127.0f;
        const __m512 h[2] = {v0, v1};
        for (int j = 0; j < 2; j++) {
            __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(h[j], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_max_ps(_mm512_min_ps(v, lim), nlim);
            const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i *)(q + b0 + 16 * j), _mm512_cvtepi32_epi8(u));
        }
    }
}

/* one K quad (i) of rows [0, R) against the panel's 4 weight vectors wv: vpdpbusd of the activations + 128 */
#define W8_VNNI_STEP(R)                                                                                       \
    for (int r = 0; r < R; r++) {                                                                             \
        int32_t quad;                                                                                         \
        memcpy(&quad, xq + r * ldq + 4 * i, sizeof quad);                                                     \
        const __m512i xb = _mm512_set1_epi32(quad);                                                           \
        for (int c = 0; c < 4; c++) W8_DPBUSD(acc[r][c], xb, wv[c]);                                          \
    }
/* the same sums on AVX512BW without VNNI (Skylake-SP): the sign trick of the AVX2 tiles (gemm_w8a8_ymm.c), |q| x
 * (xq negated where q < 0) through vpmaddubsw + vpmaddwd; AVX-512 has no vpsignb, so a masked negation. The
 * activation quad loses its +128 by a xor of its top bits; the int16 pair sums stay within 2 x 128 x 127. */
#define W8_BW_STEP(R)                                                                                         \
    __m512i aw[4];                                                                                            \
    __mmask64 neg[4];                                                                                         \
    for (int c = 0; c < 4; c++) aw[c] = _mm512_abs_epi8(wv[c]), neg[c] = _mm512_movepi8_mask(wv[c]);          \
    for (int r = 0; r < R; r++) {                                                                             \
        int32_t quad;                                                                                         \
        memcpy(&quad, xq + r * ldq + 4 * i, sizeof quad);                                                     \
        const __m512i xs = _mm512_xor_si512(_mm512_set1_epi32(quad), _mm512_set1_epi8((char)0x80));           \
        for (int c = 0; c < 4; c++)                                                                           \
            acc[r][c] = (__v16si)_mm512_add_epi32((__m512i)acc[r][c], _mm512_madd_epi16(_mm512_maddubs_epi16( \
                aw[c], _mm512_mask_sub_epi8(xs, neg[c], _mm512_setzero_si512(), xs)), _mm512_set1_epi16(1))); \
    }

/* rows [0, R) of xq (row stride ldq, block scales sx with row stride nb) x one panel w (nb blocks of 8 quads,
 * block sums bs): y = s * sum_b (acc_b - OFF x 128 bsum_b) dx_b + bias, the quads summed by STEP */
#define W8_TILE(NAME, TARGET, R, STEP, OFF)                                                                   \
    TARGET static void NAME(const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *w, int64_t nb,     \
                            const int16_t *bs, const float *scale, const float *bias, void *y, int64_t ldy,   \
                            int bf16, int ncols) {                                                            \
        __m512 f[R][4];                                                                                       \
        for (int r = 0; r < R; r++)                                                                           \
            for (int c = 0; c < 4; c++) f[r][c] = _mm512_setzero_ps();                                        \
        for (int64_t b = 0; b < nb; b++) {                                                                    \
            __v16si acc[R][4];                                                                                \
            for (int r = 0; r < R; r++)                                                                       \
                for (int c = 0; c < 4; c++) acc[r][c] = (__v16si){0};                                         \
            for (int64_t i = 8 * b; i < 8 * b + 8; i++) {                                                     \
                __m512i wv[4];                                                                                \
                for (int c = 0; c < 4; c++) wv[c] = _mm512_loadu_si512(w + i * W8_QUAD + 64 * c);             \
                STEP(R)                                                                                       \
            }                                                                                                 \
            for (int c = 0; c < 4; c++) {                                                                     \
                const __m512i off = OFF ? _mm512_slli_epi32(_mm512_cvtepi16_epi32(                            \
                    _mm256_loadu_si256((const __m256i *)(bs + b * KILN_PANEL + 16 * c))), 7) : _mm512_setzero_si512(); \
                for (int r = 0; r < R; r++)                                                                   \
                    f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)acc[r][c], off)),  \
                                              _mm512_set1_ps(sx[r * nb + b]), f[r][c]);                       \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < R; r++)                                                                           \
            for (int c = 0; c < 4 && 16 * c < ncols; c++) {                                                   \
                const __mmask16 mask = w8_mask(ncols - 16 * c);                                               \
                __m512 v = _mm512_mul_ps(f[r][c], _mm512_loadu_ps(scale + 16 * c));                           \
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * c));                   \
                w8_store(y, r * ldy + 16 * c, v, mask, bf16);                                                 \
            }                                                                                                 \
    }
W8_TILE(w8_vnni1, W8_TARGET, 1, W8_VNNI_STEP, 1) W8_TILE(w8_vnni2, W8_TARGET, 2, W8_VNNI_STEP, 1)
W8_TILE(w8_vnni3, W8_TARGET, 3, W8_VNNI_STEP, 1)
W8_TILE(w8_bw1, W8_QTARGET, 1, W8_BW_STEP, 0) W8_TILE(w8_bw2, W8_QTARGET, 2, W8_BW_STEP, 0)
W8_TILE(w8_bw3, W8_QTARGET, 3, W8_BW_STEP, 0)
static const kiln_w8a8_tile w8_zmm_vnni[W8_MR + 1] = {0, w8_vnni1, w8_vnni2, w8_vnni3};
#define W8_AMX_MR 16 /* rows of an AMX-INT8 tile */

/* rows [0, R), R <= W8_AMX_MR, of one panel with the sums on AMX-INT8 tiles (gemm_w8a8_amx.c) and W8_TILE's
 * epilogue; 0 (nothing written) where they may not run */
W8_QTARGET static int w8_amx_tile(int R, const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *w, int64_t nb,
                                  const int16_t *bs, const float *scale, const float *bias, void *y, int64_t ldy,
                                  int bf16, int ncols, int *cfg) {
    float f[W8_AMX_MR * KILN_PANEL] __attribute__((aligned(64)));
    if (!kiln_w8a8_amx_sums(R, xq, ldq, sx, w, nb, bs, f, cfg)) return 0;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4 && 16 * c < ncols; c++) {
            const __mmask16 mask = w8_mask(ncols - 16 * c);
            __m512 v = _mm512_mul_ps(_mm512_load_ps(f + r * KILN_PANEL + 16 * c), _mm512_loadu_ps(scale + 16 * c));
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * c));
            w8_store(y, r * ldy + 16 * c, v, mask, bf16);
        }
    return 1;
}
static const kiln_w8a8_tile w8_zmm_bw[W8_MR + 1] = {0, w8_bw1, w8_bw2, w8_bw3};

/* this library's tiles for the call: vpdpbusd on zmm where the caller allows AVX512-VNNI (the CPU's flags and
 * $KILN_CPU_ISA) and the CPU has it, else AVX512BW's (every CPU that loads this library has AVX512BW) */
static const kiln_w8a8_tile *w8_tiles(void) {
    static int vnni = -1; /* the CPU's, asked once: a caller that skipped isa.py's check gets the BW tiles */
    if (vnni < 0) vnni = __builtin_cpu_supports("avx512vnni");
    return vnni && w8_vnni ? w8_zmm_vnni : w8_zmm_bw;
}
#define W8_VNNI_RUNNING() (w8_tiles() == w8_zmm_vnni)
#define W8_QUANTIZE_ROW w8_quantize_row_vec
#define W8_HAVE 1
#define W8_AMX 1
#elif defined(__x86_64__) && defined(__AVX2__) && (defined(__clang__) || __GNUC__ >= 10)
#define W8_QUAD (4 * KILN_PANEL)
#define W8_MR KILN_W8A8_YMM_MR
static const kiln_w8a8_tile *w8_tiles(void) { return kiln_w8a8_ymm_tiles(w8_vnni); }
#define W8_VNNI_RUNNING() (w8_tiles() != kiln_w8a8_ymm_tiles(0))
#define W8_QUANTIZE_ROW w8_quantize_row
#define W8_HAVE 1
#endif

#ifndef W8_AMX_MR
#define W8_AMX_MR W8_MR /* a library without AMX-INT8 tiles */
#endif

#ifdef W8_HAVE
static __thread void *w8_buf; /* the quantized activations (kiln_scratch) */
static __thread size_t w8_cap;

int kiln_w8a8_available(void) { return 1; }
/* the tiles a call runs now sum on vpdpbusd (the caller's leave and the CPU's): what tests and the logs check */
int kiln_w8a8_vnni_running(void) { return W8_VNNI_RUNNING(); }

struct w8_call { /* what every (row chunk, panel) of one kiln_linear_w8a8 call shares */
    const kiln_w8a8_tile *tile; const uint8_t *xq; const float *sx, *scales, *bias; const int8_t *packed;
    const int16_t *bsums; char *y; int64_t m, n, mc, kq, ldq, nb, ldy, mr_max; size_t esize; int bf16;
};

/* rows [ch x mc, ...) of panel p: tiles of near-equal height, on AMX-INT8 where cfg is given (this thread's tile
 * configuration, gemm_w8a8_amx.c) and it runs, else the vector tiles */
__attribute__((always_inline)) static inline void w8_panel(const struct w8_call *c, int64_t ch, int64_t p, int *cfg) {
    const int64_t m0c = ch * c->mc, rows = (m0c + c->mc < c->m ? m0c + c->mc : c->m) - m0c;
    const int64_t tiles = (rows + c->mr_max - 1) / c->mr_max, col = p * KILN_PANEL, nb = c->nb, ldq = c->ldq;
    const int ncols = c->n - col < KILN_PANEL ? (int)(c->n - col) : KILN_PANEL;
    const int8_t *wp = c->packed + p * c->kq * W8_QUAD;
    const int16_t *bs = c->bsums + p * nb * KILN_PANEL;
    const float *sc = c->scales + col, *bt = c->bias ? c->bias + col : 0;
    for (int64_t t = 0, m0 = m0c, mr; t < tiles; t++, m0 += mr) {
        mr = rows / tiles + (t < rows % tiles);
        const uint8_t *xt = c->xq + m0 * ldq;
        const float *st = c->sx + m0 * nb;
        char *yt = c->y + (m0 * c->ldy + col) * c->esize;
        if (!cfg) { /* mr <= W8_MR: one vector tile */
            c->tile[mr](xt, ldq, st, wp, nb, bs, sc, bt, yt, c->ldy, c->bf16, ncols);
            continue;
        }
#ifdef W8_AMX
        if (w8_amx_tile((int)mr, xt, ldq, st, wp, nb, bs, sc, bt, yt, c->ldy, c->bf16, ncols, cfg)) continue;
#endif
        for (int64_t s = 0, sr; s < mr; s += sr) { /* AMX refused: the vector tiles, W8_MR rows at most */
            sr = mr - s < W8_MR ? mr - s : W8_MR;
            c->tile[sr](xt + s * ldq, ldq, st + s * nb, wp, nb, bs, sc, bt, yt + s * c->ldy * c->esize, c->ldy,
                        c->bf16, ncols);
        }
    }
}

/* y [m, n] (bf16 or float32 as x, row stride ldy) = W8A8 of x [m, k] (row stride ldx) and the int8 panels
 * (gemm_int8.c's layout) with their scales and block sums (kiln_w8a8_block_sums), + bias (float32 or NULL); amx:
 * the sums on AMX-INT8 tiles where they run (kiln_w8a8_amx_ready). Returns 0, -1 when the quantized activations
 * could not be allocated, or 1 where this library has no tile the CPU runs (none of kiln's x86-64 libraries: the
 * fallback of a library without W8A8). */
int kiln_linear_w8a8(const void *x, const int8_t *packed, const float *scales, const int16_t *bsums,
                     const float *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldy, int bf16,
                     int amx) {
    const kiln_w8a8_tile *tile = w8_tiles(); /* by rows */
    if (!tile) return 1;
#ifdef W8_AMX
    amx = amx && kiln_w8a8_amx_ready();
#else
    amx = 0;
#endif
    const int64_t kq = i8_quads(k), ldq = 4 * kq, nb = w8_blocks(kq), panels = (n + KILN_PANEL - 1) / KILN_PANEL;
    uint8_t *xq = (uint8_t *)kiln_scratch(&w8_buf, &w8_cap, (size_t)m * ldq + (size_t)m * nb * sizeof(float));
    if (!xq) return -1;
    float *sx = (float *)(xq + (size_t)m * ldq); /* ldq is a multiple of 32: aligned */
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++)
        W8_QUANTIZE_ROW((const char *)x + r * ldx * esize, k, ldq, bf16, xq + r * ldq, sx + r * nb);
    const int64_t chunks = (m + W8_MC - 1) / W8_MC, mc = (m + chunks - 1) / chunks;
    const struct w8_call c = {tile, xq, sx, scales, bias, packed, bsums, (char *)y, m, n, mc, kq, ldq, nb, ldy,
                              amx ? W8_AMX_MR : W8_MR, esize, bf16};
    if (!amx) { /* the vector tiles alone: no tile state per thread (one parallel loop, as before AMX-INT8) */
#pragma omp parallel for collapse(2) schedule(static) if (panels > 1)
        for (int64_t ch = 0; ch < chunks; ch++)
            for (int64_t p = 0; p < panels; p++) w8_panel(&c, ch, p, 0);
        return 0;
    }
#pragma omp parallel if (panels > 1)
    {
        int cfg = -1; /* the rows this thread's AMX tiles were last configured for, in this call */
#pragma omp for collapse(2) schedule(static)
        for (int64_t ch = 0; ch < chunks; ch++)
            for (int64_t p = 0; p < panels; p++) w8_panel(&c, ch, p, &cfg);
        if (cfg >= 0) kiln_w8a8_amx_release();
    }
    return 0;
}
#else
int kiln_w8a8_available(void) { return 0; }
int kiln_w8a8_vnni_running(void) { return 0; }
int kiln_linear_w8a8(const void *x, const int8_t *packed, const float *scales, const int16_t *bsums,
                     const float *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldy, int bf16,
                     int amx) {
    (void)x, (void)packed, (void)scales, (void)bsums, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx;
    (void)ldy, (void)bf16, (void)amx;
    return 1;
}
#endif

/* The quantized activations kiln_linear_w8a8 multiplies, for tests and references: x [m, k] (row stride ldx)
 * -> q [m, k] int8 (xq, without the +128) and sx [m, ceil(k / 32)] (each block's scale); the vector form where
 * the library has it. */
void kiln_w8a8_quantize(const void *x, int8_t *q, float *sx, int64_t m, int64_t k, int64_t ldx, int bf16) {
    const size_t esize = bf16 ? 2 : 4;
    const int64_t kb = (k + W8_BLOCK - 1) / W8_BLOCK * W8_BLOCK;
    uint8_t *row = malloc((size_t)kb + 64);
    if (!row) return;
    for (int64_t r = 0; r < m; r++) {
        const void *xr = (const char *)x + r * ldx * esize;
#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
        w8_quantize_row_vec(xr, k, kb, bf16, row, sx + r * (kb / W8_BLOCK));
#else
        w8_quantize_row(xr, k, kb, bf16, row, sx + r * (kb / W8_BLOCK));
#endif
        for (int64_t i = 0; i < k; i++) q[r * k + i] = (int8_t)(row[i] - 128);
    }
    free(row);
}
