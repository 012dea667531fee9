/* Quantized matmuls for x86-64 CPUs with AVX2 and FMA, called from Python through ctypes.
 *
 * torch's own weight-only int4/int8 CPU kernels ran at a few GFLOP/s on the 2-core Zen 4 this was
 * built on, so these follow llama.cpp's approach instead: activations are quantized to int8 in
 * blocks of 32 values, and each block's dot product with a block of quantized weights runs on byte
 * multiply-adds (vpmaddubsw, or vpdpbusd where AVX-512 VNNI is present), then is scaled in float.
 *
 * Weight formats (one block = 32 consecutive input features of one output row):
 *   Q4_1: 16 bytes of nibbles (low nibble = element j, high = element j + 16), scale d, minimum m;
 *         value = d * q + m. This is GGUF's Q4_1, so those files load without dequantizing.
 *   Q8_0: 32 signed bytes and a scale d; value = d * q. GGUF's Q8_0.
 * Activations: int8 blocks with a scale each, plus each block's sum (for Q4_1's m term). The sum is
 * of the quantized values, so a Q4_1 product is exactly that of the rounded activations with the
 * weights, and its error stays centred like Q8_0's instead of growing with the blocks' minimum.
 */
#include <math.h>

#include "simd.h"

/* x [M, K] -> xq [M, K] int8, dx [M, K/32] scales, sx [M, K/32] sums of the dequantized blocks. */
void shoal_quantize_blocks(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx) {
    const int64_t G = K / QK;
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t i = 0; i < M * G; i++) {
        const float *src = x + i * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(src + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float a = _mm_cvtss_f32(m);
        const float d = a / 127.0f;
        const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_ROUND_NEAREST));
        const __m256i qsum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        /* pack 4 x 8 int32 -> 32 int8 in order: packs interleave 128-bit lanes, the permute undoes it */
        __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
        __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + i * QK), p);
        dx[i] = d;
        sx[i] = d * hsum(_mm256_cvtepi32_ps(qsum));
    }
}

/* Q4_1 nibbles of one block as 32 unsigned bytes: low nibbles (elements 0-15) in the low lane, high
 * nibbles (16-31) in the high lane. One 16-byte load feeds both lanes; one variable shift splits them. */
static inline __m256i unpack_q4(const uint8_t *q) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

/* 32 products of unsigned w and signed x, summed to 8 int32 lanes, as floats. */
static inline __m256 dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
#endif
    const __m256i p16 = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}


/* Sum over blocks of a[g] * b[g]: Q4_1's minimum term, m * (sum of the block's activations). */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= n; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), acc);
    float s = hsum(acc);
    for (; g < n; g++) s += a[g] * b[g];
    return s;
}

/* y[MT rows, NT columns] for a register tile: MT activation rows share each weight block load and NT
 * weight rows share each activation block load. Called with constant fmt, MT and NT only, so that
 * the compiler unrolls the tile and keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void block_tile(int fmt, int MT, int NT, const int8_t *xq,
                                                             const float *dx, const float *sx, int64_t K,
                                                             const uint8_t *qs, const float *d, const float *mn,
                                                             float *y, int64_t ldy) {
    const int64_t G = K / QK;
    const int64_t wstride = fmt == FORMAT_Q4_1 ? G * 16 : K; /* bytes per weight row */
    __m256 acc[4][4];
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < NT; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i w[4];
        for (int c = 0; c < NT; c++) {
            if (fmt == FORMAT_Q4_1) {
                w[c] = unpack_q4(qs + c * wstride + g * 16);
            } else {
                w[c] = _mm256_loadu_si256((const __m256i *)(qs + c * wstride + g * QK));
            }
        }
        for (int r = 0; r < MT; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + g * QK));
            const __m256 xd = _mm256_broadcast_ss(dx + r * G + g);
            for (int c = 0; c < NT; c++) {
                __m256 p;
                if (fmt == FORMAT_Q4_1)
                    p = dot_u8s8(w[c], x);
                else /* |w| as unsigned; the sign moves onto x */
                    p = dot_u8s8(_mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(x, w[c]));
                acc[r][c] = _mm256_fmadd_ps(p, _mm256_mul_ps(_mm256_broadcast_ss(d + c * G + g), xd), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < NT; c++) {
            float v = hsum(acc[r][c]);
            if (fmt == FORMAT_Q4_1) v += dot_f32(mn + c * G, sx + r * G, G);
            y[r * ldy + c] = v;
        }
}

/* The tile shapes shoal_block_matmul asks for: (MT, NT) for MT = 1..4, with NT its preferred width
 * or 1 at the end of a chunk of output rows. */
