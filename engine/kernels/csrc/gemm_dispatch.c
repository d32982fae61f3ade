/* ---- the tactic dispatch: one weight, the kernel its table picked for this call's row count ----
 *
 * Above every GEMM: the float32 and bf16 FMA tiles (gemm.c), the AMX tiles (gemm_amx.c), the int8 GEMM that
 * widens into them (gemm_int8.c), W8A8 on the int8 units over the same int8 panels (gemm_w8a8.c; its sums on
 * AMX-INT8 tiles where the table picked that, gemm_w8a8_amx.c) and GGUF
 * block weights (gemm_gguf.c); none of
 * them calls back up here.
 *
 * The module path (native.Kernels.linear) and the decoder stack (stack.c) both call this, so they run the
 * same kernel on the same rows and agree bit for bit. A kernel the process cannot run (AMX without the tile
 * permission, W8A8 where the library has no VNNI code) falls back to the FMA tiles (W8A8 on AMX-INT8 to W8A8's
 * vector tiles, the same sums), never a fault. int8 weights
 * (scales set) go to gemm_int8.c, or gemm_w8a8.c for the buckets that run W8A8.
 * Returns 0, or -1 when scratch memory could not be allocated. */
#include "kiln_cpu.h"

static int row_bucket(int64_t m) {
    int b = 0;
    while (b < KILN_ROW_BUCKETS - 1 && ((int64_t)1 << b) < m) b++;
    return b;
}

int kiln_gemm(const struct kiln_weight *w, const void *x, const float *bias, void *y, int64_t m, int64_t ldx,
              int64_t ldy) {
    KILN_TIMED(KILN_T_GEMM);
    if (m <= 0) return 0;
    const int kernel = w->kernel[row_bucket(m)], amx = kernel == KILN_GEMM_AMX;
    if (w->qtype) /* GGUF blocks (gemm_gguf.c) */
        return kiln_linear_gguf(x, w->panels, w->qtype, bias, y, m, w->n, w->k, ldx, ldy, w->bf16,
                                kernel == KILN_GEMM_GGUF_F32);
    if (w->scales && (kernel == KILN_GEMM_W8A8 || kernel == KILN_GEMM_W8A8_AMX)) {
        const int rc = kiln_linear_w8a8(x, w->panels, w->scales, w->bsums, bias, y, m, w->n, w->k, ldx, ldy, w->bf16,
                                        kernel == KILN_GEMM_W8A8_AMX);
        if (rc <= 0) return rc; /* 1: not in this library: weight-only below */
    }
    if (w->scales) return kiln_linear_i8(x, w->panels, w->scales, bias, y, m, w->n, w->k, ldx, ldy, w->bf16, amx);
    if (w->bf16) {
        if (!(amx && kiln_linear_amx(x, w->panels, bias, y, m, w->n, w->k, ldx, ldy)))
            kiln_linear_bf16(x, w->panels, bias, y, m, w->n, w->k, ldx, ldy);
    } else {
        kiln_linear_f32(x, w->panels, bias, y, m, w->n, w->k, ldx, ldy);
    }
    return 0;
}

