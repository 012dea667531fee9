/* Quantized matmuls for x86-64 CPUs with AVX2 and FMA, called from Python through ctypes.
 *
 * torch's own weight-only int4/int8 CPU kernels run at a few GFLOP/s on a CPU without AVX-512,
 * so these follow llama.cpp's approach instead: activations are quantized to int8 in blocks of
 * 32 values, and each block's dot product with a block of quantized weights runs on byte
 * multiply-adds (vpmaddubsw), then is scaled in float.
 *
 * Weight formats (one block = 32 consecutive input features of one output row):
 *   Q4_1: 16 bytes of nibbles (low nibble = element j, high = element j + 16), scale d, minimum m;
 *         value = d * q + m. This is GGUF's Q4_1, so those files load without dequantizing.
 *   Q8_0: 32 signed bytes and a scale d; value = d * q. GGUF's Q8_0.
 * Activations: int8 blocks with a scale each, plus each block's sum (for Q4_1's m term). The sum is
 * of the quantized values, so a Q4_1 product is exactly that of the rounded activations with the
 * weights, and its error stays centred like Q8_0's instead of growing with the blocks' minimum.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define QK 32
#define N_CHUNK 16 /* output rows per unit of parallel work: their weights stay in L1/L2 */
#define M_TILE 4   /* activation rows that share one load of a weight block */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

static inline __m256i unpack_q4(const uint8_t *q) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    return _mm256_set_m128i(hi, lo);
}

/* 32 products of unsigned w and signed x, summed to 8 int32 lanes, as floats. */
static inline __m256 dot_u8s8(__m256i w, __m256i x) {
    const __m256i p16 = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

static inline __attribute__((always_inline)) void q4_1_rows(const int8_t *xq, const float *dx, const float *sx, int mt, int64_t K,
                             const uint8_t *qs, const float *d, const float *mn, float *y, int64_t ldy) {
    const int64_t G = K / QK;
    __m256 acc[M_TILE];
    float macc[M_TILE];
    for (int r = 0; r < M_TILE; r++) {
        acc[r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    for (int64_t g = 0; g < G; g++) {
        const __m256i w = unpack_q4(qs + g * 16);
        for (int r = 0; r < mt; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + g * QK));
            acc[r] = _mm256_fmadd_ps(dot_u8s8(w, x), _mm256_set1_ps(d[g] * dx[r * G + g]), acc[r]);
            macc[r] += mn[g] * sx[r * G + g];
        }
    }
    for (int r = 0; r < mt; r++) y[r * ldy] = hsum(acc[r]) + macc[r];
}

/* y [M, N] = x @ W^T for W [N, K] in Q4_1 blocks: qs [N, K/32, 16], d and mn [N, K/32]. */
void shoal_q4_1_matmul(const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                       const uint8_t *qs, const float *d, const float *mn, int64_t N, float *y) {
    const int64_t G = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += N_CHUNK) {
        const int64_t n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
            const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
            for (int64_t n = n0; n < n1; n++) {
                /* a constant tile size lets the compiler keep the accumulators in registers */
                if (mt == M_TILE)
                    q4_1_rows(xq + m0 * K, dx + m0 * G, sx + m0 * G, M_TILE, K, qs + n * G * 16, d + n * G,
                              mn + n * G, y + m0 * N + n, N);
                else
                    q4_1_rows(xq + m0 * K, dx + m0 * G, sx + m0 * G, mt, K, qs + n * G * 16, d + n * G,
                              mn + n * G, y + m0 * N + n, N);
            }
        }
    }
}

static inline __attribute__((always_inline)) void q8_0_rows(const int8_t *xq, const float *dx, int mt, int64_t K, const int8_t *qs,
                             const float *d, float *y, int64_t ldy) {
    const int64_t G = K / QK;
    __m256 acc[M_TILE];
    for (int r = 0; r < M_TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + g * QK));
        const __m256i aw = _mm256_sign_epi8(w, w); /* |w| as unsigned; the sign moves onto x */
        for (int r = 0; r < mt; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + g * QK));
            acc[r] = _mm256_fmadd_ps(dot_u8s8(aw, _mm256_sign_epi8(x, w)), _mm256_set1_ps(d[g] * dx[r * G + g]),
                                     acc[r]);
        }
    }
    for (int r = 0; r < mt; r++) y[r * ldy] = hsum(acc[r]);
}

/* y [M, N] = x @ W^T for W [N, K] in Q8_0 blocks: qs [N, K], d [N, K/32]. */
void shoal_q8_0_matmul(const int8_t *xq, const float *dx, int64_t M, int64_t K, const int8_t *qs,
                       const float *d, int64_t N, float *y) {
    const int64_t G = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += N_CHUNK) {
        const int64_t n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
            const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
            for (int64_t n = n0; n < n1; n++) {
                if (mt == M_TILE)
                    q8_0_rows(xq + m0 * K, dx + m0 * G, M_TILE, K, qs + n * K, d + n * G, y + m0 * N + n, N);
                else
                    q8_0_rows(xq + m0 * K, dx + m0 * G, mt, K, qs + n * K, d + n * G, y + m0 * N + n, N);
            }
        }
    }
}

/* One call per quantized linear layer: block-quantize x into the caller's scratch, then multiply.
 * format 0: Q4_1 (mn used), 1: Q8_0. */
void shoal_block_linear(int format, const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx,
                        const void *qs, const float *d, const float *mn, int64_t N, float *y) {
    shoal_quantize_blocks(x, M, K, xq, dx, sx);
    if (format == 0)
        shoal_q4_1_matmul(xq, dx, sx, M, K, (const uint8_t *)qs, d, mn, N, y);
    else
        shoal_q8_0_matmul(xq, dx, M, K, (const int8_t *)qs, d, N, y);
}
