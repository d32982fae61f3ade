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
#include "kiln_cpu.h"

int kiln_abi_version(void) { return KILN_ABI_VERSION; }

#define LIN_PANEL KILN_PANEL
#if defined(__AVX512F__)
typedef float vlin __attribute__((vector_size(64), aligned(4))); /* 6 rows x 4 zmm = 24 accumulators of 32 registers */
#define LIN_VEC 16
#else
typedef float vlin __attribute__((vector_size(32), aligned(4))); /* AVX2 / NEON: 6 rows x 2 vectors of 8 = 12 of 16 ymm */
#define LIN_VEC 8
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

/* tile[r][0:ncols] of rows r < mr: ys[r * ldy + j] = (prev ? prev[r * ldp + j] : 0) + acc (* scale[j]: int8) */
#define LIN_TILE(MR)                                                                                          \
    static void lin_tile##MR(const float *x, int64_t ldx, const float *w, int64_t kn, float *y, int64_t ldy,  \
                             const float *prev, int64_t ldp, int ncols, const float *pf, int64_t pf_rows,     \
                             const float *scale) {                                                            \
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
        if (scale)                                                                                            \
            for (int r = 0; r < MR; r++)                                                                      \
                for (int c = 0; c < LIN_NV; c++) acc[r][c] *= *(const vlin *)(scale + c * LIN_VEC);           \
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
                            const float *, int64_t, const float *);
static const lin_tile_fn lin_tiles[LIN_MR + 1] = {0, lin_tile1, lin_tile2, lin_tile3, lin_tile4, lin_tile5, lin_tile6};

int64_t kiln_linear_panel(void) { return LIN_PANEL; }

/* w [N, K] (row stride ldw) -> packed [ceil(N / LIN_PANEL)][K][LIN_PANEL], columns past N zero. A panel goes
 * in blocks of 16 of K: the block's rows of W (a cache line each) and of the panel (16 x LIN_PANEL floats) stay in
 * L1 while it is transposed (column by column over all of K, as before, was 1.1-2x slower on Zen 4). */
void kiln_pack_linear_f32(const float *w, float *packed, int64_t n, int64_t k, int64_t ldw) {
    const int64_t panels = (n + LIN_PANEL - 1) / LIN_PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t cols = n - p * LIN_PANEL < LIN_PANEL ? n - p * LIN_PANEL : LIN_PANEL;
        for (int64_t i0 = 0; i0 < k; i0 += 16) {
            const int64_t ib = k - i0 < 16 ? k - i0 : 16;
            float *dst = packed + (p * k + i0) * LIN_PANEL;
            for (int64_t j = 0; j < cols; j++) {
                const float *src = w + (p * LIN_PANEL + j) * ldw + i0;
                for (int64_t i = 0; i < ib; i++) dst[i * LIN_PANEL + j] = src[i];
            }
            for (int64_t j = cols; j < LIN_PANEL; j++) /* the last panel's columns past N */
                for (int64_t i = 0; i < ib; i++) dst[i * LIN_PANEL + j] = 0.0f;
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
                  lin_cols(a->n, col), pf_rows ? next + (k0 + pf_lo) * LIN_PANEL : 0, pf_rows, 0);
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
 * [ceil(N / 64)][bf16_panel_pairs(K)][64][2] (zero-padded), so one vdpbf16ps multiplies a broadcast pair of x by
 * the pairs of 16 columns and adds both products into float32 lanes. Each output is rounded to bf16
 * once, at the end (round to nearest even, as torch). Where oneDNN runs the same instruction (AVX512-BF16
 * without AMX) its results match these bit for bit at K <= 1024; on AMX it runs tiles and sums in another
 * order. Measured against oneDNN's prepacked bf16 linear (one thread, AVX-512 BF16 EPYC, the llama-bench layer
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
                                       const uint16_t *pf, int64_t pf_rows, const float *scale) {            \
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
                if (scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scale + 16 * c));                \
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * c));                  \
                _mm256_mask_storeu_epi16(y + r * ldy + 16 * c, mask, (__m256i)_mm512_cvtneps_pbh(v));        \
            }                                                                                                \
    }
