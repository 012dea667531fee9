/* float32 linear layers for small batches (decode).
 *
 * At a few rows a linear layer is a matrix-vector product bound by reading the weights; torch's
 * CPU matmul reached about 10 GB/s of weights at one row on the 2-core Zen 4 this was measured on,
 * against 32 GB/s for this plain loop (the machine's memory bandwidth).
 */
#include <immintrin.h>
#include <stdint.h>

#define N_CHUNK 16
#define M_TILE 4

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += N_CHUNK) {
        const int64_t n1 = n0 + N_CHUNK < N ? n0 + N_CHUNK : N;
        for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
            const int64_t mt = M - m0 < M_TILE ? M - m0 : M_TILE;
            for (int64_t n = n0; n < n1; n++) {
                const float *xr = x + m0 * K, *wr = w + n * K;
                float *yr = y + m0 * N + n;
                switch (mt) { /* constant tile heights keep the accumulators in registers */
                case 4: f32_tile(4, xr, K, wr, yr, N); break;
                case 3: f32_tile(3, xr, K, wr, yr, N); break;
                case 2: f32_tile(2, xr, K, wr, yr, N); break;
                default: f32_tile(1, xr, K, wr, yr, N);
                }
            }
        }
    }
}
