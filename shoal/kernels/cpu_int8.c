/* int8 weights with one scale per output row, for small batches (decode).
 *
 * shoal's int8 layers quantize each activation row to int8 with one scale and multiply on
 * torch._int_mm, which is fast for a batch but pays torch's dispatch per call. This computes the
 * same thing bit for bit: the same rounding of the activations (x / scale, round half to even),
 * an exact int32 dot product, then float(acc) * x_scale * w_scale in that order. So a row's result
 * does not depend on which path, or which batch, computed it.
 */
#include "simd.h"

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* x [M, K] -> xq [M, K] int8 and xs [M]: xs = max(|x|, 1e-12) / 127, xq = round(x / xs). K % 32 == 0. */
void shoal_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs) {
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t i = 0; i < M; i++) {
        const float *r = x + i * K;
        float amax = 0.0f;
        for (int64_t j = 0; j < K; j++) amax = r[j] > amax ? r[j] : -r[j] > amax ? -r[j] : amax;
        const float s = (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
        xs[i] = s;
        const __m256 s8 = _mm256_set1_ps(s);
        for (int64_t j = 0; j < K; j += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++)
                q[k] = _mm256_cvtps_epi32(
                    _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(r + j + 8 * k), s8), _MM_FROUND_TO_NEAREST_INT));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(xq + i * K + j), p);
        }
    }
}

/* Signed byte products summed into 8 int32 lanes, exactly (|w| * 127 * 2 fits int16). */
static inline __m256i dot_s8(__m256i aw, __m256i w, __m256i x, __m256i acc) {
    const __m256i sx = _mm256_sign_epi8(x, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, aw, sx);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void int8_tile(int MT, const int8_t *xq, const float *xs, int64_t K,
                                                            const int8_t *w, float scale, float *y, int64_t ldy) {
    __m256i acc[M_TILE];
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < K; j += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + j));
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        for (int r = 0; r < MT; r++)
            acc[r] = dot_s8(aw, wv, _mm256_loadu_si256((const __m256i *)(xq + r * K + j)), acc[r]);
    }
    for (int r = 0; r < MT; r++) y[r * ldy] = (float)hsum_i32(acc[r]) * xs[r] * scale;
}

/* y [M, N] = dequantized (xq @ w^T) for w [N, K] int8 with scale [N]. */
void shoal_int8_matmul(const int8_t *xq, const float *xs, int64_t M, int64_t K, const int8_t *w,
                       const float *scale, int64_t N, float *y) {
#define INT8_TILE(mt, m0, n) int8_tile(mt, xq + (m0) * K, xs + (m0), K, w + (n) * K, scale[n], y + (m0) * N + (n), N)
    PARALLEL_ROW_TILES(M, N, INT8_TILE)
#undef INT8_TILE
}

/* y [M, N] = float(acc) * xs[i] * scale[j]: torch._int_mm's int32 result dequantized in one pass. */
void shoal_int8_rescale(const int32_t *acc, const float *xs, const float *scale, int64_t M, int64_t N, float *y) {
#pragma omp parallel for schedule(static) if (M * N > 65536)
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) y[i * N + j] = (float)acc[i * N + j] * xs[i] * scale[j];
}

void shoal_int8_linear(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, const int8_t *w,
                       const float *scale, int64_t N, float *y) {
    shoal_quantize_rows(x, M, K, xq, xs);
    shoal_int8_matmul(xq, xs, M, K, w, scale, N, y);
}
