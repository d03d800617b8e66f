#pragma once

// KVMem tiering parameters (kvmem-llama); kept apart so llama-cparams.h can hold them.
// The member initializers below are THE defaults: llama_context_default_params(), the --kvmem-* flags and the
// Python side (which reads them from the engine) all take them from here.

#include <cstdint>
#include <string>

// how blocks beyond the sink, the question and the recent window are picked (llama.h keeps the same numbers)
enum llama_kvmem_method_e {
    LLAMA_KVMEM_METHOD_RETRIEVAL = 0, // the default scorer (an alias of the method chosen by measurement, see docs/eval)
    LLAMA_KVMEM_METHOD_RECENCY   = 1, // no scoring: the newest blocks (an ablation baseline)
    LLAMA_KVMEM_METHOD_QUEST     = 2, // min/max bound of the pre-RoPE keys of a whole block, top-4 z-scored heads
    LLAMA_KVMEM_METHOD_MEANKEY   = 3, // KVMem: cosine of the mean pre-RoPE key and the mean query
    LLAMA_KVMEM_METHOD_SUBPAGE   = 4, // min/max bounds of 16-token sub-pages, a block scores its best sub-page
    LLAMA_KVMEM_METHOD_VOTES     = 5, // each (layer, KV head) votes for its top blocks by sub-page bound
    LLAMA_KVMEM_METHOD_MASS      = 6, // softmax attention mass of the query over 8-token chunk means
    LLAMA_KVMEM_METHOD_HYBRID    = 7, // mass, with every other pick from the question's rare words (BM25 over block tokens)
    LLAMA_KVMEM_METHOD_COUNT,
};

// what a prompt longer than the working set attends to while it is prefilled
enum llama_kvmem_prefill_e {
    LLAMA_KVMEM_PREFILL_WINDOW    = 0, // sink + the newest blocks (sliding window)
    LLAMA_KVMEM_PREFILL_RETRIEVAL = 1, // before each prompt batch, also the blocks its preceding tokens' queries pick
};

// the type of the GPU working set when -ctk/-ctv quantize the KV (the host pool keeps that type)
enum llama_kvmem_gpu_type_e {
    LLAMA_KVMEM_GPU_TYPE_F16  = 0, // f16 working set over a quantized host pool: stage-in dequantizes, write-through quantizes
    LLAMA_KVMEM_GPU_TYPE_SAME = 1, // the working set has the pool's type (copies are plain)
};

// where the block summaries live and selection scores them (mass, hybrid)
enum llama_kvmem_score_on_e {
    LLAMA_KVMEM_SCORE_ON_AUTO   = 0, // device when the working set is on a device (a GPU), else host
    LLAMA_KVMEM_SCORE_ON_DEVICE = 1, // the working set's backend (VRAM on a GPU, the CPU backend otherwise): a ggml graph
    LLAMA_KVMEM_SCORE_ON_HOST   = 2, // host RAM, the host scorer (when VRAM is short: ~4 KiB per history token on a 27B)
};

struct llama_kvmem_params {
    uint32_t budget       = 0;   // GPU working-set tokens, 0 = tiering off
    uint32_t block        = 128; // tokens per block
    uint32_t sink         = 128; // tokens at the start that always stay resident (rounded up to blocks)
    uint32_t recent       = 256; // newest tokens that always stay resident (rounded up to blocks)
    uint32_t gen_reserve  = 256; // extra cells per sequence for the partial tail and generated tokens
    uint32_t query_tokens = 128; // the query: at most this many tokens of the last user message (its end)
    uint32_t refresh      = 128; // re-select every N generated tokens, 0 = only when the reserve is full
    uint32_t host_mib     = 0;   // host pool cap in MiB, 0 = enough for the whole context
    std::string disk_path;       // the disk tier's directory, empty = no disk tier
    uint32_t disk_mib     = 0;   // the disk tier's size in MiB, 0 = the host pool's size
    int32_t  method       = LLAMA_KVMEM_METHOD_RETRIEVAL;
    int32_t  prefill      = LLAMA_KVMEM_PREFILL_WINDOW;
    int32_t  gpu_type     = LLAMA_KVMEM_GPU_TYPE_F16;
    int32_t  score_on     = LLAMA_KVMEM_SCORE_ON_AUTO;
    bool     trace        = false;
    uint32_t n_threads    = 1;   // the context's threads (the host-side scorer uses as many)

    class llama_kvmem_cache * leader = nullptr; // MTP draft contexts: the target's tiered cache to follow
};

inline constexpr uint32_t kvmem_div_up(uint32_t a, uint32_t b) { return (a + b - 1)/b; }

// the smallest budget that holds the sink and the recent window (whole blocks), one retrieved block and the
// partial tail
inline uint32_t kvmem_min_budget(const llama_kvmem_params & kp) {
    return (kvmem_div_up(kp.sink, kp.block) + kvmem_div_up(kp.recent, kp.block) + 2)*kp.block;
}
