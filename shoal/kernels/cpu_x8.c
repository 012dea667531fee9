/* Q4_1 and Q8_0 weights repacked eight output rows at a time, so one byte multiply-add serves eight rows.
 *
 * In GGUF's layout each output row's block is its own 16 bytes, and every (row, block) pair pays
 * for its own int->float conversion, scale multiply and final horizontal sum. Here the blocks of
 * 8 consecutive rows are interleaved in 4-byte groups: register s (s = 0..3) of a block holds, for
 * each of the 8 rows, bytes 4s..4s+3 of that row's block (low nibbles: elements 4s..4s+3, high
 * nibbles: elements 16+4s..16+4s+3). Broadcasting 4 activation bytes against it yields 8 rows'
 * partial dot products in the 8 int32 lanes of one register: no horizontal sums, and the scale
 * and minimum of 8 rows apply in one FMA each per block.
 *
 * Layout, for N % 8 == 0 (quant.py repacks at load): qs [N/8, G, 4, 8, 4] bytes, d and mn
 * [N/8, G, 8] floats. Activations as shoal_quantize_blocks leaves them. Integer sums are exact in
 * AVX2 and VNNI builds alike, and each row's float operations run in the same order whatever the
 * batch, so a row's result does not depend on the other rows computed with it.
 */
#include "simd.h"

#define CHUNK8 4 /* tiles of 8 output rows per unit of parallel work (32 rows: ~9 KB of weights) */
/* Activation rows from which AMX tiles (cpu_amx.c) beat vpdpbusd, measured on a 2-core Xeon with
 * AMX: Q4_1's 16-column tiles from 16 rows (12 was a draw), Q8_0's from 8. */
#define AMX_MIN_ROWS_Q4 16
#define AMX_MIN_ROWS_Q8 8

/* 8 rows' sums of u4 weights (lo or hi nibbles of w) times 4 broadcast activation bytes, added to acc. */
static inline __m256i dot8(__m256i w, __m256i x4, __m256i acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x4);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x4), _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void q4x8_tile(int MT, const int8_t *xq, const float *dx,
                                                            const float *sx, int64_t K, const uint8_t *qs,
                                                            const float *d, const float *mn, float *y,
                                                            int64_t ldy) {
    const int64_t G = K / QK;
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[4];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *blk = qs + g * 128;
        __m256i lo[4], hi[4];
        for (int s = 0; s < 4; s++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 32 * s));
            lo[s] = _mm256_and_si256(raw, low);
            hi[s] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        const __m256 d8 = _mm256_loadu_ps(d + g * 8);
        const __m256 m8 = _mm256_loadu_ps(mn + g * 8);
        for (int r = 0; r < MT; r++) {
            const int32_t *x = (const int32_t *)(xq + r * K + g * QK);
            __m256i isum = _mm256_setzero_si256();
            for (int s = 0; s < 4; s++) {
                isum = dot8(lo[s], _mm256_set1_epi32(x[s]), isum);
                isum = dot8(hi[s], _mm256_set1_epi32(x[4 + s]), isum);
            }
            const __m256 scale = _mm256_mul_ps(d8, _mm256_broadcast_ss(dx + r * G + g));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
            acc[r] = _mm256_fmadd_ps(m8, _mm256_broadcast_ss(sx + r * G + g), acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

/* Q8_0 repacked the same way: register s (s = 0..7) of a block holds bytes 4s..4s+3 of each of the
 * 8 rows' blocks: qs [N/8, G, 8, 8, 4], d [N/8, G, 8]. The signs move onto the activations, as in
 * cpu_quant.c, so the byte multiply-add sees unsigned weights. */
static inline __attribute__((always_inline)) void q8x8_tile(int MT, const int8_t *xq, const float *dx, int64_t K,
                                                            const int8_t *qs, const float *d, float *y,
                                                            int64_t ldy) {
    const int64_t G = K / QK;
    __m256 acc[4];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *blk = qs + g * 256;
        const __m256 d8 = _mm256_loadu_ps(d + g * 8);
        for (int r = 0; r < MT; r++) {
            const int32_t *x = (const int32_t *)(xq + r * K + g * QK);
            __m256i isum = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 32 * s));
                const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x[s]), w);
                isum = dot8(_mm256_sign_epi8(w, w), sx, isum);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_broadcast_ss(dx + r * G + g)),
                                     acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Activation rows per 16-row tile: 32 registers hold their accumulators beside the unpacked weights,
 * so the weights' unpacking is shared by twice the rows of the 8-row tiles. */
