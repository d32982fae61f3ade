/* ---- GGUF block weights (Q8_0, Q4_0, Q4_1) on the int8 units, activations quantized per 32-block ----
 *
 * A GGUF weight row is K/32 blocks: Q8_0 {fp16 d; int8 q[32]} (w = q d), Q4_0 {fp16 d; 16 bytes of nibbles}
 * (w = (q - 8) d), Q4_1 {fp16 d, m; 16 bytes} (w = q d + m); nibble byte i holds q[i] low and q[i + 16] high.
 * kiln_pack_gguf repacks a [N, K/32 blocks] file tensor once, at load, into groups of 16 output columns,
 * [ceil(N / 16)][K / 32][record], a record one block of 16 columns:
 *
 *   Q8_0  [8 quads][16 cols][4] uint8 (q + 128)                  + fp16 d[16]             544 bytes = 16 x 34
 *   Q4_0  [4][16 cols][4] uint8: byte j of quad t = file byte 4t+j + fp16 d[16]             288 bytes = 16 x 18
 *   Q4_1  as Q4_0                                                 + fp16 d[16] + fp16 m[16] 320 bytes = 16 x 20
 *
 * so a weight takes the file's bytes. One 64-byte load is 16 columns x 4 K (nibbles: low = quad t, high = quad
 * t + 4 of the block), what vpdpbusd multiplies, unsigned weight bytes by a signed activation quad broadcast.
 *
 * The activations are quantized per row and 32-block as llama.cpp's Q8_0 / Q8_1: dx = max|x| / 127, xq =
 * round_half_even(x * (127 / max|x|)) (float32), and the block's sum of xq. Per block and column the int32 sum
 * acc = sum_k u[k] xq[k] of the stored unsigned bytes u gives the block's dot product:
 *
 *   Q8_0 (u = q + 128), Q4_0 (u = q, w = (q - 8) d): d dx (acc - off sum xq), off 128 or 8
 *   Q4_1: d dx acc + m dx sum xq
 *
 * computed as y += d * fma(acc, dx, c2) (+ m * sx): c2 = -off dx sum xq, sx = dx sum xq, both made with the
 * quantized row. The x86-64-v3 library (and AVX-512 CPUs without VNNI) runs 16-column groups on ymm
 * (gemm_gguf_ymm.c): AVX-VNNI's vpdpbusd where the CPU has it, the same integers and epilogue as here; else
 * maddubs + madd, whose int16 pairs would overflow on Q8_0's 255 x 127, so there Q8_0 takes the sign trick
 * (|q| x sign(xq, q)) and off is 0. Register tiles of up to 4 rows x 32 columns (AVX512-VNNI) / 2 x 16 (ymm);
 * the column tiles are shared out between threads, as gemm.c does.
 *
 * The records are laid out and packed, and dequantized for the kiln-gguf-f32 mode, in gguf_pack.c
 * (gguf_layout.h: the record sizes both read). */
#include "gguf_layout.h"

/* kiln_gguf_set_vnni: $KILN_CPU_ISA / the CPU may run vpdpbusd (AVX512-VNNI in the x86-64-v4 library,
 * AVX-VNNI in the x86-64-v3 one) */
static int gg_vnni = 1;
void kiln_gguf_set_vnni(int on) { gg_vnni = on; }

