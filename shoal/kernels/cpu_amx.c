/* The repacked Q4_1 and Q8_0 layouts (cpu_x8.c) on AMX tile multiplies, where the CPU and the kernel
 * allow them.
 *
 * A repacked tile's block is already in the layout AMX wants for its second operand: row s of it
 * holds bytes 4s..4s+3 of each output row. Two adjacent tiles side by side make one 16-column
 * operand (8 rows of 64 bytes per block of 32 elements); the activations' block-quantized bytes are
 * the first operand as they lie in memory (16 rows of 32 bytes, stride K). One tile multiply then
 * gives the exact int32 sums of 16 activation rows by 16 output rows for one block, which vpdpbusd
 * takes 128 instructions for. The sums are the same integers as cpu_x8.c's, and they are scaled with
 * the same float operations in the same order, so every output is bit-identical to its kernels.
 *
 * Per block the sums must be scaled before the next block adds in (each block has its own scales),
 * so the tile multiplies of a run of blocks go first, into a buffer, and the float work follows. */
#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Mirrors the permission Linux grants the whole process once; set by shoal_amx_enable at load. */
static int amx_permitted;

/* Asks Linux for the AMX register state (needed once per process); 1 if granted. */
int shoal_amx_enable(void) {
    amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permitted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0 and 1: activations (16 rows of a block's 32 bytes); 2 and 3: weights (8 rows of 64 bytes);
 * 4 and 5: sums (16 x 16 int32). Even blocks use the first of each, odd ones the second. */
static void configure_tiles(void) {
    TileConfig c = {0};
    c.palette = 1;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = 16, c.colsb[i] = QK;
        c.rows[2 + i] = QK / 4, c.colsb[2 + i] = 64;
        c.rows[4 + i] = 16, c.colsb[4 + i] = 64;
    }
    _tile_loadconfig(&c);
}

/* Block g of tiles t and t+1 (at wa and wb) as one AMX weight operand: [8][64] bytes. */
static inline void unpack_block(int q8, const uint8_t *wa, const uint8_t *wb, int64_t g, uint8_t *out) {
    if (q8) {
        for (int s = 0; s < 8; s++) {
            _mm512_store_si512(out + 64 * s, load_pair(wa + g * 256 + 32 * s, wb + g * 256 + 32 * s));
        }
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int s = 0; s < 4; s++) {
        const __m512i raw = load_pair(wa + g * 128 + 32 * s, wb + g * 128 + 32 * s);
        _mm512_store_si512(out + 64 * s, _mm512_and_si512(raw, low));
        _mm512_store_si512(out + 64 * (4 + s), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
}

#define RUN 16 /* blocks whose integer sums are buffered before they are scaled: 16 KB */

/* Sums of 16 activation rows (xq, stride K) by n blocks' unpacked weights, into sums [n][16][16]:
 * all the tile multiplies first, alternating registers so consecutive blocks do not wait on each
 * other, then the float work reads them back (a tile store read at once stalls the loads). */
static void tile_sums(const int8_t *xq, int64_t K, int64_t g0, int n, const uint8_t *w, int32_t *sums) {
    int g = 0;
    for (; g + 1 < n; g += 2) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_loadd(0, xq + (g0 + g) * QK, K);
        _tile_loadd(2, w + g * 512, 64);
        _tile_loadd(1, xq + (g0 + g + 1) * QK, K);
        _tile_loadd(3, w + (g + 1) * 512, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_dpbssd(5, 1, 3);
        _tile_stored(4, sums + g * 256, 64);
        _tile_stored(5, sums + (g + 1) * 256, 64);
    }
    if (g < n) {
        _tile_zero(4);
        _tile_loadd(0, xq + (g0 + g) * QK, K);
        _tile_loadd(2, w + g * 512, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_stored(4, sums + g * 256, 64);
    }
}

/* y's MT rows (for the pair's 16 columns) += the scaled sums of blocks g0..g0+n (= instead where
 * first): each row's float operations in the order of cpu_x8.c's. */
static inline __attribute__((always_inline)) void scale_run(int MT, int q8, int first, const int32_t *sums,
                                                            const float *dx, const float *sx, int64_t G,
                                                            int64_t g0, int n, const float *da, const float *db,
                                                            const float *ma, const float *mb, float *y,
                                                            int64_t ldy) {
    __m512 acc[16];
    for (int r = 0; r < MT; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy);
    for (int g = 0; g < n; g++) {
        const int64_t b = g0 + g;
        const __m512 d16 = load_pair_ps(da + b * 8, db + b * 8);
        const __m512 m16 = q8 ? d16 : load_pair_ps(ma + b * 8, mb + b * 8);
        for (int r = 0; r < MT; r++) {
            const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + (g * 16 + r) * 16));
            acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(d16, _mm512_set1_ps(dx[r * G + b])), acc[r]);
            if (!q8) acc[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(sx[r * G + b]), acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

static void scale_rows(int mt, int q8, int first, const int32_t *sums, const float *dx, const float *sx,
                       int64_t G, int64_t g0, int n, const float *da, const float *db, const float *ma,
                       const float *mb, float *y, int64_t ldy) {
#define SCALE(R)                                                                                          \
    case R:                                                                                               \
        if (q8) scale_run(R, 1, first, sums, dx, sx, G, g0, n, da, db, ma, mb, y, ldy);                   \
        else scale_run(R, 0, first, sums, dx, sx, G, g0, n, da, db, ma, mb, y, ldy);                      \
        break;
    switch (mt) {
        SCALE(16) SCALE(15) SCALE(14) SCALE(13) SCALE(12) SCALE(11) SCALE(10) SCALE(9)
        SCALE(8) SCALE(7) SCALE(6) SCALE(5) SCALE(4) SCALE(3) SCALE(2) SCALE(1)
    }
#undef SCALE
}

/* The tile pairs of shoal_x8_matmul on AMX, for all M rows; returns how many of the N/8 tiles it
 * computed (0 where AMX is not permitted; an odd last tile is left to the 8-row kernels). */
int64_t shoal_amx_x8_matmul(int q8, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                            const uint8_t *qs, const float *d, const float *mn, int64_t N, float *y) {
    if (!amx_permitted) return 0;
    const int64_t G = K / QK, pairs = N / 16, tile_bytes = G * (q8 ? 256 : 128);
    const int64_t full = M & ~(int64_t)15;
    /* A tile always loads 16 rows: the last few go through a zero-padded copy. */
    int8_t *tail = 0;
    if (M > full) {
        tail = calloc(16 * K, 1);
        if (!tail) return 0;
        memcpy(tail, xq + full * K, (M - full) * K);
    }
#pragma omp parallel
    {
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            uint8_t w[RUN * 512] __attribute__((aligned(64)));
            int32_t sums[RUN * 256] __attribute__((aligned(64)));
            const int64_t t = 2 * p;
            const uint8_t *wa = qs + t * tile_bytes, *wb = wa + tile_bytes;
            const float *da = d + t * G * 8, *db = da + G * 8;
            const float *ma = q8 ? 0 : mn + t * G * 8, *mb = q8 ? 0 : ma + G * 8;
            for (int64_t g0 = 0; g0 < G; g0 += RUN) {
                const int n = (int)(G - g0 < RUN ? G - g0 : RUN);
                for (int g = 0; g < n; g++) unpack_block(q8, wa, wb, g0 + g, w + g * 512);
                for (int64_t m0 = 0; m0 < M; m0 += 16) {
                    const int mt = (int)(M - m0 < 16 ? M - m0 : 16);
                    tile_sums(m0 < full ? xq + m0 * K : tail, K, g0, n, w, sums);
                    scale_rows(mt, q8, g0 == 0, sums, dx + m0 * G, sx + m0 * G, G, g0, n, da, db, ma, mb,
                               y + m0 * N + t * 8, N);
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return pairs * 2;
}

#else
int shoal_amx_enable(void) { return 0; }

int64_t shoal_amx_x8_matmul(int q8, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                            const uint8_t *qs, const float *d, const float *mn, int64_t N, float *y) {
    return 0;
}
#endif
