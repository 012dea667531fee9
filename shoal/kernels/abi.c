/* The library's description of shoal_abi.h, read by shoal/kernels/abi.py at load: the compiler's own
 * sizes and offsets, so Python compares its ctypes mirror with what this build really lays out.
 * Linked into both libraries (the AVX kernels and the plain-C shared-memory collectives). */
#include <stddef.h>
#include <string.h>

#include "shoal_abi.h"

typedef struct {
    const char *type, *field;
    int64_t offset, size;
} AbiField;

#define FIELD(T, f) {#T, #f, (int64_t)offsetof(T, f), (int64_t)sizeof(((T *)0)->f)}

static const AbiField FIELDS[] = {
    FIELD(ProjectionParams, format), FIELD(ProjectionParams, n), FIELD(ProjectionParams, k),
    FIELD(ProjectionParams, qs), FIELD(ProjectionParams, d), FIELD(ProjectionParams, mn),
    FIELD(ProjectionParams, bias), FIELD(ProjectionParams, lora_parts), FIELD(ProjectionParams, lora),

    FIELD(LoRAParams, k), FIELD(LoRAParams, n), FIELD(LoRAParams, max_rank), FIELD(LoRAParams, offset),
    FIELD(LoRAParams, slots), FIELD(LoRAParams, dtype), FIELD(LoRAParams, a), FIELD(LoRAParams, b),
    FIELD(LoRAParams, ranks),

    FIELD(LayerParams, hidden), FIELD(LayerParams, heads), FIELD(LayerParams, kv_heads),
    FIELD(LayerParams, head_dim), FIELD(LayerParams, intermediate), FIELD(LayerParams, block_size),
    FIELD(LayerParams, window), FIELD(LayerParams, kv_type), FIELD(LayerParams, eps), FIELD(LayerParams, scale),
    FIELD(LayerParams, input_norm), FIELD(LayerParams, post_norm), FIELD(LayerParams, k_cache),
    FIELD(LayerParams, v_cache), FIELD(LayerParams, qkv), FIELD(LayerParams, o), FIELD(LayerParams, gate_up),
    FIELD(LayerParams, down), FIELD(LayerParams, allreduce), FIELD(LayerParams, comm),

    FIELD(ShmComm, rank), FIELD(ShmComm, world), FIELD(ShmComm, base), FIELD(ShmComm, slot_bytes),
    FIELD(ShmComm, seq), FIELD(ShmComm, timeout_s), FIELD(ShmComm, failed), FIELD(ShmComm, busy_ns),
    FIELD(ShmComm, calls),
};

static const struct {
    const char *name;
    int64_t size;
} TYPES[] = {
    {"LoRAParams", sizeof(LoRAParams)},
    {"ProjectionParams", sizeof(ProjectionParams)},
    {"LayerParams", sizeof(LayerParams)},
    {"ShmComm", sizeof(ShmComm)},
};

#define CONSTANT(c) {#c, c}

static const struct {
    const char *name;
    int64_t value;
} CONSTANTS[] = {
    CONSTANT(FORMAT_Q4_1),      CONSTANT(FORMAT_Q8_0),   CONSTANT(FORMAT_INT8_ROWS),
    CONSTANT(FORMAT_F32_ROWS),  CONSTANT(FORMAT_Q4_1X8), CONSTANT(FORMAT_Q8_0X8),
    CONSTANT(KV_F32),           CONSTANT(KV_F16),        CONSTANT(KV_BF16),
    CONSTANT(LORA_PARTS),       CONSTANT(LORA_MAX_RANK), CONSTANT(LORA_MAX_SLOTS),
    CONSTANT(LORA_F32),         CONSTANT(LORA_F16),
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

int64_t shoal_abi_version(void) { return SHOAL_ABI_VERSION; }

int64_t shoal_abi_sizeof(const char *type) {
    for (size_t i = 0; i < COUNT(TYPES); i++)
        if (!strcmp(TYPES[i].name, type)) return TYPES[i].size;
    return -1;
}

int64_t shoal_abi_field_count(const char *type) {
    int64_t n = 0;
    for (size_t i = 0; i < COUNT(FIELDS); i++) n += !strcmp(FIELDS[i].type, type);
    return shoal_abi_sizeof(type) < 0 ? -1 : n;
}

static const AbiField *find(const char *type, const char *field) {
    for (size_t i = 0; i < COUNT(FIELDS); i++)
        if (!strcmp(FIELDS[i].type, type) && !strcmp(FIELDS[i].field, field)) return &FIELDS[i];
    return 0;
}

int64_t shoal_abi_offsetof(const char *type, const char *field) {
    const AbiField *f = find(type, field);
    return f ? f->offset : -1;
}

int64_t shoal_abi_field_size(const char *type, const char *field) {
    const AbiField *f = find(type, field);
    return f ? f->size : -1;
}

int64_t shoal_abi_constant(const char *name) {
    for (size_t i = 0; i < COUNT(CONSTANTS); i++)
        if (!strcmp(CONSTANTS[i].name, name)) return CONSTANTS[i].value;
    return -1;
}
