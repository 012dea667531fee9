/* One Llama-family decoder layer for a batch of single-token (decode) rows, in one call; and a
 * mixture of experts' routed experts, likewise.
 *
 * At decode sizes the arithmetic of a layer takes tens of microseconds, and dispatching a dozen
 * torch ops and kernel calls from Python costs about as much again; this runs the layer's whole
 * sequence (norms, projections, rope, KV write, paged attention, SwiGLU) in C, in the order of
 * DecoderLayer.forward in shoal/models/llama.py.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* n floats (n % 8 == 0) into the cache's element type, rounded to nearest even as torch's casts do. */
static void store_kv(void *dst, const float *src, int64_t n, int64_t kv) {
    if (kv == KV_F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(src + i);
        __m128i h;
        if (kv == KV_F16) {
            h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
        } else { /* bf16: the top half of the float, rounded to nearest even (no NaN can reach here) */
            const __m256i b = _mm256_castps_si256(x);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
            const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd), 16);
            h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        }
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
}

/* lora_slots [M]: each row's adapter slot (0: none), or NULL when no row of the step has one. */
static void project(const ProjectionParams *p, const float *x, int64_t M, const int64_t *lora_slots, int8_t *xq,
                    float *dx, float *sx, float *y) {
    if (p->format == FORMAT_F32_ROWS)
        shoal_f32_linear(x, M, p->k, (const float *)p->qs, p->n, y);
    else if (p->format == FORMAT_INT8_ROWS)
        shoal_int8_linear(x, M, p->k, xq, dx, (const int8_t *)p->qs, p->d, p->n, y);
    else
        shoal_block_linear((int)p->format, x, M, p->k, xq, dx, sx, p->qs, p->d, p->mn, p->n, y);
    if (p->bias)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < p->n; j++) y[i * p->n + j] += p->bias[j];
    if (lora_slots)
        for (int64_t part = 0; part < p->lora_parts; part++) shoal_lora_apply(&p->lora[part], x, M, lora_slots, y, p->n);
}

/* Carves the layer's buffers for M rows out of one scratch area (NULL: only counts); returns its bytes. */
static int64_t layout(const LayerParams *p, int64_t M, char *base, float **h, float **qkv, float **attn, float **gu,
                      float **act, int8_t **xq, float **dx, float **sx) {
    const int64_t H = p->hidden, D = p->head_dim, Hq = p->heads, I = p->intermediate;
    int64_t kmax = H > I ? H : I; /* the widest projection input */
    if (Hq * D > kmax) kmax = Hq * D;
    const int64_t sizes[8] = {4 * M * H, 4 * M * p->qkv.n, 4 * M * Hq * D, 4 * M * 2 * I, 4 * M * I, M * kmax,
                              4 * M * (kmax / 32 + 1), 4 * M * (kmax / 32 + 1)};
    void **slots[8] = {(void **)h, (void **)qkv, (void **)attn, (void **)gu, (void **)act, (void **)xq,
                       (void **)dx, (void **)sx};
    int64_t off = 0;
    for (int i = 0; i < 8; i++) {
        if (base) *slots[i] = base + off;
        off += (sizes[i] + 63) & ~(int64_t)63; /* each buffer on its own cache lines */
    }
    return off;
}

