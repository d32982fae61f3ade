/* ---- int8 weights (weight-only quantization): y = (x q^T) * scale + bias ----
 *
 * The weights stay int8 in memory (half of bf16's bytes, a quarter of float32's: a decode step streams that
 * much less), packed in panels with K in groups of 4, [ceil(N / 64)][i8_quads(K)][64][4] int8 (the layout
 * W8A8's vpdpbusd reads, gemm_w8a8.c: one copy serves both), with one float32 scale per output column
 * (zero-padded to whole panels) and W8A8's block sums. A call widens each panel into a per-thread copy in the activations' own
 * layout (bf16 pairs, exact: |q| <= 127 is a bf16 integer; or float32 [K][64]
 * in blocks of I8_KC rows of K) and runs that layout's kernel on it -- AMX tiles, vdpbf16ps or float32 FMA
 * tiles -- with the scale applied to the float32 sums, once (float32: once per K block, which is the same
 * sum since the scale is linear). That is exactly the weight-only semantics of torch's int8 kernels
 * (dequantize-then-multiply in real arithmetic), without ever holding a dequantized weight: replacing
 * torch._weight_int8pack_mm (int8 x bf16), which on an AMX Xeon takes 300 us at 8 rows and 2 ms at 32 for
 * a 2048 x 768 weight against kiln's bf16 AMX GEMM's 120 and 160 us.
 *
 * The per-thread copy is kept across calls (it grows to the largest panel seen: K x 256 bytes for bf16,
 * I8_KC x 256 for float32), so a decode step allocates nothing. */
#include "kiln_cpu.h"

#define I8_KC 1024 /* float32 activations: K rows of a panel widened at a time (256 KiB) */

static __thread void *i8_buf;
static __thread size_t i8_cap;

/* the block column sums W8A8 subtracts: packed int8 panels (kq quads) -> bsums [panels][kq / 8][KILN_PANEL] */
void kiln_w8a8_block_sums(const int8_t *packed, int16_t *bsums, int64_t n, int64_t k) {
    const int64_t kq = i8_quads(k), nb = w8_blocks(kq), panels = (n + KILN_PANEL - 1) / KILN_PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t j = 0; j < KILN_PANEL; j++) {
                int32_t sum = 0;
                for (int64_t i = 8 * b; i < 8 * b + 8; i++)
                    for (int e = 0; e < 4; e++) sum += packed[(p * kq + i) * 4 * KILN_PANEL + 4 * j + e];
                bsums[(p * nb + b) * KILN_PANEL + j] = (int16_t)sum;
            }
}

/* w [N, K] int8 (row stride ldw) -> packed [ceil(N / KILN_PANEL)][i8_quads(K)][KILN_PANEL][4] (K in groups of 4
 * per column: what vpdpbusd multiplies, gemm_w8a8.c; zero past N and K), and bsums = each column's sum of its
 * int8 values per 32-block of K (W8A8's epilogue: kiln_w8a8_block_sums), zero past N */
void kiln_pack_linear_i8(const int8_t *w, int8_t *packed, int16_t *bsums, int64_t n, int64_t k, int64_t ldw) {
    const int64_t panels = (n + KILN_PANEL - 1) / KILN_PANEL, kq = i8_quads(k);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < kq; i++)
            for (int64_t j = 0; j < KILN_PANEL; j++)
                for (int64_t e = 0; e < 4; e++) {
                    const int64_t col = p * KILN_PANEL + j, kk = 4 * i + e;
                    packed[(p * kq + i) * 4 * KILN_PANEL + 4 * j + e] = col < n && kk < k ? w[col * ldw + kk] : 0;
                }
    kiln_w8a8_block_sums(packed, bsums, n, k);
}

/* A quad panel (kq K quads) widened to the bf16 pair panel the FMA and AMX kernels read, [2 kq][KILN_PANEL][2]:
 * quad i of column j holds K 4i..4i+3, pair 2i its first two, pair 2i + 1 the other two. Exact: an int8 is a
 * bf16 integer (its float32 mantissa fits the top 7 bits). */