/* one row of x (k floats or bf16) -> xq [k] int8, and per block dx, c2, sx (see the top) */
static void gg_quantize_row(const void *x, int64_t k, int bf16, int qt, int off, int8_t *xq, float *dx, float *c2,
                            float *sx) {
    for (int64_t b = 0; b < k / 32; b++) {
        float v[32], amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            v[j] = ld(x, 32 * b + j, bf16);
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            float r = nearbyintf(v[j] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            xq[32 * b + j] = (int8_t)r;
            sum += (int)r;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
        c2[b] = qt == GG_Q4_1 ? 0.0f : -(float)off * sx[b];
    }
}

/* the portable form of a column group: rows [0, rows) x 16 columns, accumulated into y (float32 [rows][16]) */
static void gg_group_scalar(const int8_t *xq, int64_t ldq, const float *dx, const float *c2, const float *sx,
                            const uint8_t *w, int64_t nb, int qt, int off, int rows, float *acc) {
    const int64_t rec = gg_record(qt), qb = gg_qbytes(qt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *r = w + b * rec;
        const uint16_t *d = (const uint16_t *)(r + qb), *mm = d + GG_COLS;
        for (int row = 0; row < rows; row++) {
            const int8_t *xb = xq + row * ldq + 32 * b;
            const int64_t i = row * (ldq / 32) + b;
            for (int c = 0; c < GG_COLS; c++) {
                int32_t s = 0;
                for (int j = 0; j < 32; j++) {
                    int u;
                    if (qt == GG_Q8_0) u = r[(j / 4) * 64 + 4 * c + j % 4] - (off ? 0 : 128);
                    else u = j < 16 ? r[(j / 4) * 64 + 4 * c + j % 4] & 15 : r[((j - 16) / 4) * 64 + 4 * c + j % 4] >> 4;
                    s += u * xb[j];
                }
                float t = (float)s * dx[i] + (qt == GG_Q8_0 && !off ? 0.0f : c2[i]);
                acc[row * GG_COLS + c] += gg_h2f(d[c]) * t + (qt == GG_Q4_1 ? gg_h2f(mm[c]) * sx[i] : 0.0f);
            }
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#define GG_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
#if defined(__clang__)
#define GG_DPBUSD(acc, u, s) ((acc) = (__v16si)_mm512_dpbusd_epi32((__m512i)(acc), (u), (s)))
#else
#define GG_DPBUSD(acc, u, s) ((acc) = __builtin_ia32_vpdpbusd_v16si((acc), (__v16si)(u), (__v16si)(s)))
#endif

/* VNNI: rows [0, R) x C groups (C = 1 or 2: 16 or 32 columns); w: the first group's records, gstride to the next */
__attribute__((always_inline)) GG_VNNI static inline void gg_tile_vnni(
    const int8_t *xq, int64_t ldq, const float *dx, const float *c2, const float *sx, const uint8_t *w,
    int64_t gstride, int64_t nb, const int qt, const int R, const int C, float *out, int64_t ldo) {
    const int64_t rec = gg_record(qt), qb = gg_qbytes(qt), bpr = ldq / 32;
    __m512 y[4][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r][c] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        __v16si acc[4][2];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = (__v16si){0};
        if (qt == GG_Q8_0) {
            for (int t = 0; t < 8; t++) {
                __m512i v[2];
                for (int c = 0; c < C; c++) v[c] = _mm512_loadu_si512(w + c * gstride + b * rec + 64 * t);
                for (int r = 0; r < R; r++) {
                    int32_t quad;
                    memcpy(&quad, xq + r * ldq + 32 * b + 4 * t, 4);
                    const __m512i xb = _mm512_set1_epi32(quad);
                    for (int c = 0; c < C; c++) GG_DPBUSD(acc[r][c], v[c], xb);
                }
            }
        } else {
            for (int t = 0; t < 4; t++) {
                __m512i lo[2], hi[2];
                for (int c = 0; c < C; c++) {
                    const __m512i v = _mm512_loadu_si512(w + c * gstride + b * rec + 64 * t);
                    lo[c] = _mm512_and_si512(v, lo4);
                    hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                }
                for (int r = 0; r < R; r++) {
                    int32_t ql, qh;
                    memcpy(&ql, xq + r * ldq + 32 * b + 4 * t, 4);
                    memcpy(&qh, xq + r * ldq + 32 * b + 16 + 4 * t, 4);
                    const __m512i xl = _mm512_set1_epi32(ql), xh = _mm512_set1_epi32(qh);
                    for (int c = 0; c < C; c++) {
                        GG_DPBUSD(acc[r][c], lo[c], xl);
                        GG_DPBUSD(acc[r][c], hi[c], xh);
                    }
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *rp = w + c * gstride + b * rec;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rp + qb)));
            const __m512 m = qt == GG_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rp + qb + 32)))
                                           : _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                const int64_t i = r * bpr + b;
                const __m512 tv = _mm512_fmadd_ps(_mm512_cvtepi32_ps((__m512i)acc[r][c]), _mm512_set1_ps(dx[i]),
                                                  _mm512_set1_ps(c2[i]));
                y[r][c] = _mm512_fmadd_ps(d, tv, y[r][c]);
                if (qt == GG_Q4_1) y[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), y[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + r * ldo + 16 * c, y[r][c]);
}

#define GG_VT(QT, R, C)                                                                                        \
    GG_VNNI static void gg_v_##QT##_##R##_##C(const int8_t *xq, int64_t ldq, const float *dx, const float *c2, \
                                              const float *sx, const uint8_t *w, int64_t gs, int64_t nb,       \
                                              float *out, int64_t ldo) {                                       \
        gg_tile_vnni(xq, ldq, dx, c2, sx, w, gs, nb, QT, R, C, out, ldo);                                      \
    }
#define GG_VT_ROWS(QT, C) GG_VT(QT, 1, C) GG_VT(QT, 2, C) GG_VT(QT, 3, C) GG_VT(QT, 4, C)
GG_VT_ROWS(2, 1) GG_VT_ROWS(2, 2) GG_VT_ROWS(3, 1) GG_VT_ROWS(3, 2) GG_VT_ROWS(8, 1) GG_VT_ROWS(8, 2)
typedef void (*gg_vfn)(const int8_t *, int64_t, const float *, const float *, const float *, const uint8_t *,
                       int64_t, int64_t, float *, int64_t);
#define GG_VROW(QT, C) {0, gg_v_##QT##_1_##C, gg_v_##QT##_2_##C, gg_v_##QT##_3_##C, gg_v_##QT##_4_##C}
static const gg_vfn gg_vtiles[3][2][5] = {{GG_VROW(2, 1), GG_VROW(2, 2)}, {GG_VROW(3, 1), GG_VROW(3, 2)},
                                          {GG_VROW(8, 1), GG_VROW(8, 2)}};
#define GG_HAVE_VNNI 1
#endif
#endif
#ifndef GG_HAVE_VNNI
#define GG_HAVE_VNNI 0
#endif

