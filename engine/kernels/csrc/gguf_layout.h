/* The GGUF block records kiln packs (gemm_gguf.c: the multiply; gguf_pack.c: packing and dequantizing):
 * the ggml type numbers, the record and file block sizes, and half -> float. */
#ifndef KILN_GGUF_LAYOUT_H
#define KILN_GGUF_LAYOUT_H
#include "kiln_cpu.h"

#define GG_Q4_0 2
#define GG_Q4_1 3
#define GG_Q8_0 8
#define GG_COLS 16
#define GG_KC 1024 /* K rows of a panel dequantized at a time (f32 mode) */

static inline int64_t gg_record(int qt) { return qt == GG_Q8_0 ? 544 : qt == GG_Q4_0 ? 288 : 320; }
static inline int64_t gg_file_block(int qt) { return qt == GG_Q8_0 ? 34 : qt == GG_Q4_0 ? 18 : 20; }
static inline int64_t gg_qbytes(int qt) { return qt == GG_Q8_0 ? 512 : 256; }

static inline float gg_h2f(uint16_t h) { /* IEEE half -> float */
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    if (e == 0) {
        if (!m) u = s;
        else {
            float f = (float)m * (1.0f / 16777216.0f);
            memcpy(&u, &f, 4);
            u |= s;
        }
    } else if (e == 31) u = s | 0x7f800000u | (m << 13);
    else u = s | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
