/* ---- GGUF's column groups on 256-bit vectors: AVX-VNNI (the x86-64-v3 library) and AVX2 ----
 *
 * gemm_gguf.c quantizes the activations and shares out the groups; here rows [0, R), R = 1 or 2, x one group of 16
 * columns (two ymm halves of 8), the records as gemm_gguf.c describes them. Per block and column both sum the
 * same integers exactly:
 *   AVX-VNNI: vpdpbusd of the stored unsigned bytes by the signed activation quads, as the AVX512-VNNI tiles do
 *     on zmm: Q8_0's bytes are q + 128, so it takes the offset 128 (c2 = -128 dx sum xq); Q4's nibbles as they
 *     are. Its float epilogue is the zmm tiles' too, per column: t = fma(acc, dx, c2), y = fma(d, t, y)
 *     (+ fma(m, sx, y) for Q4_1), so it gives the AVX512-VNNI library's bits.
 *   AVX2: vpmaddubsw + vpmaddwd, whose int16 pair sums would overflow on Q8_0's 255 x 127, so there Q8_0 takes
 *     the sign trick (|q| x sign(xq, q)) and the offset 0; Q4's 15 x 127 pairs fit. */
#include "gguf_layout.h"

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#define GG_AVX2 __attribute__((target("avx2,fma,f16c")))

/* one quad of the record's half v (prepared once by PREP8 for Q8_0, split into nibbles for Q4) by a row's
 * activation quad(s), into acc */
#define GG_AVX2_PREP8(v)                                                                                       \
    const __m256i q8 = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), aq8 = _mm256_abs_epi8(q8)
#define GG_AVX2_Q8(acc, v, quad)                                                                               \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(                                                             \
        _mm256_maddubs_epi16(aq8, _mm256_sign_epi8(_mm256_set1_epi32(quad), q8)), _mm256_set1_epi16(1)))
#define GG_AVX2_Q4(acc, lo, hi, ql, qh)                                                                        \
    do {                                                                                                       \
        const __m256i ones = _mm256_set1_epi16(1);                                                             \
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(ql)), ones);                  \
        p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(qh)), ones));     \
        acc = _mm256_add_epi32(acc, p);                                                                        \
    } while (0)
#define GG_VNNI_PREP8(v) (void)0
#define GG_VNNI_Q8(acc, v, quad) KILN_YMM_DPBUSD(acc, v, _mm256_set1_epi32(quad))
#define GG_VNNI_Q4(acc, lo, hi, ql, qh)                                                                        \
    do {                                                                                                       \
        KILN_YMM_DPBUSD(acc, lo, _mm256_set1_epi32(ql));                                                       \
        KILN_YMM_DPBUSD(acc, hi, _mm256_set1_epi32(qh));                                                       \
    } while (0)

