/* ---- W8A8 on AMX-INT8 tiles (Sapphire Rapids and later): the VNNI tiles' sums, up to 16 rows at a time ----
 *
 * gemm_w8a8.c quantizes the activations (u8: xq + 128, one scale per row and 32-block of K) and shares out the
 * panels; here are rows [0, R), R <= 16, of one 64-column panel. The int8 panel is already in AMX's B-tile
 * layout: a K quad of a panel is 64 columns x 4 bytes (W8X_QUAD bytes), so the 8 quads of one 32-block x 16
 * columns are one B tile of 8 rows x 64 bytes, W8X_QUAD apart. Per block: a C tile (R rows x 16 int32
 * columns) zeroed, an A tile = the block's 32 activation bytes of R rows, tdpbusd (u8 x s8, what vpdpbusd
 * multiplies) against the B tile of the block and one 16-column quarter, the sums stored, and gemm_w8a8.c's
 * float epilogue run on them: f += float(acc_b - 128 bsum_b) * dx_b. The block scale is why one multiply
 * covers 32 of K, not the 64 a tile can: the int32 sums of two blocks must not mix, and it makes the float
 * epilogue (one cvt and one FMA a row, 16 columns and block) cost about what the multiply does. The integers
 * are the VNNI tiles' and the float operations theirs in their order, so the result is theirs bit for bit.
 *
 * The tile instructions are named through W8X_* macros: tests compile this file with -DKILN_AMX_EMULATE and a
 * software AMX (tests/engine/amx_emulate.h) that checks every tile shape and operand as the hardware does, so
 * the kernel's layout is tested on hosts without AMX. */
#include "kiln_cpu.h"

static int w8x_allowed = 0; /* the caller's leave (kiln_w8a8_allow_amx: the CPU's flags and $KILN_CPU_ISA) */
void kiln_w8a8_allow_amx(int on) { w8x_allowed = on; }

#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 11)
#include <immintrin.h>

#define W8X_QUAD (4 * KILN_PANEL) /* bytes of one K quad of a panel */
#define W8X_VEC __attribute__((target("avx512f,avx512bw,avx512vl")))
#ifdef KILN_AMX_EMULATE /* the emulator's functions are plain C: no tile state to ask for */
#define W8X_TARGET W8X_VEC
#define W8X_READY() 1
#else
#define W8X_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
#define W8X_READY() kiln_amx_ready()
#define W8X_CONFIG(c) _tile_loadconfig(c)
#define W8X_ZERO(t) _tile_zero(t)
#define W8X_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define W8X_STORE(t, base, stride) _tile_stored(t, base, stride)
#define W8X_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define W8X_RELEASE() _tile_release()
#endif

int kiln_w8a8_amx_available(void) { return 1; }

/* whether kiln_w8a8_amx_sums runs here: the caller allowed it and the process has the tile state */
KILN_HIDDEN int kiln_w8a8_amx_ready(void) { return w8x_allowed && W8X_READY(); }

/* ends the calling thread's tile configuration (after kiln_w8a8_amx_sums configured it) */
KILN_HIDDEN W8X_TARGET void kiln_w8a8_amx_release(void) { W8X_RELEASE(); }

struct w8x_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* C tiles 0-3: rows x 64 bytes (16 int32 columns); A tiles 4 and 7: rows x 32 bytes (one block of K); B tiles 5-6:
 * 8 quads x 64 bytes */
W8X_TARGET static void w8x_configure(int rows) {
    struct w8x_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t == 5 || t == 6 ? 8 : rows);
        c.colsb[t] = t == 4 || t == 7 ? 32 : 64;
    }
    __asm__ volatile("" ::: "memory"); /* ldtilecfg's operand names 8 of the 64 bytes: keep all stores */
    W8X_CONFIG(&c);
}

/* block b0 + J of one 16-column quarter (wq: its first column) into C tile J, if it is one of the nb, through A
 * tile A and B tile B (the tile numbers are literals: the instructions encode them); the callers alternate 4/5
 * and 7/6 so a load need not wait for the multiply before it */
#define W8X_BLOCK(J, A, B)                                                                                   \
    if (b0 + J < nb) {                                                                                       \
        W8X_ZERO(J);                                                                                         \
        W8X_LOAD(A, xq + 32 * (b0 + J), ldq);                                                                \
        W8X_LOAD(B, wq + 8 * (b0 + J) * W8X_QUAD, W8X_QUAD);                                                  \
        W8X_DPBUSD(J, A, B);                                                                                 \
    }
#define W8X_SAVE(J) \
    if (b0 + J < nb) W8X_STORE(J, acc + 256 * J, 64);

/* f [rows][64] = sum over the nb blocks of float(acc_b - 128 bsum_b) * dx_b for rows [0, rows) of xq (row
 * stride ldq, block scales sx with row stride nb) and the panel w (block sums bs), as gemm_w8a8.c's tiles sum
 * them. One 16-column quarter at a time, its 16 rows' float sums in registers: four blocks' multiplies into C
 * tiles 0-3, stored together, then each block's epilogue in order. The calling thread's tiles are configured
 * as *cfg says (-1: not yet) and stay so; kiln_w8a8_amx_release ends them. Returns 0 (nothing done) where
 * kiln_w8a8_amx_ready says no. */
KILN_HIDDEN W8X_TARGET int kiln_w8a8_amx_sums(int rows, const uint8_t *xq, int64_t ldq, const float *sx,
                                              const int8_t *w, int64_t nb, const int16_t *bs, float *f, int *cfg) {
    if (!kiln_w8a8_amx_ready() || rows < 1 || rows > 16) return 0;
    if (*cfg != rows) w8x_configure(*cfg = rows);
    int32_t acc[4 * 16 * 16] __attribute__((aligned(64))) = {0}; /* [block][row][column]; rows past `rows` 0 */
    for (int c = 0; c < 4; c++) {
        const int8_t *wq = w + 64 * c;
        __m512 fr[16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) fr[r] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += 4) {
            W8X_BLOCK(0, 4, 5) W8X_BLOCK(1, 7, 6) W8X_BLOCK(2, 4, 5) W8X_BLOCK(3, 7, 6)
            W8X_SAVE(0) W8X_SAVE(1) W8X_SAVE(2) W8X_SAVE(3)
            for (int j = 0; j < 4 && b0 + j < nb; j++) {
                const int64_t b = b0 + j;
                const __m512i off = _mm512_slli_epi32(
                    _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(bs + b * KILN_PANEL + 16 * c))), 7);
                float dx[16] = {0}; /* the block's scales; nothing past the last row is read */
                for (int r = 0; r < rows; r++) dx[r] = sx[r * nb + b];
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) {
                    const __m512i sums = _mm512_load_si512(acc + 256 * j + 16 * r);
                    fr[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, off)), _mm512_set1_ps(dx[r]),
                                            fr[r]);
                }
            }
        }
        for (int r = 0; r < rows; r++) _mm512_store_ps(f + 64 * r + 16 * c, fr[r]);
    }
    return 1;
}
#else
int kiln_w8a8_amx_available(void) { return 0; }
KILN_HIDDEN int kiln_w8a8_amx_ready(void) { return 0; }
KILN_HIDDEN void kiln_w8a8_amx_release(void) {}
KILN_HIDDEN int kiln_w8a8_amx_sums(int rows, const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *w,
                                   int64_t nb, const int16_t *bs, float *f, int *cfg) {
    (void)rows, (void)xq, (void)ldq, (void)sx, (void)w, (void)nb, (void)bs, (void)f, (void)cfg;
    return 0;
}
#endif
