/* kiln's CPU kernels: the helpers every file shares and the entry points they call in each other.
 *
 * C99 with GCC vector extensions + OpenMP, compiled per ISA level (x86-64-v4, x86-64-v3, armv8-a) into one
 * shared library by engine/kernels/cpu_library.py and called through ctypes (engine/kernels/native.py) with
 * raw tensor pointers; no torch headers, so a build takes a few seconds. One file per concern:
 *
 *   attention.c  paged attention read straight from the KV cache blocks
 *   attention_bf16.c  its inner loops on vdpbf16ps, for a bf16 cache in pair layout
 *   attention_amx.c   a prefill group's scores and values on AMX tiles, same layout
 *   pointwise.c  SiLU x up, residual add + RMSNorm, rotary, the KV cache write
 *   gemm.c       linears over weights packed once into panels: float32 and bf16 (vdpbf16ps) FMA tiles
 *   gemm_amx.c   the bf16 linear on AMX tiles, over the same panels
 *   gemm_int8.c  int8 weights (weight-only quantization) through the kernels above, widened panel by panel
 *   gemm_w8a8.c  int8 weights x int8 activations quantized per 32-block (W8A8), same int8 panels: AVX512-VNNI tiles
 *   gemm_w8a8_ymm.c  its tiles on 256-bit vectors (AVX-VNNI, AVX2) for the x86-64-v3 library
 *   gemm_w8a8_amx.c  its sums on AMX-INT8 tiles, up to 16 rows at a time, for the x86-64-v4 library
 *   gemm_gguf.c  GGUF block weights (Q8_0, Q4_0, Q4_1) x activations quantized per 32-block: AVX512-VNNI tiles
 *   gemm_gguf_ymm.c  its column groups on 256-bit vectors (AVX-VNNI for the x86-64-v3 library, AVX2)
 *   gguf_pack.c  GGUF block weights packed into kiln's records (gguf_layout.h), and dequantized (kiln-gguf-f32)
 *   gemm_dispatch.c  kiln_gemm, which runs the kernel a weight's tactic table picked for the call's row count:
 *                over the four GEMM files above, which never call it (gemm_int8.c calls down into gemm.c, gemm_amx.c)
 *   stack.c      a pipeline stage's decoder layers in one call
 *   profile.c    opt-in per-component timers around the entry points above (kiln bench --profile)
 *
 * Threads: the OpenMP runtime is the one torch loaded (same soname, libgomp.so.1), so a parallel
 * region here uses torch's thread count (torch.set_num_threads) and its warm thread pool.
 */
#ifndef KILN_CPU_H
#define KILN_CPU_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KILN_ABI_VERSION 14
#define KILN_HIDDEN __attribute__((visibility("hidden")))

/* ---- opt-in timers (profile.c): an entry point opens with KILN_TIMED(component) ---- */
enum kiln_component { KILN_T_GEMM, KILN_T_ATTENTION, KILN_T_KV_WRITE, KILN_T_NORM, KILN_T_ROPE, KILN_T_ACTIVATION,
                      KILN_T_BIAS, KILN_T_COUNT };
KILN_HIDDEN extern int kiln_profile_on;
int64_t kiln_profile_now(void);
void kiln_profile_add(int component, int64_t ns);
struct kiln_timer { int64_t start; int component; };
static inline void kiln_timer_end(const struct kiln_timer *t) {
    if (t->start) kiln_profile_add(t->component, kiln_profile_now() - t->start);
}
/* Times the rest of the enclosing function, early returns included (off: one load and a branch each way).
 * -DKILN_NO_TIMERS compiles it out: the build that measures what the timers cost when off (docs/performance.md). */
#ifdef KILN_NO_TIMERS
#define KILN_TIMED(component) (void)(component)
#else
#define KILN_TIMED(component)                                                                                  \
    const struct kiln_timer kiln_timer_ __attribute__((cleanup(kiln_timer_end))) = {                            \
        __builtin_expect(kiln_profile_on, 0) ? kiln_profile_now() : 0, (component)}
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* element i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float */
static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* e^x for x <= 0 (scores minus their max), Cephes' expf: about 1 ulp, vectorizable. */
#pragma omp declare simd notinbranch
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The pointwise kernels compute what the eager torch ops compute, rounding where those round: no fused
 * multiply-add where torch has none (see pointwise.c). */