#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static inline __m512i widen32(__m256i b) { /* 32 int8 -> 32 bf16 */
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void widen_bf16(const int8_t *src, uint16_t *dst, int64_t kq) {
    for (int64_t i = 0; i < kq; i++)
        for (int c = 0; c < KILN_PANEL / 16; c++) { /* 16 columns x 4 K = one zmm of int8 */
            const __m512i v = _mm512_loadu_si512(src + i * 4 * KILN_PANEL + 64 * c);
            const __m256i first = _mm512_cvtepi32_epi16(v), second = _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16));
            _mm512_storeu_si512(dst + (2 * i) * 2 * KILN_PANEL + 32 * c, widen32(first));
            _mm512_storeu_si512(dst + (2 * i + 1) * 2 * KILN_PANEL + 32 * c, widen32(second));
        }
}
#else
static void widen_bf16(const int8_t *src, uint16_t *dst, int64_t kq) {
    for (int64_t i = 0; i < kq; i++)
        for (int64_t j = 0; j < KILN_PANEL; j++)
            for (int e = 0; e < 4; e++) {
                const float f = (float)src[(i * KILN_PANEL + j) * 4 + e];
                uint32_t u;
                memcpy(&u, &f, sizeof u);
                dst[(2 * i + e / 2) * 2 * KILN_PANEL + 2 * j + e % 2] = (uint16_t)(u >> 16);
            }
}
#endif

/* K rows [k0, k0 + kn) of a quad-packed int8 panel as a float32 panel [kn][KILN_PANEL] */
static void widen_f32(const int8_t *panel, int64_t k0, int64_t kn, float *dst) {
    for (int64_t kk = 0; kk < kn; kk++) {
        const int8_t *src = panel + ((k0 + kk) / 4) * 4 * KILN_PANEL + (k0 + kk) % 4;
#pragma omp simd
        for (int64_t j = 0; j < KILN_PANEL; j++) dst[kk * KILN_PANEL + j] = (float)src[4 * j];
    }
}

/* y [m, n] (bf16 or float32 as x, row stride ldy) = (x [m, k] q^T) * scales + bias; amx: the bf16 sums on AMX
 * tiles where the process has them. Returns 0, or -1 when a thread could not allocate its widened panel. */
int kiln_linear_i8(const void *x, const int8_t *packed, const float *scales, const float *bias, void *y, int64_t m,
                   int64_t n, int64_t k, int64_t ldx, int64_t ldy, int bf16, int amx) {
    const int64_t kpp = bf16_panel_pairs(k), panels = (n + KILN_PANEL - 1) / KILN_PANEL;
    const size_t need = bf16 ? (size_t)kpp * 2 * KILN_PANEL * 2 : (size_t)I8_KC * KILN_PANEL * 4;
    int failed = 0;
#pragma omp parallel if (panels > 1)
    {
        void *buf = kiln_scratch(&i8_buf, &i8_cap, need);
        int cfg[2] = {-1, -1}; /* the AMX tile rows this thread configured (kiln_panel_amx) */
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!buf) continue;
            const int8_t *wp = packed + p * kpp * 2 * KILN_PANEL;
            const int ncols = n - p * KILN_PANEL < KILN_PANEL ? (int)(n - p * KILN_PANEL) : KILN_PANEL;
            const float *s = scales + p * KILN_PANEL, *b = bias ? bias + p * KILN_PANEL : 0;
            if (bf16) {
                uint16_t *yp = (uint16_t *)y + p * KILN_PANEL;
                widen_bf16(wp, buf, kpp / 2);
                if (!(amx && kiln_panel_amx(x, ldx, buf, k, yp, ldy, s, b, ncols, m, cfg)))
                    kiln_panel_bf16(x, ldx, buf, k, yp, ldy, s, b, ncols, m);
            } else {
                for (int64_t k0 = 0; k0 < k; k0 += I8_KC) {
                    const int64_t kn = k - k0 < I8_KC ? k - k0 : I8_KC;
                    widen_f32(wp, k0, kn, buf);
                    kiln_panel_f32(x, ldx, buf, k0, kn, (float *)y + p * KILN_PANEL, ldy, s, b, ncols, m);
                }
            }
        }
        if (cfg[0] >= 0) kiln_amx_release();
    }
    return failed ? -1 : 0;
}
