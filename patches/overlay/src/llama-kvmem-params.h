#pragma once

// KVMem tiering parameters (kvmem-llama); kept apart so llama-cparams.h can hold them

#include <cstdint>

enum llama_kvmem_method_e {
    LLAMA_KVMEM_METHOD_RETRIEVAL = 0,
    LLAMA_KVMEM_METHOD_RECENCY   = 1,
};

struct llama_kvmem_params {
    uint32_t budget       = 0;   // GPU working-set tokens, 0 = tiering off
    uint32_t block        = 128; // tokens per block
    uint32_t sink         = 128; // tokens at the start that always stay resident (rounded up to blocks)
    uint32_t recent       = 256; // newest tokens that always stay resident (rounded up to blocks)
    uint32_t gen_reserve  = 256; // extra cells for generated tokens / the partial tail
    uint32_t query_tokens = 32;  // last N tokens of a turn that form the query
    uint32_t refresh      = 128; // re-select every N generated tokens (query = the recent tokens), 0 = off
    uint32_t host_mib     = 0;   // host pool cap in MiB, 0 = enough for the whole context
    int32_t  method       = LLAMA_KVMEM_METHOD_RETRIEVAL;
    bool     trace        = false;

    class llama_kvmem_cache * leader = nullptr; // MTP draft contexts: the target's tiered cache to follow
};

