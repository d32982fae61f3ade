/* ---- W8A8's register tiles on 256-bit vectors: AVX-VNNI and AVX2, for the x86-64-v3 library ----
 *
 * gemm_w8a8.c quantizes the activations, shares out the panels and calls one of these per tile of up to
 * KILN_W8A8_YMM_MR rows; here one
 * 16-column panel (KILN_PANEL in this library) is two ymm of 8 columns x 4 K per K quad. Both tiles sum the
 * same integers exactly and run the float epilogue in gemm_w8a8.c's AVX-512 tiles' order, per column:
 *   f += float(acc_b) * dx_b for each 32-block b, then y = f * s (+ bias).
 * AVX-VNNI: acc_b = sum vpdpbusd(xq + 128, q) - 128 * bsum_b (the offset the unsigned activations carry).
 * AVX2: acc_b = sum vpmaddwd(vpmaddubsw(|q|, sign(xq, q)), 1): the activation quad loses its +128 (a xor of
 * 0x80 per byte) and each byte takes the sign of its weight, so the unsigned operand is |q| <= 128 and every
 * int16 pair sum stays within 2 x 128 x 127 (vpmaddubsw saturates, and 255 x 127 would). */
#include "kiln_cpu.h"

#if defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>

/* the AVX-VNNI tiles where the compiler knows the instruction (kiln_cpu.h: GCC 11, clang 12); else AVX2's alone */
#ifdef KILN_HAVE_YMM_VNNI
#define YT_HAVE_VNNI 1
#endif
#define YT_AVX2 __attribute__((target("avx2,fma")))
#define YT_VNNI KILN_YMM_VNNI
#define YT_DPBUSD KILN_YMM_DPBUSD

/* the epilogue of a tile: rows [0, R) of y (row stride ldy, bf16 or float32) = f * scale + bias, ncols columns */
YT_AVX2 static inline void yt_store(__m256 f[][2], int R, const float *scale, const float *bias, void *y,
                                    int64_t ldy, int bf16, int ncols) {
    float b16[16] = {0}; /* the bias past ncols is not the caller's memory: padded here, once for every row */
    for (int c = 0; bias && c < ncols; c++) b16[c] = bias[c];
    for (int r = 0; r < R; r++) {
        float out[16];
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_mul_ps(f[r][h], _mm256_loadu_ps(scale + 8 * h));
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(b16 + 8 * h));
            _mm256_storeu_ps(out + 8 * h, v);
        }
        for (int c = 0; c < ncols; c++) st(y, r * ldy + c, out[c], bf16);
    }
}

/* f[r][h] += float(acc[r][h] - 128 bsum) * dx for block b of R rows (off: 1 subtracts the offset) */
YT_AVX2 static inline void yt_block(__m256 f[][2], __v8si acc[][2], int R, const int16_t *bs, int off,
                                    const float *sx, int64_t nb, int64_t b) {
    for (int h = 0; h < 2; h++) {
        const __m256i o = off ? _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(bs + 8 * h))), 7)
                              : _mm256_setzero_si256();
        for (int r = 0; r < R; r++)
            f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32((__m256i)acc[r][h], o)),
                                      _mm256_set1_ps(sx[r * nb + b]), f[r][h]);
    }
}

/* one tile: rows [0, R) of xq (row stride ldq, block scales sx, row stride nb) x one panel w (nb blocks of 8
 * quads, block sums bs) */
#define YT_TILE(NAME, TARGET, R, QUAD_STEP, OFF)                                                              \
    TARGET static void NAME(const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *w, int64_t nb,     \
                            const int16_t *bs, const float *scale, const float *bias, void *y, int64_t ldy,   \
                            int bf16, int ncols) {                                                            \
        __m256 f[R][2];                                                                                       \
        for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++) {                                                                    \
            __v8si acc[R][2];                                                                                 \
            for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (__v8si){0};                                  \
            for (int64_t i = 8 * b; i < 8 * b + 8; i++) {                                                     \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + i * 64));                          \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + i * 64 + 32));                     \
                for (int r = 0; r < R; r++) { /* the quad broadcast straight from memory: a load, no shuffle */ \
                    const __m256i quad = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(xq + r * ldq + 4 * i))); \
                    QUAD_STEP(acc[r], quad, w0, w1);                                                          \
                }                                                                                             \
            }                                                                                                 \
            yt_block(f, acc, R, bs + b * KILN_PANEL, OFF, sx, nb, b);                                         \
        }                                                                                                     \
        yt_store(f, R, scale, bias, y, ldy, bf16, ncols);                                                     \
    }

#define YT_VNNI_STEP(a, xb, w0, w1)                     \
    do {                                                \
        YT_DPBUSD((a)[0], xb, w0);                      \
        YT_DPBUSD((a)[1], xb, w1);                      \
    } while (0)

#define YT_AVX2_STEP(a, quad, w0, w1)                                                                         \
    do {                                                                                                      \
        const __m256i xs = _mm256_xor_si256(quad, _mm256_set1_epi8((char)0x80)), one = _mm256_set1_epi16(1); \
        (a)[0] = (__v8si)_mm256_add_epi32((__m256i)(a)[0], _mm256_madd_epi16(                                 \
            _mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(xs, w0)), one));                       \
        (a)[1] = (__v8si)_mm256_add_epi32((__m256i)(a)[1], _mm256_madd_epi16(                                 \
            _mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(xs, w1)), one));                       \
    } while (0)

YT_TILE(yt_avx2_1, YT_AVX2, 1, YT_AVX2_STEP, 0) YT_TILE(yt_avx2_2, YT_AVX2, 2, YT_AVX2_STEP, 0)
YT_TILE(yt_avx2_3, YT_AVX2, 3, YT_AVX2_STEP, 0) YT_TILE(yt_avx2_4, YT_AVX2, 4, YT_AVX2_STEP, 0)

static const kiln_w8a8_tile yt_avx2[KILN_W8A8_YMM_MR + 1] = {0, yt_avx2_1, yt_avx2_2, yt_avx2_3, yt_avx2_4};

#ifdef YT_HAVE_VNNI
YT_TILE(yt_vnni1, YT_VNNI, 1, YT_VNNI_STEP, 1) YT_TILE(yt_vnni2, YT_VNNI, 2, YT_VNNI_STEP, 1)
YT_TILE(yt_vnni3, YT_VNNI, 3, YT_VNNI_STEP, 1) YT_TILE(yt_vnni4, YT_VNNI, 4, YT_VNNI_STEP, 1)
static const kiln_w8a8_tile yt_vnni[KILN_W8A8_YMM_MR + 1] = {0, yt_vnni1, yt_vnni2, yt_vnni3, yt_vnni4};
#endif

const kiln_w8a8_tile *kiln_w8a8_ymm_tiles(int vnni) {
#ifdef YT_HAVE_VNNI
    if (vnni && kiln_cpu_ymm_vnni()) return yt_vnni;
#else
    (void)vnni;
#endif
    return yt_avx2;
}
#else
const kiln_w8a8_tile *kiln_w8a8_ymm_tiles(int vnni) {
    (void)vnni;
    return 0;
}
#endif
