/* One Llama-family decoder layer for a batch of single-token (decode) rows, in one call.
 *
 * At decode sizes the arithmetic of a layer takes tens of microseconds, and dispatching a dozen
 * torch ops and kernel calls from Python costs about as much again; this runs the layer's whole
 * sequence (norms, projections, rope, KV write, paged attention, SwiGLU) in C, in the order of
 * DecoderLayer.forward in shoal/models/llama.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void shoal_add_rms_norm(float *x, const float *delta, const float *w, int64_t M, int64_t H, float eps,
                        float *out);
void shoal_silu_mul(const float *gu, int64_t M, int64_t I, float *out);
void shoal_block_linear(int format, const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx,
                        const void *qs, const float *d, const float *mn, int64_t N, float *y);
void shoal_int8_linear(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, const int8_t *w,
                       const float *scale, int64_t N, float *y);
void shoal_f32_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y);
void shoal_paged_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                                  int64_t Hq, int64_t Hk, int64_t D, int64_t bs, int64_t window, float scale,
                                  float *out);

/* A projection's weights: format 0 = Q4_1 blocks (mn used), 1 = Q8_0 blocks (cpu_quant.c), 2 = int8
 * rows with one scale each in d (cpu_int8.c), 3 = float32 rows in qs (cpu_f32.c). */
typedef struct {
    int64_t format, n, k;
    const void *qs;
    const float *d, *mn, *bias;
} ProjectionParams;

/* Must match shoal/kernels/cpu.py's LayerParams field for field. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, window;
    float eps, scale;
    const float *input_norm, *post_norm;
    float *k_cache, *v_cache; /* [slots, kv_heads, head_dim] */
    ProjectionParams qkv, o, gate_up, down;
} LayerParams;

static void project(const ProjectionParams *p, const float *x, int64_t M, int8_t *xq, float *dx, float *sx,
                    float *y) {
    if (p->format == 3)
        shoal_f32_linear(x, M, p->k, (const float *)p->qs, p->n, y);
    else if (p->format == 2)
        shoal_int8_linear(x, M, p->k, xq, dx, (const int8_t *)p->qs, p->d, p->n, y);
    else
        shoal_block_linear((int)p->format, x, M, p->k, xq, dx, sx, p->qs, p->d, p->mn, p->n, y);
    if (p->bias)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < p->n; j++) y[i * p->n + j] += p->bias[j];
}

/* x [M, hidden]: the residual stream, updated in place (x += delta first, when delta is given).
 * cos, sin [M, head_dim]: rope tables for each row's position, sin with rotate_half's sign folded in.
 * slots [M]: where each row's K/V goes; tables [M, max_blocks], lens [M]: its context.
 * out [M, hidden]: this layer's output, not yet added to x. Returns 0, or -1 when out of memory. */
int shoal_decode_layer(const LayerParams *p, float *x, const float *delta, int64_t M, const float *cos,
                       const float *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                       const int64_t *lens, float *out) {
    const int64_t H = p->hidden, D = p->head_dim, Hq = p->heads, Hk = p->kv_heads, I = p->intermediate;
    const int64_t nqkv = p->qkv.n;
    int64_t kmax = H > I ? H : I; /* the widest projection input */
    if (Hq * D > kmax) kmax = Hq * D;
    float *h = malloc(sizeof(float) * M * H);
    float *qkv = malloc(sizeof(float) * M * nqkv);
    float *attn = malloc(sizeof(float) * M * Hq * D);
    float *gu = malloc(sizeof(float) * M * 2 * I);
    float *act = malloc(sizeof(float) * M * I);
    int8_t *xq = malloc(M * kmax);
    float *dx = malloc(sizeof(float) * M * (kmax / 32 + 1));
    float *sx = malloc(sizeof(float) * M * (kmax / 32 + 1));
    int rc = -1;
    if (!h || !qkv || !attn || !gu || !act || !xq || !dx || !sx) goto done;

    shoal_add_rms_norm(x, delta, p->input_norm, M, H, p->eps, h);
    project(&p->qkv, h, M, xq, dx, sx, qkv);
    /* Rope on q and k heads (adjacent in each row), rotate_half layout: x*cos + roll(x, D/2)*sin. */
    const int64_t half = D / 2;
    for (int64_t i = 0; i < M; i++) {
        const float *c = cos + i * D, *s = sin + i * D;
        for (int64_t hd = 0; hd < Hq + Hk; hd++) {
            float *v = qkv + i * nqkv + hd * D;
            float rot[512];
            for (int64_t j = 0; j < half; j++) rot[j] = v[j] * c[j] + v[j + half] * s[j];
            for (int64_t j = half; j < D; j++) rot[j] = v[j] * c[j] + v[j - half] * s[j];
            memcpy(v, rot, sizeof(float) * D);
        }
        const int64_t row = slots[i] * Hk * D;
        memcpy(p->k_cache + row, qkv + i * nqkv + Hq * D, sizeof(float) * Hk * D);
        memcpy(p->v_cache + row, qkv + i * nqkv + (Hq + Hk) * D, sizeof(float) * Hk * D);
    }
    shoal_paged_decode_attention(qkv, nqkv, p->k_cache, p->v_cache, tables, max_blocks, lens, M, Hq, Hk, D,
                                 p->block_size, p->window, p->scale, attn);
    project(&p->o, attn, M, xq, dx, sx, out);
    shoal_add_rms_norm(x, out, p->post_norm, M, H, p->eps, h);
    project(&p->gate_up, h, M, xq, dx, sx, gu);
    shoal_silu_mul(gu, M, I, act);
    project(&p->down, act, M, xq, dx, sx, out);
    rc = 0;
done:
    free(h);
    free(qkv);
    free(attn);
    free(gu);
    free(act);
    free(xq);
    free(dx);
    free(sx);
    return rc;
}