#define NOCONTRACT __attribute__((optimize("fp-contract=off")))
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* ---- linears: weights packed once into panels of KILN_PANEL output columns (gemm.c) ---- */
#if defined(__AVX512F__)
#define KILN_PANEL 64
#else
#define KILN_PANEL 16
#endif
/* K pairs per bf16 panel: ceil(K / 2) rounded up to 16 (one AMX tile's depth), the pairs past K zero, so
 * the FMA and AMX kernels share one packed copy and a tile never reads past its panel. */
static inline int64_t bf16_panel_pairs(int64_t k) { return ((k + 1) / 2 + 15) / 16 * 16; }
/* K quads per int8 panel (gemm_int8.c, gemm_w8a8.c): half the bf16 pairs, so a widened panel is a bf16 one */
static inline int64_t i8_quads(int64_t k) { return bf16_panel_pairs(k) / 2; }
/* W8A8's blocks of K: one activation scale and one weight column sum each (gemm_w8a8.c, gemm_int8.c) */
#define W8_BLOCK 32
/* K quads -> blocks of one row (the quads are a multiple of 8: the blocks are whole) */
static inline int64_t w8_blocks(int64_t kq) { return kq / (W8_BLOCK / 4); }

/* A per-thread scratch buffer (64-byte aligned, grown in 4 KiB steps, kept across calls so a decode step
 * allocates nothing): each file passes its own __thread buffer and capacity. NULL when allocation fails. */
static inline void *kiln_scratch(void **buf, size_t *cap, size_t need) {
    if (need > *cap) {
        free(*buf);
        need = (need + 4095) / 4096 * 4096;
        *buf = aligned_alloc(64, need);
        *cap = *buf ? need : 0;
    }
    return *buf;
}

/* Row buckets of a tactic table: bucket b holds calls of (2^(b-1), 2^b] rows (b = 0: one row). */
#define KILN_ROW_BUCKETS 16
enum kiln_gemm_kernel { KILN_GEMM_FMA = 0, KILN_GEMM_AMX = 1, KILN_GEMM_W8A8 = 2 /* int8 weights only */,
                        KILN_GEMM_GGUF = 3, KILN_GEMM_GGUF_F32 = 4 /* GGUF block weights only (qtype set) */,
                        KILN_GEMM_W8A8_AMX = 5 /* int8 weights only: W8A8 on AMX-INT8 tiles */ };

/* A packed weight and, per row bucket, the kernel that multiplies it (its tactic table's winners). */
struct kiln_weight {
    const void *panels;   /* kiln_pack_linear_f32 / _bf16 / _i8 */
    const float *scales;  /* int8 weights: one float32 scale per output column (padded to whole panels); else NULL */
    const int16_t *bsums; /* int8 weights: each column's sum per 32-block of K [panels][quads / 8][KILN_PANEL] */
    int64_t n, k;         /* output and input features */
    int32_t bf16;         /* the activations (and outputs) are bf16, else float32 */
    uint8_t kernel[KILN_ROW_BUCKETS]; /* enum kiln_gemm_kernel */
    int32_t qtype;        /* GGUF block weights (gemm_gguf.c): the ggml type (2 Q4_0, 3 Q4_1, 8 Q8_0); else 0 */
};

int kiln_gemm(const struct kiln_weight *w, const void *x, const float *bias, void *y, int64_t m, int64_t ldx,
              int64_t ldy);
void kiln_linear_f32(const float *x, const float *packed, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t ldx, int64_t ldy);
void kiln_linear_bf16(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                      int64_t k, int64_t ldx, int64_t ldy);
int kiln_linear_amx(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m, int64_t n,
                    int64_t k, int64_t ldx, int64_t ldy);
int kiln_amx_ready(void);
int kiln_linear_i8(const void *x, const int8_t *packed, const float *scales, const float *bias, void *y, int64_t m,
                   int64_t n, int64_t k, int64_t ldx, int64_t ldy, int bf16, int amx);
int kiln_w8a8_vnni_running(void);
int kiln_linear_w8a8(const void *x, const int8_t *packed, const float *scales, const int16_t *bsums,
                     const float *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldy, int bf16,
                     int amx);