/* Bytes of scratch shoal_decode_layer needs for M rows. */
int64_t shoal_decode_layer_scratch(const LayerParams *p, int64_t M) {
    return layout(p, M, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

/* x [M, hidden]: the residual stream, updated in place (x += delta first, when delta is given).
 * cos, sin [M, head_dim]: rope tables for each row's position, sin with rotate_half's sign folded in.
 * slots [M]: where each row's K/V goes; tables [M, max_blocks], lens [M]: its context.
 * lora_slots [M]: each row's LoRA adapter slot, or NULL when no row has one.
 * scratch: shoal_decode_layer_scratch(p, M) bytes, 64-byte aligned, reused from call to call (no
 * allocation, and no page faults, per layer per step).
 * out [M, hidden]: this layer's output, not yet added to x. */
void shoal_decode_layer(const LayerParams *p, float *x, const float *delta, int64_t M, const float *cos,
                        const float *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lens, const int64_t *lora_slots, void *scratch, float *out) {
    const int64_t H = p->hidden, D = p->head_dim, Hq = p->heads, Hk = p->kv_heads, I = p->intermediate;
    const int64_t nqkv = p->qkv.n;
    float *h, *qkv, *attn, *gu, *act, *dx, *sx;
    int8_t *xq;
    layout(p, M, scratch, &h, &qkv, &attn, &gu, &act, &xq, &dx, &sx);

    shoal_add_rms_norm(x, delta, p->input_norm, M, H, p->eps, h);
    project(&p->qkv, h, M, lora_slots, xq, dx, sx, qkv);
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
        const int64_t row = slots[i] * Hk * D * (p->kv_type == KV_F32 ? 4 : 2); /* bytes */
        store_kv((char *)p->k_cache + row, qkv + i * nqkv + Hq * D, Hk * D, p->kv_type);
        store_kv((char *)p->v_cache + row, qkv + i * nqkv + (Hq + Hk) * D, Hk * D, p->kv_type);
    }
    shoal_paged_decode_attention(qkv, nqkv, p->k_cache, p->v_cache, tables, max_blocks, lens, M, Hq, Hk, D,
                                 p->block_size, p->window, p->scale, p->kv_type, attn);
    project(&p->o, attn, M, lora_slots, xq, dx, sx, out);
    if (p->allreduce) p->allreduce(p->comm, out, M * H);
    shoal_add_rms_norm(x, out, p->post_norm, M, H, p->eps, h);
    project(&p->gate_up, h, M, lora_slots, xq, dx, sx, gu);
    shoal_silu_mul(gu, M, I, act);
    project(&p->down, act, M, lora_slots, xq, dx, sx, out);
    if (p->allreduce) p->allreduce(p->comm, out, M * H);
}

/* The routed experts' buffers for up to `rows` rows (NULL base: only counts); returns their bytes. */
static int64_t expert_layout(int64_t rows, int64_t H, int64_t I, char *base, float **xe, float **gu, float **act,
                             float **y, int8_t **xq, float **dx, float **sx) {
    const int64_t kmax = H > I ? H : I;
    const int64_t sizes[7] = {4 * rows * H, 4 * rows * 2 * I, 4 * rows * I, 4 * rows * H, rows * kmax,
                              4 * rows * (kmax / 32 + 1), 4 * rows * (kmax / 32 + 1)};
    void **slots[7] = {(void **)xe, (void **)gu, (void **)act, (void **)y, (void **)xq, (void **)dx, (void **)sx};
    int64_t off = 0;
    for (int i = 0; i < 7; i++) {
        if (base) *slots[i] = base + off;
        off += (sizes[i] + 63) & ~(int64_t)63;
    }
    return off;
}

/* Bytes of scratch shoal_moe_experts needs when no expert takes more than `rows` rows. */
int64_t shoal_moe_experts_scratch(int64_t rows, int64_t H, int64_t I) {
    return expert_layout(rows, H, I, 0, 0, 0, 0, 0, 0, 0, 0);
}

/* A mixture of experts' routed part in one call, as SparseMoE.run_experts in models/moe.py does it
 * expert by expert: for each expert e, its choices j in [starts[e], ends[e]) (token rows[j], weight
 * scale[j], or 1 when scale is NULL) add scale[j] * down(silu(gate_up(x[rows[j]]))) to out[rows[j]].
 * gate_up, down [E]: each expert's projections (hidden -> 2I, I -> hidden); an expert this rank
 * does not run has no choices. out [T, H] is added to, in expert order and row order within. */
void shoal_moe_experts(const ProjectionParams *gate_up, const ProjectionParams *down, int64_t E, int64_t H,
                       int64_t I, const float *x, const int64_t *rows, const float *scale, const int64_t *starts,
                       const int64_t *ends, void *scratch, float *out) {
    int64_t widest = 0;
    for (int64_t e = 0; e < E; e++)
        if (ends[e] - starts[e] > widest) widest = ends[e] - starts[e];
    float *xe, *gu, *act, *y, *dx, *sx;
    int8_t *xq;
    expert_layout(widest, H, I, scratch, &xe, &gu, &act, &y, &xq, &dx, &sx);
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = starts[e], n = ends[e] - starts[e];
        if (n <= 0) continue;
        for (int64_t j = 0; j < n; j++) memcpy(xe + j * H, x + rows[first + j] * H, sizeof(float) * H);
        project(&gate_up[e], xe, n, 0, xq, dx, sx, gu);
        shoal_silu_mul(gu, n, I, act);
        project(&down[e], act, n, 0, xq, dx, sx, y);
        for (int64_t j = 0; j < n; j++) {
            const float s = scale ? scale[first + j] : 1.0f;
            float *o = out + rows[first + j] * H;
            const float *v = y + j * H;
            for (int64_t h = 0; h < H; h++) o[h] += v[h] * s;
        }
    }
}