#define TILE_CASE(F, MT, NT)                                                                           \
    case MT * 8 + NT:                                                                                  \
        block_tile(F, MT, NT, xq, dx, sx, K, qs, d, mn, y, ldy);                                       \
        return;
#define TILES_NT1(F) TILE_CASE(F, 4, 1) TILE_CASE(F, 3, 1) TILE_CASE(F, 2, 1) TILE_CASE(F, 1, 1)

static void tile_q4_1(int mt, int nt, const int8_t *xq, const float *dx, const float *sx, int64_t K,
                      const uint8_t *qs, const float *d, const float *mn, float *y, int64_t ldy) {
    switch (mt * 8 + nt) {
        TILES_NT1(FORMAT_Q4_1)
        TILE_CASE(FORMAT_Q4_1, 4, 2) TILE_CASE(FORMAT_Q4_1, 3, 2) TILE_CASE(FORMAT_Q4_1, 2, 4) TILE_CASE(FORMAT_Q4_1, 1, 4)
    }
}

static void tile_q8_0(int mt, int nt, const int8_t *xq, const float *dx, const float *sx, int64_t K,
                      const uint8_t *qs, const float *d, const float *mn, float *y, int64_t ldy) {
    switch (mt * 8 + nt) { TILES_NT1(FORMAT_Q8_0) }
}

/* y [M, N] = x @ W^T for W [N, K] in blocks: Q4_1 qs [N, K/32, 16] with d and mn [N, K/32], or Q8_0
 * qs [N, K] with d [N, K/32] (mn unused). x comes block-quantized: xq [M, K], dx and sx [M, K/32]. */
void shoal_block_matmul(int fmt, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                        const void *qs, const float *d, const float *mn, int64_t N, float *y) {
    const int64_t G = K / QK;
    const int64_t wstride = fmt == FORMAT_Q4_1 ? G * 16 : K;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += N_CHUNK) {
        const int64_t n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
            const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
            /* Measured on Zen 4: Q4_1 gains from sharing activation loads across weight rows; Q8_0,
             * whose blocks are twice the bytes, runs fastest one weight row at a time. */
            const int nt = fmt == FORMAT_Q8_0 ? 1 : mt <= 2 ? 4 : 2;
            for (int64_t n = n0; n < n1;) {
                const int t = n + nt <= n1 ? nt : 1;
                const uint8_t *w = (const uint8_t *)qs + n * wstride;
                const float *mnn = mn ? mn + n * G : 0;
                if (fmt == FORMAT_Q4_1)
                    tile_q4_1(mt, t, xq + m0 * K, dx + m0 * G, sx + m0 * G, K, w, d + n * G, mnn, y + m0 * N + n, N);
                else
                    tile_q8_0(mt, t, xq + m0 * K, dx + m0 * G, sx + m0 * G, K, w, d + n * G, mnn, y + m0 * N + n, N);
                n += t;
            }
        }
    }
}

/* Rows multiplied per pass over the weights. Each pass streams its rows' activations once per
 * column tile, so a long prefill's rows fall out of L2: on a Xeon with AMX (2 MB L2), a 2,048-row
 * gate/up projection cost 1.7x a row what 256 rows did. Each pass unpacks the weights again, so
 * passes of 256 made a lone 512-token prompt 6 % dearer; passes of 512 kept it as it was
 * (benchmarks/prefill_batch.py, measured there). Each output row depends on its own input row
 * only, so passes change no bit. */
#define ROWS_PER_PASS 512

/* One call per quantized linear layer: block-quantize x into the caller's scratch, then multiply.
 * format 0: Q4_1 (mn used), 1: Q8_0; 4 and 5: Q4_1 and Q8_0 repacked 8 rows at a time (cpu_q4x8.c). */
void shoal_block_linear(int format, const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx,
                        const void *qs, const float *d, const float *mn, int64_t N, float *y) {
    const int64_t G = K / QK;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
        const int64_t m = M - m0 < ROWS_PER_PASS ? M - m0 : ROWS_PER_PASS;
        const float *xp = x + m0 * K;
        int8_t *xqp = xq + m0 * K;
        float *dxp = dx + m0 * G, *sxp = sx + m0 * G, *yp = y + m0 * N;
        shoal_quantize_blocks(xp, m, K, xqp, dxp, sxp);
        if (format == FORMAT_Q4_1X8 || format == FORMAT_Q8_0X8)
            shoal_x8_matmul(format == FORMAT_Q8_0X8, xqp, dxp, sxp, m, K, (const uint8_t *)qs, d, mn, N, yp);
        else
            shoal_block_matmul(format, xqp, dxp, sxp, m, K, qs, d, mn, N, yp);
    }
}
