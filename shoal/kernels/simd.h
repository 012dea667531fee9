/* Helpers shared by the CPU kernels (x86-64, AVX2). */
#ifndef SHOAL_SIMD_H
#define SHOAL_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#include "shoal_abi.h" /* the structs, ids and prototypes every kernel file shares */

#define QK 32      /* elements per Q4_1 and Q8_0 block, as in GGUF */
#define N_CHUNK 16 /* output rows per unit of parallel work: their weights stay in L1/L2 */
#define M_TILE 4   /* activation rows that share one load of a weight row */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y [M, N] in tiles of up to M_TILE activation rows by one weight row, output rows split across
 * threads N_CHUNK at a time. TILE(mt, m0, n) computes rows m0..m0+mt of column n; mt is a literal
 * in each expansion, so each tile keeps its accumulators in registers. */
#define PARALLEL_ROW_TILES(M, N, TILE)                                                                 \
    _Pragma("omp parallel for schedule(static)") for (int64_t n0 = 0; n0 < (N); n0 += N_CHUNK) {       \
        const int64_t n1 = n0 + N_CHUNK < (N) ? n0 + N_CHUNK : (N);                                    \
        for (int64_t m0 = 0; m0 < (M); m0 += M_TILE) {                                                 \
            const int64_t mt = (M) - m0 < M_TILE ? (M) - m0 : M_TILE;                                  \
            for (int64_t n = n0; n < n1; n++) {                                                        \
                switch (mt) {                                                                          \
                case 4: TILE(4, m0, n); break;                                                         \
                case 3: TILE(3, m0, n); break;                                                         \
                case 2: TILE(2, m0, n); break;                                                         \
                default: TILE(1, m0, n);                                                               \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }

#if defined(__AVX512F__)
/* Two 256-bit halves from two places as one 512-bit register. */
static inline __m512i load_pair(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512 load_pair_ps(const float *a, const float *b) {
    return _mm512_castsi512_ps(load_pair(a, b));
}
#endif

#endif
