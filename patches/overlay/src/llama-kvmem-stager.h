#pragma once

// KVMem: block copies staged on the working set's backend (kvmem-llama).
//
// A stage-in is one contiguous host->backend copy of the whole host slot into a staging buffer there; a ggml graph
// then converts the rows from the pool's type (get_rows, to f32) and scatters them into the block's cells in the
// working set's type (set_rows), for every tiered layer and for all blocks staged since the last flush at once. A
// write-through is the reverse: get_rows gathers the block's cells, set_rows writes them into a staging slot in the
// pool's type (quantizing there), then one backend->host copy per block. Nothing is converted on the host, and
// there is no host wait between blocks or between rounds of a full staging buffer (only flush() waits). The same
// graphs run on the CPU backend (CI) and on CUDA.

#include "llama-kvmem-pool.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <vector>

class kvmem_stager {
public:
    kvmem_stager() = default;
    kvmem_stager(const kvmem_stager &) = delete;
    kvmem_stager & operator=(const kvmem_stager &) = delete;
    ~kvmem_stager();

    // every layer's K and V tensors live on backend be; a host slot is laid out as kvmem_host_pool's ([layer][K rows,
    // V rows] in the pool's types); up to max_bytes of staging on be (at least one slot)
    void init(ggml_backend_t be, const std::vector<kvmem_layer_rows> & layers, uint32_t block, size_t max_bytes);

    // host slot -> cells idx (idx[t] receives token t); done by the next flush() at the latest
    void to_device(const uint8_t * host, const std::vector<uint32_t> & idx);
    // cells idx -> host slot; done by the next flush() at the latest (the cells must not change before it)
    void to_host(uint8_t * host, const std::vector<uint32_t> & idx);
    // runs what is queued and waits for everything submitted
    void flush();

    size_t staging_bytes() const;
    uint32_t capacity() const { return cap; }

private:
    enum class direction { none, to_device, to_host };
    struct queued {
        const uint8_t * src = nullptr; // host slot read by a stage-in
        uint8_t *       dst = nullptr; // host slot written by a write-through
        std::vector<uint32_t> idx;
    };

    ggml_backend_t be = nullptr;
    std::vector<kvmem_layer_rows> layers;
    std::vector<size_t> off_k, off_v; // of each layer's K and V rows within a slot
    uint32_t block = 0;
    size_t slot_bytes = 0;
    uint32_t cap = 0;

    ggml_context * ctx = nullptr;          // the staging tensors (one view base per type, all over one buffer)
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * base_k = nullptr;
    ggml_tensor * base_v = nullptr;
    ggml_gallocr_t galloc = nullptr;
    std::vector<uint8_t> meta;             // the graph's tensor and node structs

    direction dir = direction::none;
    std::vector<queued> q;

    bool in_flight = false;                // rounds submitted since the last flush()

    void queue(direction d, queued item);
    // runs what is queued without waiting: a full staging buffer's round, in stream order with the next one
    void submit();
    // a view of every queued slot's K (or V) rows of layer lt: [n_per_row, block, n_queued] in the pool's type
    ggml_tensor * slot_rows(ggml_context * g, uint32_t lt, bool is_v) const;
    void run_graph();
};
