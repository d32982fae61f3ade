/* ---- bfloat16 linear on AMX tiles: y = bf16(x W^T + b), fp32 accumulation ----
 *
 * Intel AMX (Sapphire Rapids and later) multiplies 16 x 32 bf16 tiles in one instruction (tdpbf16ps),
 * about 10x what vdpbf16ps does per cycle. The weights are the vdpbf16ps kernel's panels unchanged,
 * [ceil(N / 64)][bf16_panel_pairs(K)][64][2]: 16 K-pairs x 16 columns of a panel are one B tile (rows
 * 256 bytes apart),
 * so a weight packed once serves both kernels and the tactic table picks per row count (gemm_dispatch.c).
 *
 * Tiles: C accumulators tmm0-3, A (rows of x) tmm4-5, B (weights) tmm6-7. Up to 16 rows, a panel is
 * 1 x 4 C tiles (each weight loaded once); from 17 rows, 32-row blocks of 2 x 2 C tiles over each half
 * panel (every A and B tile feeds two multiplies). C stays in the tiles for the whole K, then goes through
 * a float scratch to bf16 (+ bias) with the vdpbf16ps kernel's rounding (cvtneps: nearest even). A
 * partial row block configures its tiles with fewer rows: nothing past x's last row is read.
 * Measured against oneDNN's prepacked bf16 linear (one thread, Xeon with AMX, 2048 x 768 and 768 x 2048):
 * 1.3x at 8 rows, 1.4x at 16, 1.15x at 32, equal at 64, 0.8-0.9x from 128 rows.
 *
 * A K that is not a multiple of 32 takes one more tile step: x's last columns copied beside zeros, against
 * the panel's last 16 pairs (bf16_panel_pairs pads every panel to whole tiles with zero pairs).
 *
 * Linux hands out the tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM); kiln asks
 * once (kiln_amx_ready), and kiln_linear_amx returns 0 without touching a tile when the answer was no, so
 * the caller runs its FMA kernel instead. */
#include "kiln_cpu.h"

#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 11)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX_PAIR (2 * KILN_PANEL) /* elements of one K pair of a panel */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#ifndef AMX_MC
#define AMX_MC 256 /* rows per pass over the weights: their x rows stay in L2 across panels */
#endif

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

int kiln_amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* rows r0 for C tiles 0-1 and A tile 4; r1 for C tiles 2-3 and A tile 5 (r1 = 0: the 1 x 4 layout, where
 * C tiles 2-3 hold r0 rows and tile 5 is unused); B tiles 6-7: 16 K pairs x 64 bytes */
AMX_TARGET static void amx_configure(int r0, int r1) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {r0, r0, r1 ? r1 : r0, r1 ? r1 : r0, r0, r1, 16, 16};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    __asm__ volatile("" ::: "memory"); /* ldtilecfg's operand names 8 of the 64 bytes: keep all stores */
    _tile_loadconfig(&c);
}

/* y[r, 0:ncols] = bf16(acc[r, 0:ncols] (* scale: int8 weights) + bias) for r < rows */
AMX_TARGET static void amx_store(const float *acc, int64_t ld_acc, int rows, uint16_t *y, int64_t ldy,
                                 const float *scale, const float *bias, int ncols) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < ncols; c += 16) {
            const int left = ncols - c;
            const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __m512 v = _mm512_maskz_loadu_ps(mask, acc + r * ld_acc + c);
            if (scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scale + c));
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c));
            _mm256_mask_storeu_epi16(y + r * ldy + c, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* Where the A tiles come from: x itself for the K pairs [0, kt) (a multiple of 16), and for a K that is
 * not a multiple of 32 one more step from `tail`, x's last columns copied beside zeros (32 per row). */
struct amx_rows {
    const uint16_t *x, *tail;
    int64_t ldx, kt;
};

/* up to 16 rows x one panel (64 columns); acc [16][64] */
AMX_TARGET static void amx_1x4(const struct amx_rows *a, const uint16_t *w, float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < a->kt + (a->tail ? 16 : 0); i += 16) {
        const uint16_t *wi = w + i * AMX_PAIR;
        if (i < a->kt) _tile_loadd(4, a->x + 2 * i, a->ldx * 2);
        else _tile_loadd(4, a->tail, 64);
        _tile_loadd(6, wi, AMX_PAIR * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, wi + 32, AMX_PAIR * 2);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, wi + 64, AMX_PAIR * 2);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, wi + 96, AMX_PAIR * 2);
        _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, acc, 64 * 4);
    _tile_stored(1, acc + 16, 64 * 4);
    _tile_stored(2, acc + 32, 64 * 4);
    _tile_stored(3, acc + 48, 64 * 4);
}

