/* Small fused float32 ops for the CPU decode step, where torch's per-op overhead costs more than
 * the arithmetic: RMSNorm with the residual add folded in, and paged decode attention. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

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

/* e^x for 8 floats: 2^n * e^r with n = round(x / ln 2) and a degree-6 polynomial for e^r on
 * |r| <= ln2 / 2 (relative error about 2e-7). Inputs below -87 give 0, so e^-inf is 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_ROUND_NEAREST);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 y = _mm256_set1_ps(1.0f / 720);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), zero_mask);
}

/* out [M, I] = silu(gu[:, :I]) * gu[:, I:]  for gu [M, 2I]. */
void shoal_silu_mul(const float *gu, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M * I > 16384)
    for (int64_t i = 0; i < M; i++) {
        const float *g = gu + i * 2 * I, *u = g + I;
        float *o = out + i * I;
        int64_t j = 0;
        for (; j + 8 <= I; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(u + j)));
        }
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* The 8 sums of a[0..7]'s lanes, in order. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* 8 consecutive K/V values as floats, from a cache of float32, float16 or bfloat16 (KV_* below). */
static inline __m256 load_kv8(const void *p, int64_t i, int kv) {
    if (kv == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (kv == KV_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* q . k[i] for 8 keys at once: eight independent accumulators hide the FMA latency. D % 8 == 0. */
static inline __attribute__((always_inline)) __m256 dot_8_keys(const float *q, const void *const *k, int64_t D,
                                                                int kv) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, load_kv8(k[i], d, kv), a[i]);
    }
    return hsum8x8(a);
}

/* acc[0:D] += sum_j p[j] * v[j][0:D] over n keys, 64 columns at a time held in registers. D % 8 == 0. */
static inline __attribute__((always_inline)) void weighted_sum(float *acc, const float *p, const void *const *v,
                                                               int64_t n, int64_t D, int kv) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int i = 0; i < 8; i++) r[i] = _mm256_fmadd_ps(pj, load_kv8(v[j], d0 + 8 * i, kv), r[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + d0 + 8 * i, r[i]);
    }
    for (; d0 < D; d0 += 8) {
        __m256 r = _mm256_loadu_ps(acc + d0);
        for (int64_t j = 0; j < n; j++) r = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load_kv8(v[j], d0, kv), r);
        _mm256_storeu_ps(acc + d0, r);
    }
}

#define KEY_CHUNK 32 /* keys scored before each softmax update */
#define HEAD_GROUP 8 /* query heads that share one pass over their KV head's keys */

/* One query token per sequence attending to its paged context.
 * q [B, Hq, D] with q_stride floats from one sequence's row to the next; caches [slots, Hk, D] with
 * slot = block * bs + offset; tables [B, max_blocks]; lens [B]: keys attended (the last len - window
 * dropped when window > 0). out [B, Hq, D]. D <= 256 and a multiple of 8.
 * The query heads of one KV head (GQA) go through its keys together, a chunk at a time: scores for
 * the chunk, one softmax rescale per chunk (online softmax), then the weighted values. */
