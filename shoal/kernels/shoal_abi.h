/* What the kernels share with each other and with Python: the structs Python builds through ctypes,
 * the ids it passes, and every function one file calls in another (or Python calls).
 *
 * Python's mirror is shoal/kernels/abi.py. The library describes this header's structs and constants
 * through the shoal_abi_* functions (abi.c), and Python refuses a library whose description differs
 * from its own, so a change here that abi.py does not follow turns the kernels off instead of
 * corrupting memory. Change SHOAL_ABI_VERSION whenever the meaning of a field changes but its
 * layout does not.
 */
#ifndef SHOAL_ABI_H
#define SHOAL_ABI_H

#include <stdint.h>

#define SHOAL_ABI_VERSION 2

/* Weight formats of a projection (ProjectionParams.format). */
enum {
    FORMAT_Q4_1 = 0,      /* GGUF Q4_1 blocks, mn used (cpu_quant.c) */
    FORMAT_Q8_0 = 1,      /* GGUF Q8_0 blocks (cpu_quant.c) */
    FORMAT_INT8_ROWS = 2, /* int8 rows with one scale each in d (cpu_int8.c) */
    FORMAT_F32_ROWS = 3,  /* float32 rows in qs (cpu_f32.c) */
    FORMAT_Q4_1X8 = 4,    /* Q4_1 repacked 8 rows at a time (cpu_x8.c) */
    FORMAT_Q8_0X8 = 5,    /* Q8_0 repacked likewise */
};

/* Element types of the KV cache. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* The most HF modules one projection fuses (q, k and v into qkv), the largest adapter rank, and
 * the most adapter slots (slot 0, no adapter, included). */
#define LORA_PARTS 3
#define LORA_MAX_RANK 512
#define LORA_MAX_SLOTS 1024

/* Element types of adapter weights (LoRAParams.dtype). */
enum { LORA_F32 = 0, LORA_F16 = 1 };

/* One LoRA target module's adapter slots (cpu_lora.c): for a row using slot s,
 * y[offset : offset + n] += B[s] @ (A[s] @ x), over the slot's first ranks[s] ranks. */
typedef struct {
    int64_t k, n, max_rank, offset, slots;
    int64_t dtype;        /* of a and b: LORA_F32 or LORA_F16 */
    const void *a;        /* [slots, max_rank, k] */
    const void *b;        /* [slots, max_rank, n]: the expand transposed, so a rank adds one row */
    const int64_t *ranks; /* [slots]: 0 where the slot's adapter leaves this module alone */
} LoRAParams;

/* A projection's weights: y = x @ W^T (+ bias), W [n, k] in `format`; then its adapters, if any. */
typedef struct {
    int64_t format, n, k;
    const void *qs;
    const float *d, *mn, *bias;
    int64_t lora_parts; /* 0 without adapters */
    LoRAParams lora[LORA_PARTS];
} ProjectionParams;

/* One decoder layer's shapes, weights and KV cache (cpu_layer.c). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, window;
    int64_t kv_type; /* the caches' element type: KV_F32, KV_F16 or KV_BF16 */
    float eps, scale;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache; /* [slots, kv_heads, head_dim] */
    ProjectionParams qkv, o, gate_up, down;
    /* Tensor parallel: sums a partial output across the ranks in place (shoal_shm_allreduce), or
     * NULL when the layer is whole. A failure is recorded in `comm` and read by the caller after
     * the step. */
    int (*allreduce)(void *comm, float *buf, int64_t n);
    void *comm;
} LayerParams;

/* One rank's view of the shared-memory collectives (shm_comm.c). */
typedef struct {
    int64_t rank, world;
    char *base;         /* the shared mapping */
    int64_t slot_bytes; /* bytes of one rank's slot in one buffer */
    uint64_t seq;       /* calls made so far by this rank */
    double timeout_s;   /* a peer silent this long is taken as dead */
    int64_t failed;     /* set once a wait timed out: the group is unusable */
    int64_t busy_ns;    /* time spent in calls (copies and waits), for the profile */
    int64_t calls;
} ShmComm;

/* The ABI's description of itself (abi.c); -1 for a name it does not know. */
int64_t shoal_abi_version(void);
int64_t shoal_abi_sizeof(const char *type);
int64_t shoal_abi_field_count(const char *type);
int64_t shoal_abi_offsetof(const char *type, const char *field);
int64_t shoal_abi_field_size(const char *type, const char *field);
int64_t shoal_abi_constant(const char *name);

/* cpu_quant.c, cpu_x8.c */
void shoal_quantize_blocks(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx);
void shoal_block_matmul(int fmt, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                        const void *qs, const float *d, const float *mn, int64_t N, float *y);
void shoal_x8_matmul(int q8, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                     const uint8_t *qs, const float *d, const float *mn, int64_t N, float *y);
/* cpu_amx.c: 1 where AMX is built and Linux grants it; the x8 tile pairs on AMX (tiles done). */
int shoal_amx_enable(void);
int64_t shoal_amx_x8_matmul(int q8, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                            const uint8_t *qs, const float *d, const float *mn, int64_t N, float *y);
void shoal_block_linear(int format, const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx,
                        const void *qs, const float *d, const float *mn, int64_t N, float *y);

/* cpu_int8.c */
void shoal_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs);
void shoal_int8_matmul(const int8_t *xq, const float *xs, int64_t M, int64_t K, const int8_t *w,
                       const float *scale, int64_t N, float *y);
void shoal_int8_rescale(const int32_t *acc, const float *xs, const float *scale, int64_t M, int64_t N, float *y);
void shoal_int8_linear(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, const int8_t *w,
                       const float *scale, int64_t N, float *y);

/* cpu_f32.c */
void shoal_f32_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y);

/* cpu_ops.c */
void shoal_add_rms_norm(float *x, const float *delta, const float *w, int64_t M, int64_t H, float eps,
                        float *out);
void shoal_silu_mul(const float *gu, int64_t M, int64_t I, float *out);
void shoal_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                  const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                                  int64_t Hq, int64_t Hk, int64_t D, int64_t bs, int64_t window, float scale,
                                  int64_t kv, float *out);

/* cpu_lora.c */
void shoal_lora_apply(const LoRAParams *p, const float *x, int64_t M, const int64_t *row_slots, float *y,
                      int64_t ldy);

/* cpu_layer.c */
int64_t shoal_decode_layer_scratch(const LayerParams *p, int64_t M);
void shoal_decode_layer(const LayerParams *p, float *x, const float *delta, int64_t M, const float *cos,
                        const float *sin, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lens, const int64_t *lora_slots, void *scratch, float *out);
int64_t shoal_moe_experts_scratch(int64_t rows, int64_t H, int64_t I);
void shoal_moe_experts(const ProjectionParams *gate_up, const ProjectionParams *down, int64_t E, int64_t H,
                       int64_t I, const float *x, const int64_t *rows, const float *scale, const int64_t *starts,
                       const int64_t *ends, void *scratch, float *out);

/* shm_comm.c (its own library, built for any CPU) */
int64_t shoal_shm_bytes(int64_t world, int64_t slot_bytes);
int shoal_shm_allreduce(ShmComm *c, float *buf, int64_t n);
int shoal_shm_allgather(ShmComm *c, const char *src, int64_t nbytes, char *dst);
int shoal_shm_alltoall(ShmComm *c, const char *src, const int64_t *bytes, char *dst);

#endif
