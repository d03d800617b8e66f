#pragma once

// KVMem: block summaries where the working set lives, and the `mass` scorer as a ggml graph over them (kvmem-llama).
//
// Every host slot has room for its block's summary (the chunk means of the block's pre-RoPE keys, per tiered layer
// and KV head) in f16 tensors on the backend that holds the working set: VRAM on a GPU, host memory on the CPU. The
// query rows are there too (llama-kvmem-queries.h); the graph (get_rows, an f32 mul_mat, soft_max, a max pool over
// each block's chunks, sqr, sum) runs there, and only one score per block comes back. The same graph runs on the
// CPU backend (CI) as on CUDA. It computes what kvmem_scorer's `mass` computes on the host (llama-kvmem-score.cpp),
// from f16 summaries (tests/test-kvmem-summaries.cpp compares the two). The store is the summaries' only copy once a
// block is in it: the cache reads one back (get) in the rare case that needs it (a cut inside an old block).


#include "llama-kvmem-score.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <vector>

class kvmem_summary_store {
public:
    kvmem_summary_store() = default;
    kvmem_summary_store(const kvmem_summary_store &) = delete;
    kvmem_summary_store & operator=(const kvmem_summary_store &) = delete;
    ~kvmem_summary_store();

    // summaries of n_slots blocks of n_chunks chunks on backend's device (throws with the size when it cannot be
    // allocated)
    void init(ggml_backend_t backend, const kvmem_dims & dims, uint32_t n_chunks, uint32_t n_slots);

    // a block's summary in the host scorer's layout [layer][kv head][chunk][head_dim] into its slot: converted to
    // f16 in pinned memory and copied on the backend's stream without a wait (a 27B model's block is 64 copies;
    // one wait each cost ~1 ms per block while a long prompt was read); scoring on that stream comes after them
    void put(uint32_t slot, const float * summary);
    // waits for the puts (the host memory they read is reused after this)
    void flush();
    // the summary in a slot, in the host scorer's layout (as put, rounded to f16); waits for the device
    std::vector<float> get(uint32_t slot);

    size_t bytes() const;
    uint32_t n_chunks() const { return n_ch; }
    uint32_t n_slots() const { return slots; }
    const kvmem_dims & dims() const { return d; }
    ggml_tensor * layer(uint32_t lt) const { return keys[lt]; } // [head_dim, n_slots*n_chunks, n_head_kv] f16

private:
    kvmem_dims d;
    uint32_t n_ch = 0;
    uint32_t slots = 0;
    ggml_backend_t backend = nullptr;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<ggml_tensor *> keys;
    // the puts' f16 rows until they are copied: pinned where the device has host memory
    ggml_backend_buffer_t put_buf = nullptr;
    std::vector<ggml_fp16_t> put_plain;
    ggml_fp16_t * put_base = nullptr;
    size_t put_cap = 0;   // f16 values
    size_t put_used = 0;  // since the last wait
};

// the scoring graph's largest tensor, one step's attention matrix [keys, query heads x rows] f32, stays within
// this: a step takes as many query rows as fit (on a 27B model all of a refresh's 192 rows at 32K tokens, one
// step per layer; 31 at 256K). The planner counts it (kvmem_llama/planner.py SCORE_STEP_BYTES).
static constexpr size_t KVMEM_SCORE_STEP_BYTES = (size_t) 96 << 20;

class kvmem_graph_scorer {
public:
    // backend: where the store's buffer lives (the working set's device, or the CPU); step_bytes: the bound above
    kvmem_graph_scorer(ggml_backend_t backend, const kvmem_summary_store & store,
            size_t step_bytes = KVMEM_SCORE_STEP_BYTES);
    kvmem_graph_scorer(const kvmem_graph_scorer &) = delete;
    kvmem_graph_scorer & operator=(const kvmem_graph_scorer &) = delete;
    ~kvmem_graph_scorer();

    // n query rows on the scorer's backend: row r of tiered layer lt is the [head][head_dim] floats at byte
    // offs + lt*layer_nb + r*row_nb of t
    struct rows_span {
        const ggml_tensor * t;
        size_t offs, row_nb, layer_nb;
        uint32_t n;
    };

    // out[i]: the score of the block in slots[i] for the query rows (the spans one after the other): for each
    // (layer, head, row) the softmax over these blocks of each block's best chunk logit, squared, summed over
    // (layer, head, row) -- kvmem_scorer's `mass`
    void score(const std::vector<uint32_t> & slots, const std::vector<rows_span> & rows, std::vector<float> & out);

    // query rows per graph step for this many blocks: as many as the step's bound holds, at least one
    uint32_t rows_per_step(size_t n_blocks) const;

    // take the backend memory of the largest selection now (every slot, these rows): the compute buffer is taken
    // once instead of growing with the history (a reallocation frees and takes device memory, and waits)
    void reserve(const std::vector<rows_span> & largest);
    // run that largest graph once, its scores thrown away: a device's first run (its math library, its kernels) cost
    // 81 ms on the H200, which the first turn of a new server would otherwise wait for
    void warm_up(const std::vector<rows_span> & largest);
    size_t compute_bytes() const;

    // where the last score() spent its time (host microseconds): building and allocating the graph, uploading the
    // block indices, computing and reading the scores back
    struct timing {
        int64_t build_us = 0, upload_us = 0, compute_us = 0;
        uint32_t n_steps = 0;
    };
    const timing & last_timing() const { return last; }

private:
    struct graph {
        ggml_context * ctx = nullptr; // in `meta`: free it when done
        ggml_cgraph * gf = nullptr;
        ggml_tensor * idx = nullptr, * total = nullptr;
        uint32_t n_steps = 0;
    };
    graph build(size_t n_blocks, const std::vector<rows_span> & rows);

    ggml_backend_t backend;
    const kvmem_summary_store & store;
    size_t step_bytes;
    timing last;
    ggml_gallocr_t galloc = nullptr;
    std::vector<uint8_t> meta; // the graph's tensor and node structs (no data)
    std::vector<int32_t> idx_host;
};
