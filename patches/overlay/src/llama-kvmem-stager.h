#pragma once

// KVMem: block copies staged on the working set's backend (kvmem-llama).
//
// A stage-in is one contiguous host->backend copy of the whole host slot into a staging buffer there; a ggml graph
// then converts the rows from the pool's type (get_rows, to f32) and scatters them into the block's cells in the
// working set's type (set_rows), for every tiered layer and for all blocks staged since the last flush at once. A
// write-through is the reverse: get_rows gathers the block's cells, set_rows writes them into a staging slot in the
// pool's type (quantizing there), then one backend->host copy per block. Nothing is converted on the host, and
// there is no host wait between blocks or between rounds (only flush() waits): the graphs' row indices are constant
// and live on the backend, and each round's cell indices are uploaded from pinned host memory (an upload from
// pageable memory would wait for the stream) into the half's own index tensor. The staging buffer's two halves take
// turns: where the device has events, the copies and the index uploads run on a second stream of their own, so
// that one half's copies overlap the other half's graph (measured on the H200: copies and graphs on one stream moved
// 37.7 GB/s where pinned copies alone reach 54).
// The same graphs run on the CPU backend (CI, one stream) and on CUDA.

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
    // V rows] in the pool's types); up to max_bytes of staging on be (at least one slot per half)
    void init(ggml_backend_t be, const std::vector<kvmem_layer_rows> & layers, uint32_t block, size_t max_bytes);

    // host slot -> cells idx (idx[t] receives token t); done by the next flush() at the latest
    void to_device(const uint8_t * host, const std::vector<uint32_t> & idx);
    // cells idx -> host slot; done by the next flush() at the latest (the cells must not change before it)
    void to_host(uint8_t * host, const std::vector<uint32_t> & idx);
    // runs what is queued and waits for everything submitted
    void flush();

    size_t staging_bytes() const;
    uint32_t capacity() const { return 2*cap; } // blocks of both halves
    bool overlaps() const { return be_copy != be; } // copies on a stream of their own

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
    uint32_t cap = 0;                      // blocks per round: the slots of one half

    // the copies' stream (be itself where the device has no events) and, per half, the last point each stream used
    // it at: a stream waits for the other's event before it writes a half the other may still read or write
    ggml_backend_t be_copy = nullptr;
    ggml_backend_event_t used_by_graph[2] = { nullptr, nullptr };
    ggml_backend_event_t used_by_copy[2]  = { nullptr, nullptr };
    int half = 0;                          // the half this round fills

    ggml_context * ctx = nullptr;          // the staging tensors (one view base per type, all over one buffer)
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * base_k = nullptr;
    ggml_tensor * base_v = nullptr;
    ggml_tensor * slot_tok = nullptr;      // i32 [block, cap]: token t of every slot of a half (stage-in's get_rows)
    ggml_tensor * block_tok = nullptr;     // i64 [block]: token t of a slot (write-through's set_rows)
    ggml_tensor * cells = nullptr;         // i32 [block*cap, 2]: the cell indices of each half's round
    ggml_gallocr_t galloc = nullptr;
    // each half's graph's tensor and node structs: CUDA keys its cached graphs by the first node's address, so each
    // half keeps a graph of its own (one shared address would see its pointers change every round and never replay)
    std::vector<uint8_t> meta[2];

    // the rounds' cell indices until they are uploaded: pinned where the backend's device has host memory
    ggml_backend_buffer_t idx_buf = nullptr;
    std::vector<uint8_t> idx_plain;        // where it has none (the CPU backend copies at once)
    uint8_t * idx_base = nullptr;
    size_t idx_size = 0;
    size_t idx_used = 0;                   // bytes of rounds submitted since the last wait

    direction dir = direction::none;
    std::vector<queued> q;

    bool in_flight = false;                // rounds submitted since the last flush()

    void queue(direction d, queued item);
    // runs what is queued without waiting: a full half's round, in stream order with the next one (in the other half)
    void submit();
    // a view of half h's first n slots' K (or V) rows of layer lt: [n_per_row, block, n] in the pool's type
    ggml_tensor * slot_rows(ggml_context * g, int h, uint32_t lt, bool is_v, int64_t n) const;
    size_t slot_offset(int h, size_t j) const { return ((size_t) h*cap + j)*slot_bytes; }
    size_t graph_nodes() const { return layers.size()*2*8 + 16; }
    // the graph moving n blocks of half h in direction d (their cell indices: the first n*block of cells' row h)
    ggml_cgraph * build_graph(ggml_context * g, direction d, int h, int64_t n) const;
    void init_copy_stream();
    // stream `waiter` holds until `ev` (recorded by the other stream) has passed; nothing with one stream
    void wait_for(ggml_backend_t waiter, ggml_backend_event_t ev) const;
    void record(ggml_backend_event_t ev, ggml_backend_t stream) const;
    void alloc_tensors(ggml_backend_buffer_type_t buft);
    void alloc_index_arena();
    // room for the next round's cell indices in the arena (waits for the stream when the arena is used up)
    uint8_t * index_room(size_t bytes);
    void run_graph();
    void wait_stream();
};
