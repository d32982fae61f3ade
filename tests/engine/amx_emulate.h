/* A software AMX for tests: the tile instructions kiln's AMX-INT8 W8A8 kernel uses (engine/kernels/csrc/
 * gemm_w8a8_amx.c, compiled with -DKILN_AMX_EMULATE -include this file), run in plain C on any host, with every
 * check the SDM's LDTILECFG, TILELOADD and TDPBUSD pages list for the tile configuration and the operands'
 * shapes: a shape the hardware would fault on aborts here, naming it.
 *
 * Palette 1: 8 tiles of up to 16 rows x 64 bytes. TILELOADD reads rows x colsb bytes, row r at base + r x
 * stride; TILESTORED writes them; TDPBUSD C += A (u8) x B (s8): C is M x N int32 (colsb = 4N), A is M x K bytes,
 * B is K/4 rows x 4N bytes (each row a K quad of 4 bytes per column); the hardware requires A's colsb = 4 x B's
 * rows, C's rows = A's rows and C's colsb = B's colsb, and faults on an unconfigured tile. */
#ifndef KILN_AMX_EMULATE_H
#define KILN_AMX_EMULATE_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct amx_emu_tile {
    int rows, colsb;
    uint8_t data[16][64];
};
static __thread struct amx_emu_tile amx_emu_tiles[8];
static __thread int amx_emu_configured;
__attribute__((weak)) uint64_t amx_emu_dpbusd_ops; /* one counter for the library (weak: every file includes this) */

static void amx_emu_fault(const char *what, int tile) {
    fprintf(stderr, "amx_emulate: the hardware would fault: %s (tile %d)\n", what, tile);
    abort();
}

static inline void amx_emu_config(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    if (c[0] != 1) amx_emu_fault("palette is not 1", -1);
    for (int i = 2; i < 16; i++)
        if (c[i]) amx_emu_fault("reserved bytes of the configuration are not zero", -1);
    for (int t = 0; t < 16; t++) {
        const int colsb = c[16 + 2 * t] | c[17 + 2 * t] << 8, rows = c[48 + t];
        if (t >= 8 && (colsb || rows)) amx_emu_fault("palette 1 has 8 tiles", t);
        if (t >= 8) continue;
        if (rows > 16 || colsb > 64) amx_emu_fault("more than 16 rows or 64 bytes a row", t);
        if (!rows != !colsb) amx_emu_fault("rows and bytes a row: one is zero, the other not", t);
        amx_emu_tiles[t].rows = rows, amx_emu_tiles[t].colsb = colsb;
        memset(amx_emu_tiles[t].data, 0, sizeof amx_emu_tiles[t].data);
    }
    amx_emu_configured = 1;
}

static inline struct amx_emu_tile *amx_emu_tile(int t) {
    if (!amx_emu_configured) amx_emu_fault("tiles used before LDTILECFG", t);
    if (t < 0 || t > 7 || !amx_emu_tiles[t].rows) amx_emu_fault("tile not configured", t);
    return &amx_emu_tiles[t];
}

static inline void amx_emu_zero(int t) { memset(amx_emu_tile(t)->data, 0, sizeof amx_emu_tiles[t].data); }

static inline void amx_emu_load(int t, const void *base, int64_t stride) {
    struct amx_emu_tile *x = amx_emu_tile(t);
    memset(x->data, 0, sizeof x->data);
    for (int r = 0; r < x->rows; r++) memcpy(x->data[r], (const char *)base + r * stride, (size_t)x->colsb);
}

static inline void amx_emu_store(int t, void *base, int64_t stride) {
    struct amx_emu_tile *x = amx_emu_tile(t);
    for (int r = 0; r < x->rows; r++) memcpy((char *)base + r * stride, x->data[r], (size_t)x->colsb);
}

static inline void amx_emu_dpbusd(int tc, int ta, int tb) {
    struct amx_emu_tile *c = amx_emu_tile(tc), *a = amx_emu_tile(ta), *b = amx_emu_tile(tb);
    if (tc == ta || tc == tb || ta == tb) amx_emu_fault("TDPBUSD's three tiles are not distinct", tc);
    if (a->colsb % 4 || c->colsb % 4) amx_emu_fault("A's or C's bytes a row are not whole dwords", tc);
    if (a->colsb != 4 * b->rows) amx_emu_fault("A's bytes a row are not 4 x B's rows", ta);
    if (c->rows != a->rows) amx_emu_fault("C's rows are not A's", tc);
    if (c->colsb != b->colsb) amx_emu_fault("C's bytes a row are not B's", tb);
    __atomic_fetch_add(&amx_emu_dpbusd_ops, 1, __ATOMIC_RELAXED);
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            int32_t acc;
            memcpy(&acc, c->data[m] + 4 * n, 4);
            for (int k = 0; k < b->rows; k++)
                for (int e = 0; e < 4; e++)
                    acc = (int32_t)((uint32_t)acc + (uint32_t)((int32_t)a->data[m][4 * k + e] *
                                                                (int32_t)(int8_t)b->data[k][4 * n + e]));
            memcpy(c->data[m] + 4 * n, &acc, 4);
        }
}

static inline void amx_emu_release(void) {
    amx_emu_configured = 0;
    memset(amx_emu_tiles, 0, sizeof amx_emu_tiles);
}

#define W8X_CONFIG(c) amx_emu_config(c)
#define W8X_ZERO(t) amx_emu_zero(t)
#define W8X_LOAD(t, base, stride) amx_emu_load(t, base, stride)
#define W8X_STORE(t, base, stride) amx_emu_store(t, base, stride)
#define W8X_DPBUSD(c, a, b) amx_emu_dpbusd(c, a, b)
#define W8X_RELEASE() amx_emu_release()
#endif