/* rows [0, R) x one group; Q8_0's c2 is added where the group takes the offset (OFF8) */
#define GG_GROUP(NAME, TARGET, ACC, PREP8, Q8, Q4, OFF8, R)                                                    \
    TARGET static void NAME(const int8_t *xq, int64_t ldq, const float *dx, const float *c2, const float *sx,  \
                            const uint8_t *w, int64_t nb, int qt, float *out) {                                \
        const int64_t rec = gg_record(qt), qb = gg_qbytes(qt), bpr = ldq / 32;                                 \
        __m256 y[2][2];                                                                                        \
        for (int r = 0; r < 2; r++) y[r][0] = y[r][1] = _mm256_setzero_ps();                                   \
        const __m256i lo4 = _mm256_set1_epi8(0x0f);                                                            \
        for (int64_t b = 0; b < nb; b++) {                                                                     \
            const uint8_t *rp = w + b * rec;                                                                   \
            ACC acc[2][2];                                                                                     \
            for (int r = 0; r < 2; r++) acc[r][0] = acc[r][1] = (ACC){0};                                      \
            for (int t = 0; t < (qt == GG_Q8_0 ? 8 : 4); t++)                                                  \
                for (int h = 0; h < 2; h++) {                                                                  \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(rp + t * 64 + 32 * h));             \
                    if (qt == GG_Q8_0) {                                                                       \
                        PREP8(v);                                                                              \
                        for (int r = 0; r < R; r++) {                                                          \
                            int32_t quad;                                                                      \
                            memcpy(&quad, xq + r * ldq + 32 * b + 4 * t, 4);                                   \
                            Q8(acc[r][h], v, quad);                                                            \
                        }                                                                                      \
                    } else {                                                                                   \
                        const __m256i lo = _mm256_and_si256(v, lo4);                                           \
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);                     \
                        for (int r = 0; r < R; r++) {                                                          \
                            int32_t ql, qh;                                                                    \
                            memcpy(&ql, xq + r * ldq + 32 * b + 4 * t, 4);                                     \
                            memcpy(&qh, xq + r * ldq + 32 * b + 16 + 4 * t, 4);                                \
                            Q4(acc[r][h], lo, hi, ql, qh);                                                     \
                        }                                                                                      \
                    }                                                                                          \
                }                                                                                              \
            for (int h = 0; h < 2; h++) {                                                                      \
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rp + qb + 16 * h)));        \
                const __m256 m = qt == GG_Q4_1                                                                 \
                    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rp + qb + 32 + 16 * h)))               \
                    : _mm256_setzero_ps();                                                                     \
                for (int r = 0; r < R; r++) {                                                                  \
                    const int64_t i = r * bpr + b;                                                             \
                    const float cc = qt == GG_Q8_0 && !(OFF8) ? 0.0f : c2[i];                                  \
                    const __m256 tv = _mm256_fmadd_ps(_mm256_cvtepi32_ps((__m256i)acc[r][h]),                  \
                                                      _mm256_set1_ps(dx[i]), _mm256_set1_ps(cc));              \
                    y[r][h] = _mm256_fmadd_ps(d, tv, y[r][h]);                                                 \
                    if (qt == GG_Q4_1) y[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[i]), y[r][h]);           \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < R; r++)                                                                            \
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * GG_COLS + 8 * h, y[r][h]);                  \
    }

/* one function per row count (1, 2): R a constant, so the sums stay in registers */
GG_GROUP(gg_avx2_1, GG_AVX2, __m256i, GG_AVX2_PREP8, GG_AVX2_Q8, GG_AVX2_Q4, 0, 1)
GG_GROUP(gg_avx2_2, GG_AVX2, __m256i, GG_AVX2_PREP8, GG_AVX2_Q8, GG_AVX2_Q4, 0, 2)
static const kiln_gguf_group gg_avx2[3] = {0, gg_avx2_1, gg_avx2_2};
#ifdef KILN_HAVE_YMM_VNNI
GG_GROUP(gg_vnni_1, KILN_YMM_VNNI, __v8si, GG_VNNI_PREP8, GG_VNNI_Q8, GG_VNNI_Q4, 1, 1)
GG_GROUP(gg_vnni_2, KILN_YMM_VNNI, __v8si, GG_VNNI_PREP8, GG_VNNI_Q8, GG_VNNI_Q4, 1, 2)
static const kiln_gguf_group gg_vnni[3] = {0, gg_vnni_1, gg_vnni_2};
#endif

static int gg_ymm_vnni(int vnni) {
#ifdef KILN_HAVE_YMM_VNNI
    return vnni && kiln_cpu_ymm_vnni();
#else
    (void)vnni;
    return 0;
#endif
}

const kiln_gguf_group *kiln_gguf_ymm_group(int vnni) {
#ifdef KILN_HAVE_YMM_VNNI
    if (gg_ymm_vnni(vnni)) return gg_vnni;
#else
    (void)vnni;
#endif
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? gg_avx2 : 0;
}

int kiln_gguf_ymm_off(int vnni) { return gg_ymm_vnni(vnni) ? 128 : 0; }
#else
const kiln_gguf_group *kiln_gguf_ymm_group(int vnni) {
    (void)vnni;
    return 0;
}
int kiln_gguf_ymm_off(int vnni) {
    (void)vnni;
    return 0;
}
#endif
