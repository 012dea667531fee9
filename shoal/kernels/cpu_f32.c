/* float32 linear layers for small batches (decode).
 *
 * At a few rows a linear layer is a matrix-vector product bound by reading the weights; torch's
 * CPU matmul reached about 10 GB/s of weights at one row on the 2-core Zen 4 this was measured on,
 * against 32 GB/s for this plain loop (the machine's memory bandwidth).
 */
#include "simd.h"

/* MT rows of x against one weight row, two accumulators each to hide the FMA latency. */
static inline __attribute__((always_inline)) void f32_tile(int MT, const float *x, int64_t K, const float *w,
                                                           float *y, int64_t ldy) {
    __m256 a[M_TILE][2];
    for (int r = 0; r < MT; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (int r = 0; r < MT; r++) {
            a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), a[r][1]);
        }
    }
    for (int r = 0; r < MT; r++) {
        float s = hsum(_mm256_add_ps(a[r][0], a[r][1]));
        for (int64_t j = k; j < K; j++) s += w[j] * x[r * K + j];
        y[r * ldy] = s;
    }
}

/* y [M, N] = x [M, K] @ w^T for w [N, K]. */
void shoal_f32_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
#define F32_TILE(mt, m0, n) f32_tile(mt, x + (m0) * K, K, w + (n) * K, y + (m0) * N + (n), N)
    PARALLEL_ROW_TILES(M, N, F32_TILE)
#undef F32_TILE
}