#define M_TILE16 8

/* Two adjacent tiles (16 output rows) in one 512-bit register (load_pair, simd.h): the same per-lane
 * operations as the 8-row tiles above, in the same order, so every output is bit-identical to
 * theirs; half the instructions per multiply-add, which is what a batch of decode rows is bound by. */
static inline __attribute__((always_inline)) void q4x16_tile(int MT, const int8_t *xq, const float *dx,
                                                             const float *sx, int64_t K, const uint8_t *qa,
                                                             const uint8_t *qb, const float *da, const float *db,
                                                             const float *ma, const float *mb, float *y,
                                                             int64_t ldy) {
    const int64_t G = K / QK;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[M_TILE16];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i lo[4], hi[4];
        for (int s = 0; s < 4; s++) {
            const __m512i raw = load_pair(qa + g * 128 + 32 * s, qb + g * 128 + 32 * s);
            lo[s] = _mm512_and_si512(raw, low);
            hi[s] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        const __m512 d16 = load_pair_ps(da + g * 8, db + g * 8);
        const __m512 m16 = load_pair_ps(ma + g * 8, mb + g * 8);
        for (int r = 0; r < MT; r++) {
            const int32_t *x = (const int32_t *)(xq + r * K + g * QK);
            __m512i isum = _mm512_setzero_si512();
            for (int s = 0; s < 4; s++) {
                isum = _mm512_dpbusd_epi32(isum, lo[s], _mm512_set1_epi32(x[s]));
                isum = _mm512_dpbusd_epi32(isum, hi[s], _mm512_set1_epi32(x[4 + s]));
            }
            const __m512 scale = _mm512_mul_ps(d16, _mm512_set1_ps(dx[r * G + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(sx[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* AVX-512 has no byte sign instruction: the weights' signs move onto the activations by negating
 * the activation bytes under the weights' sign mask (where a weight is 0 its magnitude is 0, so
 * what vpsignb would zero contributes nothing either way). */
static inline __attribute__((always_inline)) void q8x16_tile(int MT, const int8_t *xq, const float *dx, int64_t K,
                                                             const int8_t *qa, const int8_t *qb, const float *da,
                                                             const float *db, float *y, int64_t ldy) {
    const int64_t G = K / QK;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[M_TILE16];
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i mag[8];
        __mmask64 neg[8];
        for (int s = 0; s < 8; s++) {
            const __m512i w = load_pair(qa + g * 256 + 32 * s, qb + g * 256 + 32 * s);
            mag[s] = _mm512_abs_epi8(w);
            neg[s] = _mm512_movepi8_mask(w);
        }
        const __m512 d16 = load_pair_ps(da + g * 8, db + g * 8);
        for (int r = 0; r < MT; r++) {
            const int32_t *x = (const int32_t *)(xq + r * K + g * QK);
            __m512i isum = _mm512_setzero_si512();
            for (int s = 0; s < 8; s++) {
                const __m512i xb = _mm512_set1_epi32(x[s]);
                isum = _mm512_dpbusd_epi32(isum, mag[s], _mm512_mask_sub_epi8(xb, neg[s], zero, xb));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d16, _mm512_set1_ps(dx[r * G + g])),
                                     acc[r]);
        }
    }
    for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* Tiles t and t+1 of rows m0.. (mt of them) as one 16-row tile. */
static void x16_tiles(int q8, int mt, const int8_t *x, const float *dxm, const float *sxm, int64_t K,
                      const uint8_t *wa, const uint8_t *wb, const float *da, const float *db, const float *ma,
                      const float *mb, float *yt, int64_t N) {
    if (q8) {
        const int8_t *qa = (const int8_t *)wa, *qb = (const int8_t *)wb;
        switch (mt) {
#define Q8_ROWS(n) case n: q8x16_tile(n, x, dxm, K, qa, qb, da, db, yt, N); break;
        Q8_ROWS(8) Q8_ROWS(7) Q8_ROWS(6) Q8_ROWS(5) Q8_ROWS(4) Q8_ROWS(3) Q8_ROWS(2)
        default: q8x16_tile(1, x, dxm, K, qa, qb, da, db, yt, N);
        }
        return;
    }
    switch (mt) {
#define Q4_ROWS(n) case n: q4x16_tile(n, x, dxm, sxm, K, wa, wb, da, db, ma, mb, yt, N); break;
        Q4_ROWS(8) Q4_ROWS(7) Q4_ROWS(6) Q4_ROWS(5) Q4_ROWS(4) Q4_ROWS(3) Q4_ROWS(2)
    default: q4x16_tile(1, x, dxm, sxm, K, wa, wb, da, db, ma, mb, yt, N);
    }
}
#define TILE_STEP 2
#else
#define TILE_STEP 1
#endif

/* Rows 0..M of y for tiles first..N/8 (see shoal_x8_matmul), on AVX2 or AVX-512. */
static void x8_tiles(int q8, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                     const uint8_t *qs, const float *d, const float *mn, int64_t N, float *y, int64_t first) {
    const int64_t G = K / QK, tiles = N / 8, tile_bytes = G * (q8 ? 256 : 128);
#pragma omp parallel for schedule(static)
    for (int64_t t0 = first; t0 < tiles; t0 += CHUNK8) {
        const int64_t t1 = t0 + CHUNK8 < tiles ? t0 + CHUNK8 : tiles;
        int64_t single = t0; /* the first tile the 8-row kernels take */
#if TILE_STEP == 2
        single = t0 + ((t1 - t0) & ~(int64_t)1);
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE16) {
            const int mt = (int)(M - m0 < M_TILE16 ? M - m0 : M_TILE16);
            for (int64_t t = t0; t < single; t += 2) {
                const uint8_t *w = qs + t * tile_bytes;
                const float *dt = d + t * G * 8, *mt8 = q8 ? 0 : mn + t * G * 8;
                x16_tiles(q8, mt, xq + m0 * K, dx + m0 * G, sx + m0 * G, K, w, w + tile_bytes, dt, dt + G * 8, mt8,
                          q8 ? 0 : mt8 + G * 8, y + m0 * N + t * 8, N);
            }
        }
#endif
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
            const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
            for (int64_t t = single; t < t1; t++) {
                const uint8_t *w = qs + t * tile_bytes;
                const float *dt = d + t * G * 8, *mt8 = q8 ? 0 : mn + t * G * 8;
                const int8_t *x = xq + m0 * K;
                const float *dxm = dx + m0 * G, *sxm = sx + m0 * G;
                float *yt = y + m0 * N + t * 8;
                if (q8) {
                    switch (mt) {
                    case 4: q8x8_tile(4, x, dxm, K, (const int8_t *)w, dt, yt, N); break;
                    case 3: q8x8_tile(3, x, dxm, K, (const int8_t *)w, dt, yt, N); break;
                    case 2: q8x8_tile(2, x, dxm, K, (const int8_t *)w, dt, yt, N); break;
                    default: q8x8_tile(1, x, dxm, K, (const int8_t *)w, dt, yt, N);
                    }
                    continue;
                }
                switch (mt) {
                case 4: q4x8_tile(4, x, dxm, sxm, K, w, dt, mt8, yt, N); break;
                case 3: q4x8_tile(3, x, dxm, sxm, K, w, dt, mt8, yt, N); break;
                case 2: q4x8_tile(2, x, dxm, sxm, K, w, dt, mt8, yt, N); break;
                default: q4x8_tile(1, x, dxm, sxm, K, w, dt, mt8, yt, N);
                }
            }
        }
    }
}

/* y [M, N] = x @ W^T for W [N, K] repacked as above; x block-quantized: xq [M, K], dx, sx [M, K/32].
 * q8: Q8_0 repacked (sx and mn unused), else Q4_1 repacked. Where AMX is on, whole groups of 16 rows
 * (and a last group of at least AMX_MIN_ROWS, zero-padded) go to its tiles and the rest stays here;
 * the results are the same bits either way. */
void shoal_x8_matmul(int q8, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                     const uint8_t *qs, const float *d, const float *mn, int64_t N, float *y) {
    const int64_t G = K / QK, min_rows = q8 ? AMX_MIN_ROWS_Q8 : AMX_MIN_ROWS_Q4;
    const int64_t amx_rows = M < min_rows ? 0 : M % 16 < min_rows ? M & ~(int64_t)15 : M;
    const int64_t done = amx_rows ? shoal_amx_x8_matmul(q8, xq, dx, sx, amx_rows, K, qs, d, mn, N, y) : 0;
    const int64_t rest = done ? amx_rows : 0;
    if (done) x8_tiles(q8, xq, dx, sx, amx_rows, K, qs, d, mn, N, y, done); /* an odd last tile */
    if (rest < M)
        x8_tiles(q8, xq + rest * K, dx + rest * G, sx + rest * G, M - rest, K, qs, d, mn, N, y + rest * N, 0);
}
