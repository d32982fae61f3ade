/* ---- W8A8 on AMX-INT8 tiles (Sapphire Rapids and later): the VNNI tiles' sums, up to 16 rows at a time ----
 *
 * gemm_w8a8.c quantizes the activations (u8: xq + 128, one scale per row and 32-block of K) and shares out the
 * panels; here are rows [0, R), R <= 16, of one 64-column panel. The int8 panel is already in AMX's B-tile
 * layout: a K quad of a panel is 64 columns x 4 bytes (W8X_QUAD bytes), so the 8 quads of one 32-block x 16
 * columns are one B tile of 8 rows x 64 bytes, W8X_QUAD apart. Per block: C tiles 0-3 (R rows x 16 int32
 * columns each) zeroed, A tile 4 = the block's 32 activation bytes of R rows, tdpbusd (u8 x s8, what vpdpbusd
 * multiplies) against B tiles 5-6 for the panel's four 16-column quarters, the sums stored, and gemm_w8a8.c's
 * float epilogue run on them: f += float(acc_b - 128 bsum_b) * dx_b. The block scale is why one tile multiply
 * covers 32 of K, not the 64 a tile can: the int32 sums of two blocks must not mix. The integers are the VNNI
 * tiles' and the float operations theirs in their order, so the result is theirs bit for bit.
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

/* C tiles 0-3: rows x 64 bytes; A tile 4: rows x 32 bytes (one block of K); B tiles 5-6: 8 quads x 64 bytes */
W8X_TARGET static void w8x_configure(int rows) {
    struct w8x_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) {
        c.rows[t] = (uint8_t)(t < 5 ? rows : 8);
        c.colsb[t] = t == 4 ? 32 : 64;
    }
    __asm__ volatile("" ::: "memory"); /* ldtilecfg's operand names 8 of the 64 bytes: keep all stores */
    W8X_CONFIG(&c);
}

/* f [rows][64] = sum over the nb blocks of float(acc_b - 128 bsum_b) * dx_b for rows [0, rows) of xq (row
 * stride ldq, block scales sx with row stride nb) and the panel w (block sums bs), as gemm_w8a8.c's tiles sum
 * them. The calling thread's tiles are configured as *cfg says (-1: not yet) and stay so;
 * kiln_w8a8_amx_release ends them. Returns 0 (nothing done) where kiln_w8a8_amx_ready says no. */
KILN_HIDDEN W8X_TARGET int kiln_w8a8_amx_sums(int rows, const uint8_t *xq, int64_t ldq, const float *sx,
                                              const int8_t *w, int64_t nb, const int16_t *bs, float *f, int *cfg) {
    if (!kiln_w8a8_amx_ready() || rows < 1 || rows > 16) return 0;
    if (*cfg != rows) w8x_configure(*cfg = rows);
    int32_t acc[16 * 64] __attribute__((aligned(64)));
    for (int i = 0; i < rows * 64; i += 16) _mm512_store_ps(f + i, _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = w + 8 * b * W8X_QUAD;
        W8X_ZERO(0);
        W8X_ZERO(1);
        W8X_ZERO(2);
        W8X_ZERO(3);
        W8X_LOAD(4, xq + 32 * b, ldq);
        W8X_LOAD(5, wb, W8X_QUAD);
        W8X_DPBUSD(0, 4, 5);
        W8X_LOAD(6, wb + 64, W8X_QUAD);
        W8X_DPBUSD(1, 4, 6);
        W8X_LOAD(5, wb + 128, W8X_QUAD);
        W8X_DPBUSD(2, 4, 5);
        W8X_LOAD(6, wb + 192, W8X_QUAD);
        W8X_DPBUSD(3, 4, 6);
        W8X_STORE(0, acc, 256);
        W8X_STORE(1, acc + 16, 256);
        W8X_STORE(2, acc + 32, 256);
        W8X_STORE(3, acc + 48, 256);
        for (int c = 0; c < 4; c++) {
            const __m512i off = _mm512_slli_epi32(
                _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(bs + b * KILN_PANEL + 16 * c))), 7);
            for (int r = 0; r < rows; r++) {
                float *fr = f + 64 * r + 16 * c;
                const __m512i sums = _mm512_load_si512(acc + 64 * r + 16 * c);
                _mm512_store_ps(fr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, off)),
                                                    _mm512_set1_ps(sx[r * nb + b]), _mm512_load_ps(fr)));
            }
        }
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