/* W8A8's sums on AMX-INT8 tiles, rows [0, rows <= 16) of one panel (gemm_w8a8_amx.c; 0 where it may not run) */
KILN_HIDDEN int kiln_w8a8_amx_ready(void);
KILN_HIDDEN void kiln_w8a8_amx_release(void);
KILN_HIDDEN int kiln_w8a8_amx_sums(int rows, const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *w,
                                   int64_t nb, const int16_t *bs, float *f, int *cfg);
void kiln_w8a8_block_sums(const int8_t *packed, int16_t *bsums, int64_t n, int64_t k);
/* a W8A8 register tile (gemm_w8a8.c calls it per row tile and panel): rows [0, R) of the quantized activations
 * (row stride ldq, block scales sx with row stride nb) x one panel (nb blocks, block sums bs) -> y; the
 * 256-bit tiles take up to KILN_W8A8_YMM_MR rows */
#define KILN_W8A8_YMM_MR 4
typedef void (*kiln_w8a8_tile)(const uint8_t *xq, int64_t ldq, const float *sx, const int8_t *w, int64_t nb,
                               const int16_t *bs, const float *scale, const float *bias, void *y, int64_t ldy,
                               int bf16, int ncols);
/* the 256-bit tiles by R = 1..KILN_W8A8_YMM_MR (gemm_w8a8_ymm.c): AVX-VNNI where vnni and the CPU has it, else AVX2; NULL in a library
 * without them */
KILN_HIDDEN const kiln_w8a8_tile *kiln_w8a8_ymm_tiles(int vnni);
/* A GGUF column group on 256-bit vectors (gemm_gguf_ymm.c): R rows of the quantized activations x 16 columns,
 * by R = 1, 2; the caller quantized Q8_0 with the group's offset (kiln_gguf_ymm_off: 128 for AVX-VNNI, else 0) */
typedef void (*kiln_gguf_group)(const int8_t *xq, int64_t ldq, const float *dx, const float *c2, const float *sx,
                                const uint8_t *w, int64_t nb, int qt, float *out);
KILN_HIDDEN const kiln_gguf_group *kiln_gguf_ymm_group(int vnni); /* AVX-VNNI where vnni and the CPU has it, else AVX2 */
KILN_HIDDEN int kiln_gguf_ymm_off(int vnni);               /* the Q8_0 offset that group takes: 128 or 0 */

/* AVX-VNNI's vpdpbusd on ymm (Intel's client parts from Alder Lake on, Sierra Forest: no AVX-512). Built with
 * -DKILN_AVX_VNNI_EVEX (tests on an AVX512-VNNI host without AVX-VNNI: tests/engine/test_ymm_vnni.py), the same
 * tiles take the instruction's EVEX encoding (AVX512VL + AVX512-VNNI) and ask the CPU for that instead. */
#if defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
#if defined(KILN_AVX_VNNI_EVEX) ? (defined(__clang__) || __GNUC__ >= 10)                                             \
                                : ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define KILN_HAVE_YMM_VNNI 1
#endif
#endif
#ifdef KILN_HAVE_YMM_VNNI
#include <cpuid.h> /* the files that use the macros below include <immintrin.h> (costly: not every file here) */
#ifdef KILN_AVX_VNNI_EVEX
#define KILN_YMM_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#else
#define KILN_YMM_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#endif
/* acc += u8 x s8 quads on the instruction's own int32 lanes (gemm_w8a8.c says why the builtin, not the
 * intrinsic, for GCC) */
#if defined(__clang__) && defined(KILN_AVX_VNNI_EVEX)
#define KILN_YMM_DPBUSD(acc, u, s) ((acc) = (__v8si)_mm256_dpbusd_epi32((__m256i)(acc), (u), (s)))
#elif defined(__clang__)
#define KILN_YMM_DPBUSD(acc, u, s) ((acc) = (__v8si)_mm256_dpbusd_avx_epi32((__m256i)(acc), (u), (s)))
#else
#define KILN_YMM_DPBUSD(acc, u, s) ((acc) = __builtin_ia32_vpdpbusd_v8si((acc), (__v8si)(u), (__v8si)(s)))
#endif
/* the CPU runs it, asked once: AVX-VNNI from CPUID (leaf 7, sub-leaf 1, EAX bit 4; older compilers'
 * __builtin_cpu_supports lack its name; the OS keeps the ymm state: the library already runs AVX2), or the EVEX
 * build's two flags. A caller's leave without the CPU's gets AVX2, never a fault. */