BF_TILE(1) BF_TILE(2) BF_TILE(3) BF_TILE(4) BF_TILE(5) BF_TILE(6)
typedef void (*bf_tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *, int64_t, const float *, int,
                           const uint16_t *, int64_t, const float *);
static const bf_tile_fn bf_tiles[LIN_MR + 1] = {0, bf_tile1, bf_tile2, bf_tile3, bf_tile4, bf_tile5, bf_tile6};

int kiln_linear_bf16_available(void) { return 1; }
int64_t kiln_bf16_panel_pairs(int64_t k) { return bf16_panel_pairs(k); }

/* rows [0, m) of one bf16 panel wp (bf16_panel_pairs(k) pairs): y = bf16(acc * scale + bias), in FMA tiles */
KILN_HIDDEN void kiln_panel_bf16(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t k, uint16_t *y, int64_t ldy,
                                 const float *scale, const float *bias, int ncols, int64_t m) {
    const int64_t tiles = (m + LIN_MR - 1) / LIN_MR;
    for (int64_t t = 0, m0 = 0, mr; t < tiles; t++, m0 += mr) {
        mr = m / tiles + (t < m % tiles);
        bf_tiles[mr](x + m0 * ldx, ldx, wp, k, y + m0 * ldy, ldy, bias, ncols, 0, 0, scale);
    }
}

/* w [N, K] bf16 (row stride ldw) -> packed [ceil(N / 64)][bf16_panel_pairs(K)][64][2] */
void kiln_pack_linear_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int64_t ldw) {
    const int64_t panels = (n + LIN_PANEL - 1) / LIN_PANEL, kpp = bf16_panel_pairs(k);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < kpp; i++)
            for (int64_t j = 0; j < LIN_PANEL; j++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t col = p * LIN_PANEL + j, kk = 2 * i + e;
                    packed[(p * kpp + i) * BF_PAIR + 2 * j + e] = col < n && kk < k ? w[col * ldw + kk] : 0;
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
    const int64_t kpp = bf16_panel_pairs(a->k);
    const uint16_t *wp = a->packed + u * BF_PAIR * kpp, *next = wp + BF_PAIR * kpp;
    (void)k0, (void)kn;
    bf_tiles[mr](a->x + m0 * a->ldx, a->ldx, wp, a->k, a->y + m0 * a->ldy + col, a->ldy, a->bias ? a->bias + col : 0,
                 lin_cols(a->n, col), pf_rows ? next + pf_lo * BF_PAIR : 0, pf_rows, 0);
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
int64_t kiln_bf16_panel_pairs(int64_t k) { return bf16_panel_pairs(k); }
KILN_HIDDEN void kiln_panel_bf16(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t k, uint16_t *y, int64_t ldy,
                                 const float *scale, const float *bias, int ncols, int64_t m) {
    (void)x, (void)ldx, (void)wp, (void)k, (void)y, (void)ldy, (void)scale, (void)bias, (void)ncols, (void)m;
}
void kiln_pack_linear_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int64_t ldw) {
    (void)w, (void)packed, (void)n, (void)k, (void)ldw;
}
void kiln_linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                      int64_t k, int64_t ldx, int64_t ldy) {
    (void)x, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy;
}
#endif


/* rows [0, m) of one float32 panel wp ([kn][LIN_PANEL], K rows [k0, k0 + kn)): y = prev + acc * scale, prev the bias
 * for the first K block and y itself after it (the scale is linear, so each block's sums take it alone) */
KILN_HIDDEN void kiln_panel_f32(const float *x, int64_t ldx, const float *wp, int64_t k0, int64_t kn, float *y,
                                int64_t ldy, const float *scale, const float *bias, int ncols, int64_t m) {
    const int64_t tiles = (m + LIN_MR - 1) / LIN_MR;
    for (int64_t t = 0, m0 = 0, mr; t < tiles; t++, m0 += mr) {
        mr = m / tiles + (t < m % tiles);
        float *out = y + m0 * ldy;
        lin_tiles[mr](x + m0 * ldx + k0, ldx, wp, kn, out, ldy, k0 ? out : bias, k0 ? ldy : 0, ncols, 0, 0, scale);
    }
}