static inline __attribute__((always_inline)) void paged_attention(
    int kv, const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *tables,
    int64_t max_blocks, const int64_t *lens, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t bs,
    int64_t window, float scale, float *out) {
    const int64_t esize = kv == KV_F32 ? 4 : 2;
    const int64_t group = Hq / Hk;
    const int64_t parts = (group + HEAD_GROUP - 1) / HEAD_GROUP;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t w = 0; w < Hk * parts; w++) {
            const int64_t kh = w / parts, h0 = kh * group + (w % parts) * HEAD_GROUP;
            const int64_t G = group - (w % parts) * HEAD_GROUP < HEAD_GROUP ? group - (w % parts) * HEAD_GROUP
                                                                            : HEAD_GROUP;
            const int64_t len = lens[b];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            float acc[HEAD_GROUP][256], mx[HEAD_GROUP], denom[HEAD_GROUP];
            float sc[HEAD_GROUP][KEY_CHUNK];
            const void *kp[KEY_CHUNK], *vp[KEY_CHUNK];
            for (int64_t g = 0; g < G; g++) {
                memset(acc[g], 0, sizeof(float) * D);
                mx[g] = -INFINITY;
                denom[g] = 0.0f;
            }
            for (int64_t t0 = start; t0 < len; t0 += KEY_CHUNK) {
                const int64_t n = len - t0 < KEY_CHUNK ? len - t0 : KEY_CHUNK;
                const int64_t padded = (n + 7) & ~(int64_t)7;
                /* The chunk's keys walk the table a block at a time: one division per chunk, not
                 * one per key (a 64-bit division costs more than scoring the key). */
                const int64_t *table = tables + b * max_blocks;
                int64_t blk = t0 / bs, in_blk = t0 % bs;
                for (int64_t j = 0; j < n; j++) {
                    const int64_t off = ((table[blk] * bs + in_blk) * Hk + kh) * D;
                    kp[j] = (const char *)k_cache + off * esize;
                    vp[j] = (const char *)v_cache + off * esize;
                    if (++in_blk == bs) {
                        in_blk = 0;
                        blk++;
                    }
                }
                for (int64_t j = n; j < padded; j++) { /* pad with a real key; masked below */
                    kp[j] = kp[n - 1];
                    vp[j] = vp[n - 1];
                }
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = q + b * q_stride + (h0 + g) * D;
                    __m256 m8 = _mm256_set1_ps(mx[g]);
                    for (int64_t j = 0; j < padded; j += 8) {
                        const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx));
                        const __m256 s8 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                           _mm256_mul_ps(dot_8_keys(qg, kp + j, D, kv), _mm256_set1_ps(scale)), valid);
                        _mm256_storeu_ps(sc[g] + j, s8);
                        m8 = _mm256_max_ps(m8, s8);
                    }
                    /* the chunk's weights under the new max, and the factor for what came before */
                    float m = mx[g];
                    float mv[8];
                    _mm256_storeu_ps(mv, m8);
                    for (int i = 0; i < 8; i++) m = mv[i] > m ? mv[i] : m;
                    m8 = _mm256_set1_ps(m);
                    __m256 sum8 = _mm256_setzero_ps();
                    for (int64_t j = 0; j < padded; j += 8) {
                        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc[g] + j), m8));
                        _mm256_storeu_ps(sc[g] + j, e);
                        sum8 = _mm256_add_ps(sum8, e);
                    }
                    const float c = mx[g] == -INFINITY ? 0.0f : expf(mx[g] - m);
                    denom[g] = denom[g] * c + hsum(sum8);
                    mx[g] = m;
                    if (c != 1.0f)
                        for (int64_t j = 0; j < D; j++) acc[g][j] *= c;
                    weighted_sum(acc[g], sc[g], vp, n, D, kv);
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + (b * Hq + h0 + g) * D;
                const float inv = denom[g] > 0.0f ? 1.0f / denom[g] : 0.0f;
                for (int64_t j = 0; j < D; j++) o[j] = acc[g][j] * inv;
            }
        }
    }
}

/* kv: the caches' element type, KV_F32, KV_F16 or KV_BF16 (one compiled variant each). */
void shoal_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                                  int64_t Hq, int64_t Hk, int64_t D, int64_t bs, int64_t window, float scale,
                                  int64_t kv, float *out) {
    if (kv == KV_F16)
        paged_attention(KV_F16, q, q_stride, k_cache, v_cache, tables, max_blocks, lens, B, Hq, Hk, D, bs, window,
                        scale, out);
    else if (kv == KV_BF16)
        paged_attention(KV_BF16, q, q_stride, k_cache, v_cache, tables, max_blocks, lens, B, Hq, Hk, D, bs, window,
                        scale, out);
    else
        paged_attention(KV_F32, q, q_stride, k_cache, v_cache, tables, max_blocks, lens, B, Hq, Hk, D, bs, window,
                        scale, out);
}