/* 17-32 rows x 32 columns (w: the half panel's first column); acc [32][64] */
AMX_TARGET static void amx_2x2(const struct amx_rows *a, const uint16_t *w, float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < a->kt + (a->tail ? 16 : 0); i += 16) {
        const uint16_t *wi = w + i * AMX_PAIR;
        const int from_x = i < a->kt;
        if (from_x) _tile_loadd(4, a->x + 2 * i, a->ldx * 2);
        else _tile_loadd(4, a->tail, 64);
        _tile_loadd(6, wi, AMX_PAIR * 2);
        _tile_loadd(7, wi + 32, AMX_PAIR * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (from_x) _tile_loadd(5, a->x + 16 * a->ldx + 2 * i, a->ldx * 2);
        else _tile_loadd(5, a->tail + 16 * 32, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc, 64 * 4);
    _tile_stored(1, acc + 16, 64 * 4);
    _tile_stored(2, acc + 16 * 64, 64 * 4);
    _tile_stored(3, acc + 16 * 64 + 16, 64 * 4);
}

/* rows [r0, r1) of one panel (wp: its first K pair); k: x's columns, kt: the pairs tiles take from x */
AMX_TARGET static void amx_panel(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t k, int64_t kt,
                                 uint16_t *y, int64_t ldy, const float *scale, const float *bias, int ncols,
                                 int64_t r0, int64_t r1, int *cfg, float *acc, uint16_t *tail) {
    while (r0 < r1) {
        const int64_t left = r1 - r0;
        const int rows = left <= 16 ? (int)left : left >= 32 ? 32 : (int)left;
        const struct amx_rows a = {x + r0 * ldx, 2 * kt < k ? tail : 0, ldx, kt};
        if (a.tail) { /* x's columns past the tiles, beside zeros: the panel's pairs past K are zero too */
            memset(tail, 0, 32 * 32 * sizeof *tail);
            for (int r = 0; r < rows; r++) memcpy(tail + 32 * r, a.x + r * ldx + 2 * kt, (size_t)(k - 2 * kt) * 2);
        }
        if (left <= 16) {
            if (cfg[0] != rows || cfg[1] != 0) amx_configure(cfg[0] = rows, cfg[1] = 0);
            amx_1x4(&a, wp, acc);
            amx_store(acc, 64, rows, y + r0 * ldy, ldy, scale, bias, ncols);
        } else {
            if (cfg[0] != 16 || cfg[1] != rows - 16) amx_configure(cfg[0] = 16, cfg[1] = rows - 16);
            for (int h = 0; h < 2 && 32 * h < ncols; h++) {
                amx_2x2(&a, wp + 64 * h, acc);
                const int nc = ncols - 32 * h < 32 ? ncols - 32 * h : 32;
                amx_store(acc, 64, rows, y + r0 * ldy + 32 * h, ldy, scale ? scale + 32 * h : 0,
                          bias ? bias + 32 * h : 0, nc);
            }
        }
        r0 += rows;
    }
}

/* y [m, n] bf16 (row stride ldy) = x [m, k] bf16 (row stride ldx) W^T + bias (float32, may be NULL), W packed
 * by kiln_pack_linear_bf16. Returns 1, or 0 (nothing done) when the process has no AMX tile state. */
AMX_TARGET int kiln_linear_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m,
                               int64_t n, int64_t k, int64_t ldx, int64_t ldy) {
    if (!kiln_amx_ready()) return 0;
    const int64_t kpp = bf16_panel_pairs(k), kt = k / 32 * 16, panels = (n + KILN_PANEL - 1) / KILN_PANEL;
    for (int64_t mc0 = 0; mc0 < m; mc0 += AMX_MC) {
        const int64_t mc1 = mc0 + AMX_MC < m ? mc0 + AMX_MC : m;
#pragma omp parallel if (panels > 1)
        {
            int cfg[2] = {-1, -1}; /* the rows amx_configure last set on this thread, in this call */
            float acc[32 * 64] __attribute__((aligned(64)));
            uint16_t tail[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int ncols = n - p * KILN_PANEL < KILN_PANEL ? (int)(n - p * KILN_PANEL) : KILN_PANEL;
                amx_panel(x, ldx, packed + p * kpp * AMX_PAIR, k, kt, y + p * KILN_PANEL, ldy, 0,
                          bias ? bias + p * KILN_PANEL : 0, ncols, mc0, mc1, cfg, acc, tail);
            }
            if (cfg[0] >= 0) _tile_release();
        }
    }
    return 1;
}
/* rows [0, m) of one bf16 panel, for the int8 kernels (gemm_int8.c): the calling thread's tiles are configured
 * as cfg says (-1: not yet) and stay so across calls; kiln_amx_release ends them. Returns 0 without AMX. */
KILN_HIDDEN AMX_TARGET int kiln_panel_amx(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t k, uint16_t *y,
                                          int64_t ldy, const float *scale, const float *bias, int ncols, int64_t m,
                                          int *cfg) {
    if (!kiln_amx_ready()) return 0;
    float acc[32 * 64] __attribute__((aligned(64)));
    uint16_t tail[32 * 32] __attribute__((aligned(64)));
    amx_panel(x, ldx, wp, k, k / 32 * 16, y, ldy, scale, bias, ncols, 0, m, cfg, acc, tail);
    return 1;
}

KILN_HIDDEN AMX_TARGET void kiln_amx_release(void) { _tile_release(); }
#else
int kiln_amx_ready(void) { return 0; }
KILN_HIDDEN int kiln_panel_amx(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t k, uint16_t *y, int64_t ldy,
                               const float *scale, const float *bias, int ncols, int64_t m, int *cfg) {
    (void)x, (void)ldx, (void)wp, (void)k, (void)y, (void)ldy, (void)scale, (void)bias, (void)ncols, (void)m, (void)cfg;
    return 0;
}
KILN_HIDDEN void kiln_amx_release(void) {}
int kiln_linear_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                    int64_t k, int64_t ldx, int64_t ldy) {
    (void)x, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy;
    return 0;
}
#endif
