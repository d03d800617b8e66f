// The tiering settings: the defaults (one place, llama-kvmem-params.h) and the one check of their values.

#include "test-kvmem.h"

#include "llama.h"
#include "llama-kvmem-params.h"

#include <string>

static std::string error_of(void (*edit)(llama_context_params &)) {
    llama_context_params p = llama_context_default_params();
    edit(p);
    return llama_kvmem_check_params(&p);
}

KV_SUITE(params) {
    const llama_kvmem_params kp;
    const llama_context_params p = llama_context_default_params();
    KV_CHECK(p.kvmem_budget == 0 && p.kvmem_block == (int32_t) kp.block && p.kvmem_sink == (int32_t) kp.sink &&
             p.kvmem_recent == (int32_t) kp.recent && p.kvmem_gen_reserve == (int32_t) kp.gen_reserve &&
             p.kvmem_query_tokens == (int32_t) kp.query_tokens && p.kvmem_refresh == (int32_t) kp.refresh &&
             p.kvmem_method == kp.method && p.kvmem_prefill == kp.prefill && p.kvmem_gpu_type == kp.gpu_type);
    KV_CHECK(kvmem_min_budget(kp) == (1 + 2 + 2)*128);

    KV_CHECK(error_of([](llama_context_params &) {}).empty());
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_budget = 640; }).empty());
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_budget = 256; }).find("--kvmem-budget 256 is too small") == 0);
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_budget = 256; }).find("at least 640") != std::string::npos);
    // the other values are checked whether or not tiering is on
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_block = 8; }).find("--kvmem-block must be in [16, 4096]") == 0);
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_query_tokens = 0; }).find("--kvmem-query-tokens") == 0);
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_gen_reserve = 0; }).find("--kvmem-gen-reserve") == 0);
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_method = 99; }).find("--kvmem-method 99 is unknown") == 0);
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_prefill = 5; }).find("--kvmem-prefill") == 0);
    KV_CHECK(error_of([](llama_context_params & q) { q.kvmem_gpu_type = 3; }).find("--kvmem-gpu-type") == 0);
}
