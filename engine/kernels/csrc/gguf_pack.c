/* ---- GGUF block weights: packing into kiln's records, and the dequantizing (kiln-gguf-f32) mode ----
 *
 * kiln_pack_gguf repacks a file tensor into the records gemm_gguf.c multiplies (its header says how they are
 * laid out).
 *
 * kiln_linear_gguf's second mode (tactic kiln-gguf-f32, float32 activations): no activation quantization; a
 * 64-column panel is dequantized to float32 per call and multiplied by gemm.c's FMA tiles (weight-only
 * semantics, for prefill-sized calls where one dequantization serves many rows). */
#include "gguf_layout.h"

int64_t kiln_gguf_packed_bytes(int64_t n, int64_t k, int qt) { return (n + GG_COLS - 1) / GG_COLS * (k / 32) * gg_record(qt); }

/* src: the file's [n][k / 32] blocks -> dst (kiln_gguf_packed_bytes); columns past n are zero (d = 0) */
void kiln_pack_gguf(const uint8_t *src, uint8_t *dst, int64_t n, int64_t k, int qt) {
    const int64_t nb = k / 32, groups = (n + GG_COLS - 1) / GG_COLS, rec = gg_record(qt), fb = gg_file_block(qt);
    const int64_t qb = gg_qbytes(qt);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *r = dst + (g * nb + b) * rec;
            memset(r, 0, rec);
            uint16_t *d = (uint16_t *)(r + qb), *mm = d + GG_COLS;
            for (int c = 0; c < GG_COLS; c++) {
                const int64_t col = g * GG_COLS + c;
                if (col >= n) {
                    if (qt == GG_Q8_0)
                        for (int j = 0; j < 32; j++) r[(j / 4) * 64 + 4 * c + j % 4] = 128;
                    continue;
                }
                const uint8_t *blk = src + (col * nb + b) * fb;
                memcpy(&d[c], blk, 2);
                if (qt == GG_Q8_0) {
                    for (int j = 0; j < 32; j++) r[(j / 4) * 64 + 4 * c + j % 4] = (uint8_t)((int8_t)blk[2 + j] + 128);
                } else {
                    const uint8_t *qs = blk + (qt == GG_Q4_1 ? 4 : 2);
                    if (qt == GG_Q4_1) memcpy(&mm[c], blk + 2, 2);
                    for (int j = 0; j < 16; j++) r[(j / 4) * 64 + 4 * c + j % 4] = qs[j];
                }
            }
        }
}

static __thread void *gg_buf;
static __thread size_t gg_cap;

/* K rows [k0, k0 + kn) (whole blocks) of the column groups of one KILN_PANEL-wide panel, dequantized into a
 * float32 panel [kn][KILN_PANEL] (groups past n: zero) */
static void gg_dequant_panel(const uint8_t *w, int64_t nb, int qt, int64_t g0, int64_t groups, int64_t k0, int64_t kn,
                             float *dst) {
    const int64_t rec = gg_record(qt), qb = gg_qbytes(qt);
    for (int64_t gi = 0; gi < KILN_PANEL / GG_COLS; gi++) {
        const int64_t g = g0 + gi;
        for (int64_t b = k0 / 32; b < (k0 + kn) / 32; b++) {
            float *row0 = dst + (32 * b - k0) * KILN_PANEL + gi * GG_COLS;
            if (g >= groups) {
                for (int j = 0; j < 32; j++) memset(row0 + j * KILN_PANEL, 0, GG_COLS * sizeof(float));
                continue;
            }
            const uint8_t *r = w + (g * nb + b) * rec;
            const uint16_t *d = (const uint16_t *)(r + qb), *mm = d + GG_COLS;
            for (int c = 0; c < GG_COLS; c++) {
                const float dc = gg_h2f(d[c]), mc = qt == GG_Q4_1 ? gg_h2f(mm[c]) : 0.0f;
                for (int j = 0; j < 32; j++) {
                    const uint8_t u = r[((j % 16) / 4) * 64 + 4 * c + j % 4];
                    float v;
                    if (qt == GG_Q8_0) v = (float)((int)r[(j / 4) * 64 + 4 * c + j % 4] - 128) * dc;
                    else if (qt == GG_Q4_0) v = (float)((j < 16 ? u & 15 : u >> 4) - 8) * dc;
                    else v = (float)(j < 16 ? u & 15 : u >> 4) * dc + mc;
                    row0[j * KILN_PANEL + c] = v;
                }
            }
        }
    }
}

KILN_HIDDEN int kiln_gguf_linear_f32(const float *x, const uint8_t *w, int qt, const float *bias, float *y, int64_t m, int64_t n,
                         int64_t k, int64_t ldx, int64_t ldy) {
    const int64_t nb = k / 32, groups = (n + GG_COLS - 1) / GG_COLS, panels = (n + KILN_PANEL - 1) / KILN_PANEL;
    const int64_t kc = GG_KC < k ? GG_KC : k;
    int failed = 0;
#pragma omp parallel if (panels > 1)
    {
        float *buf = kiln_scratch(&gg_buf, &gg_cap, (size_t)kc * KILN_PANEL * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!buf) continue;
            const int ncols = n - p * KILN_PANEL < KILN_PANEL ? (int)(n - p * KILN_PANEL) : KILN_PANEL;
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t kn = k - k0 < kc ? k - k0 : kc;
                gg_dequant_panel(w, nb, qt, p * (KILN_PANEL / GG_COLS), groups, k0, kn, buf);
                kiln_panel_f32(x, ldx, buf, k0, kn, y + p * KILN_PANEL, ldy, 0, bias ? bias + p * KILN_PANEL : 0,
                               ncols, m);
            }
        }
    }
    return failed ? -1 : 0;
}
