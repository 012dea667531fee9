/* Small fused float32 ops for the CPU decode step, where torch's per-op overhead costs more than
 * the arithmetic: RMSNorm with the residual add folded in, and paged decode attention. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* If delta: x += delta (in place, the residual stream). Then out = x / rms(x) * w. Rows of H. */
void shoal_add_rms_norm(float *x, const float *delta, const float *w, int64_t M, int64_t H, float eps,
                        float *out) {
#pragma omp parallel for schedule(static) if (M > 16)
    for (int64_t i = 0; i < M; i++) {
        float *r = x + i * H;
        double ss = 0.0;
        for (int64_t j = 0; j < H; j++) {
            if (delta) r[j] += delta[i * H + j];
            ss += (double)r[j] * r[j];
        }
        const float inv = 1.0f / sqrtf((float)(ss / H) + eps);
        float *o = out + i * H;
        for (int64_t j = 0; j < H; j++) o[j] = r[j] * inv * w[j];
    }
}

/* out [M, I] = silu(gu[:, :I]) * gu[:, I:]  for gu [M, 2I]. */
void shoal_silu_mul(const float *gu, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M > 16)
    for (int64_t i = 0; i < M; i++) {
        const float *g = gu + i * 2 * I, *u = g + I;
        float *o = out + i * I;
        for (int64_t j = 0; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* One query token per sequence attending to its paged context.
 * q [B, Hq, D] with q_stride floats from one sequence's row to the next; caches [slots, Hk, D] with slot = block * bs + offset; tables [B, max_blocks];
 * lens [B]: keys attended (the last len - window dropped when window > 0). out [B, Hq, D].
 * Online softmax in one pass over the keys; D <= 256. */
void shoal_paged_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                                  int64_t Hq, int64_t Hk, int64_t D, int64_t bs, int64_t window, float scale,
                                  float *out) {
    const int64_t group = Hq / Hk;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hq; h++) {
            const float *qv = q + b * q_stride + h * D;
            const int64_t kh = h / group;
            const int64_t len = lens[b];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            float acc[256];
            memset(acc, 0, sizeof(float) * D);
            float mx = -INFINITY, denom = 0.0f;
            for (int64_t t = start; t < len; t++) {
                const int64_t slot = tables[b * max_blocks + t / bs] * bs + t % bs;
                const float *kv = k_cache + (slot * Hk + kh) * D;
                __m256 s8 = _mm256_setzero_ps();
                int64_t j = 0;
                for (; j + 8 <= D; j += 8) s8 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + j), _mm256_loadu_ps(kv + j), s8);
                float s = hsum8(s8);
                for (; j < D; j++) s += qv[j] * kv[j];
                s *= scale;
                const float *vv = v_cache + (slot * Hk + kh) * D;
                if (s > mx) {
                    const float c = expf(mx - s); /* rescale what was summed under the old max */
                    denom *= c;
                    for (j = 0; j < D; j++) acc[j] *= c;
                    mx = s;
                }
                const float p = expf(s - mx);
                denom += p;
                const __m256 p8 = _mm256_set1_ps(p);
                for (j = 0; j + 8 <= D; j += 8)
                    _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(p8, _mm256_loadu_ps(vv + j), _mm256_loadu_ps(acc + j)));
                for (; j < D; j++) acc[j] += p * vv[j];
            }
            float *o = out + (b * Hq + h) * D;
            const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
            for (int64_t j = 0; j < D; j++) o[j] = acc[j] * inv;
        }
    }
}