/* the AVX512-VNNI tiles run: the caller's leave and the CPU's (asked once) */
static int gg_zmm_vnni(void) {
#if GG_HAVE_VNNI
    static int cpu_vnni = -1;
    if (cpu_vnni < 0) cpu_vnni = __builtin_cpu_supports("avx512vnni");
    return gg_vnni && cpu_vnni;
#else
    return 0;
#endif
}

/* a call sums on vpdpbusd now, on zmm or ymm (what tests and the logs check) */
int kiln_gguf_vnni_running(void) { return gg_zmm_vnni() || kiln_gguf_ymm_off(!GG_HAVE_VNNI && gg_vnni) == 128; }

#define GG_MC 64 /* rows per chunk of a thread's work */
#define GG_MR 4

/* y [m, n] (float32 or bf16 as x) = x [m, k] W^T + bias for a packed GGUF weight of type qt; dequant: the
 * kiln-gguf-f32 mode (float32 x only). Returns 0, -1 when scratch memory could not be allocated. */
int kiln_linear_gguf(const void *x, const uint8_t *w, int qt, const float *bias, void *y, int64_t m, int64_t n,
                     int64_t k, int64_t ldx, int64_t ldy, int bf16, int dequant) {
    if (dequant && !bf16) return kiln_gguf_linear_f32(x, w, qt, bias, y, m, n, k, ldx, ldy);
    const int64_t nb = k / 32, groups = (n + GG_COLS - 1) / GG_COLS, rec = gg_record(qt);
    const int vnni = gg_zmm_vnni();
    /* else 16-column groups on ymm: AVX-VNNI where the x86-64-v3 library may run it, else AVX2 (or none) */
    const int yv = !GG_HAVE_VNNI && gg_vnni; /* gg_vnni says AVX-VNNI in the x86-64-v3 library */
    const kiln_gguf_group *ymm = vnni ? 0 : kiln_gguf_ymm_group(yv); /* by rows: 1, 2 */
    const int off = qt == GG_Q4_0 ? 8 : (qt == GG_Q8_0 && (vnni || (ymm && kiln_gguf_ymm_off(yv))) ? 128 : 0);
    /* per row: xq [k] + dx, c2, sx [nb] each */
    const size_t row_bytes = (size_t)k + 3 * (size_t)nb * sizeof(float);
    uint8_t *buf = malloc((size_t)m * row_bytes + 64);
    if (!buf) return -1;
    int8_t *xq = (int8_t *)buf;
    float *dx = (float *)(buf + (size_t)m * k), *c2 = dx + m * nb, *sx = c2 + m * nb;
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++)
        gg_quantize_row((const char *)x + r * ldx * esize, k, bf16, qt, off, xq + r * k, dx + r * nb, c2 + r * nb,
                        sx + r * nb);
    const int64_t span = vnni ? 2 : 1, tiles = (groups + span - 1) / span, chunks = (m + GG_MC - 1) / GG_MC;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static) if (tiles > 1)
    for (int64_t ch = 0; ch < chunks; ch++)
        for (int64_t t = 0; t < tiles; t++) {
            float out[GG_MR * 2 * GG_COLS];
            const int64_t g = t * span, cg = groups - g < span ? groups - g : span, col = g * GG_COLS;
            const int64_t m0c = ch * GG_MC, m1c = m0c + GG_MC < m ? m0c + GG_MC : m;
            for (int64_t m0 = m0c; m0 < m1c; m0 += GG_MR) {
                const int rows = m1c - m0 < GG_MR ? (int)(m1c - m0) : GG_MR;
                const int8_t *xr = xq + m0 * k;
                const float *dr = dx + m0 * nb, *cr = c2 + m0 * nb, *sr = sx + m0 * nb;
                const uint8_t *wg = w + g * nb * rec;
                int ldo = GG_COLS;
#if GG_HAVE_VNNI
                if (vnni) {
                    ldo = (int)(2 * GG_COLS);
                    gg_vtiles[qt == GG_Q4_0 ? 0 : qt == GG_Q4_1 ? 1 : 2][cg - 1][rows](xr, k, dr, cr, sr, wg, nb * rec,
                                                                                       nb, out, ldo);
                } else
#endif
                {
                    if (ymm) {
                        for (int r0 = 0; r0 < rows; r0 += 2)
                            ymm[rows - r0 < 2 ? rows - r0 : 2](xr + r0 * k, k, dr + r0 * nb, cr + r0 * nb,
                                                               sr + r0 * nb, wg, nb, qt, out + r0 * GG_COLS);
                    } else {
                        memset(out, 0, sizeof out);
                        gg_group_scalar(xr, k, dr, cr, sr, wg, nb, qt, off, rows, out);
                    }
                }
                const int ncols = n - col < cg * GG_COLS ? (int)(n - col) : (int)(cg * GG_COLS);
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < ncols; c++) st(y, (m0 + r) * ldy + col + c,
                                                         out[r * ldo + c] + (bias ? bias[col + c] : 0.0f), bf16);
            }
        }
    free(buf);
    return failed;
}