static inline int kiln_cpu_ymm_vnni(void) {
    static int cpu = -1;
    if (cpu < 0) {
#ifdef KILN_AVX_VNNI_EVEX
        cpu = __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
        unsigned a, b, c, d;
        cpu = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
#endif
    }
    return cpu;
}
#endif
KILN_HIDDEN int kiln_gguf_linear_f32(const float *x, const uint8_t *w, int qt, const float *bias, float *y,
                                     int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldy);
int kiln_linear_gguf(const void *x, const uint8_t *w, int qt, const float *bias, void *y, int64_t m, int64_t n,
                     int64_t k, int64_t ldx, int64_t ldy, int bf16, int dequant);
/* one panel's rows through each kernel, for the int8 kernels (gemm_int8.c) over a widened copy of the panel */
KILN_HIDDEN void kiln_panel_bf16(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t k, uint16_t *y, int64_t ldy,
                                 const float *scale, const float *bias, int ncols, int64_t m);
KILN_HIDDEN void kiln_panel_f32(const float *x, int64_t ldx, const float *wp, int64_t k0, int64_t kn, float *y,
                                int64_t ldy, const float *scale, const float *bias, int ncols, int64_t m);
KILN_HIDDEN int kiln_panel_amx(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t k, uint16_t *y, int64_t ldy,
                               const float *scale, const float *bias, int ncols, int64_t m, int *cfg);
KILN_HIDDEN void kiln_amx_release(void);

/* ---- the KV cache's layout ----
 * bf16: 0 = float32 cache, 1 = bf16, 2 = bf16 where the host runs vdpbf16ps (the caller says so). A float32
 * cache, and a bf16 one otherwise, keeps K blocks transposed ([d][block_size]) and V blocks as rows; with 2,
 * 16-token blocks and a head size that is a multiple of 32, K blocks are [d/2][16][2] and V blocks
 * [8][d][2] (attention_bf16.c). kiln_cache_write and kiln_paged_attention decide it alike from these. */
#if defined(__x86_64__) && defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#define KILN_HAVE_KV_PAIRS 1
#else
#define KILN_HAVE_KV_PAIRS 0
#endif
static inline int kv_pairs(int bf16, int64_t block_size, int64_t d) {
    return KILN_HAVE_KV_PAIRS && bf16 == 2 && block_size == 16 && d % 32 == 0;
}
KILN_HIDDEN void kiln_scores_pairs(const uint16_t *qb, const uint16_t *kb, float *s, int64_t nq, int64_t stride,
                                   int64_t d, float scale);
KILN_HIDDEN void kiln_values_pairs(float *acc, const uint16_t *vb, const float *p, int64_t n, int64_t nq,
                                   int64_t stride, int64_t d);
KILN_HIDDEN int kiln_scores_amx(const uint16_t *qb, int64_t nq, int64_t d, const uint16_t *k_cache, int64_t base,
                                const int32_t *table, int64_t nblocks, float *scores, int64_t stride);
KILN_HIDDEN int kiln_values_amx(float *acc, const float *p, int64_t stride, int64_t nq, int64_t d,
                                const uint16_t *v_cache, int64_t base, const int32_t *table, int64_t nblocks,
                                int64_t len, uint16_t *pb);

/* ---- the other entry points the decoder stack calls ---- */
int kiln_paged_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                         const int32_t *ctx_lens, const int32_t *row_starts, void *out, int64_t num_groups,
                         int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t d,
                         int64_t bt_stride, int64_t q_stride, int64_t out_stride, float scale, int bf16,
                         int64_t amx_queries);
void kiln_silu_mul(const void *x, void *out, int64_t rows, int64_t n, int64_t x_stride, int64_t out_stride, int bf16);
void kiln_add_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *res_out,
                       int64_t rows, int64_t dim, float eps, int bf16);
void kiln_rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads, int64_t d,
                 int64_t x_stride, int64_t cs_stride, int bf16);
void kiln_cache_write(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
                      int64_t tokens, int64_t kv_heads, int64_t d, int64_t k_stride, int64_t v_stride,
                      int64_t num_blocks, int64_t block_size, int bf16);
#endif
