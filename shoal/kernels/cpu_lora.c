/* Many LoRA adapters in one batch, each row with its own (Punica's BGMV): a row using slot s adds
 * B[s] @ (A[s] @ x) to its base projection's output, a rank-r shrink then expand.
 *
 * The work is tiny next to the base projection (2r(k + n) flops a row), so the cost is reading
 * each row's adapter weights once: A as r dot products along k, B stored transposed so that each
 * rank adds one contiguous row of n. Rows are independent, so a row's result does not depend on
 * which other rows share its step.
 */
#include "simd.h"

static float dot(const float *a, const float *x, int64_t k) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(x + j), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(x + j + 8), s1);
    }
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; j < k; j++) s += a[j] * x[j];
    return s;
}

static void lora_row(const LoRAParams *p, int64_t slot, const float *x, float *y) {
    const int64_t r = p->ranks[slot], K = p->k, N = p->n;
    const float *a = p->a + slot * p->max_rank * K, *b = p->b + slot * p->max_rank * N;
    float t[LORA_MAX_RANK];
    for (int64_t j = 0; j < r; j++) t[j] = dot(a + j * K, x, K);
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < r; j++) acc = _mm256_fmadd_ps(_mm256_set1_ps(t[j]), _mm256_loadu_ps(b + j * N + n), acc);
        _mm256_storeu_ps(y + n, _mm256_add_ps(_mm256_loadu_ps(y + n), acc));
    }
    for (; n < N; n++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < r; j++) acc += t[j] * b[j * N + n];
        y[n] += acc;
    }
}

/* x [M, k]; row_slots [M] (0: the base alone); y [M, ldy], updated in columns offset..offset+n. */
void shoal_lora_apply(const LoRAParams *p, const float *x, int64_t M, const int64_t *row_slots, float *y,
                      int64_t ldy) {
#pragma omp parallel for schedule(dynamic, 1) if (M > 1)
    for (int64_t i = 0; i < M; i++) {
        const int64_t s = row_slots[i];
        if (s > 0 && p->ranks[s] > 0) lora_row(p, s, x + i * p->k, y + i * ldy + p->offset);
    }
}
