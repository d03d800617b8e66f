#pragma once

// KVMem: the query rows the graph scorer reads (kvmem-llama).
//
// Per sequence, a ring of the newest tokens' rows (position pos in slot pos % ring rows) in host memory, pinned
// where the scoring device has pinned memory, written from the captures' readback; and one question on the device.
// A turn puts its question's rows on the device straight from the ring (no gathering on the host: a turn's
// question is 50 MB on a 27B model); they stay there for its re-selections, which upload only their newest rows,
// right after the question's: a selection's rows are one span, which the scorer cuts into steps as its bound
// allows (two spans could take a partial step each).
// When another sequence's turn takes the device's question rows, the rows it replaces go back to their sequence's
// host copy first (the ring moves on while a sequence answers), from where they return when needed. Device memory
// is one question and one selection's newest rows, whatever the number of sequences. Which positions have rows is
// the sequence's business (kvmem_seq_rows::query).

#include "llama-kvmem-score.h"
#include "llama-kvmem-summaries.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <vector>

class kvmem_query_store {
public:
    kvmem_query_store() = default;
    kvmem_query_store(const kvmem_query_store &) = delete;
    kvmem_query_store & operator=(const kvmem_query_store &) = delete;
    ~kvmem_query_store();

    // n_seqs sequences of ring_rows newest rows (and a host copy of turn_rows question rows), the device's
    // turn_rows question rows and newest_rows rows of a selection (throws with the size when it cannot allocate)
    void init(ggml_backend_t backend, const kvmem_dims & dims, uint32_t n_seqs, uint32_t ring_rows, uint32_t turn_rows,
            uint32_t newest_rows);

    // the ring's row of a position of seq ([layer][head][head_dim] floats), to write a captured row into
    float * ring_row(uint32_t seq, int32_t pos);

    // seq's question is the ring's rows of these positions (at most turn_rows, each still in the ring): onto the device
    void keep_turn(uint32_t seq, const std::vector<int32_t> & positions);
    // one selection's rows on the device: the first n_question rows of seq's question (brought back from its host
    // copy first when another turn took them), then the ring's rows of `newest` (at most newest_rows), uploaded
    kvmem_graph_scorer::rows_span selection_rows(uint32_t seq, uint32_t n_question, const std::vector<int32_t> & newest);

    // the device's rows whole: the largest selection's (to reserve the scoring graph for)
    kvmem_graph_scorer::rows_span largest() const;

    size_t device_bytes() const;
    size_t host_bytes() const;

private:
    kvmem_dims d;
    uint32_t n_seqs = 0, n_ring = 0, n_turn = 0, n_newest = 0;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t dev_buf = nullptr;
    ggml_tensor * dev_rows = nullptr;    // [query_row, n_turn + n_newest] f32: the question's rows, then the newest
    ggml_backend_buffer_t pinned = nullptr;
    std::vector<float> plain;            // when the device has no pinned memory
    float * host = nullptr;              // [seq][n_ring + n_turn][query_row]: ring, then the question's copy
    int64_t dev_owner = -1;              // the sequence whose question dev_rows holds
    uint32_t dev_n = 0;                  // and how many rows (the newest rows follow the ones a selection uses)
    bool owner_saved = false;            // its host copy holds them too

    float * ring_at(uint32_t seq, uint32_t slot) { return host + ((size_t) seq*(n_ring + n_turn) + slot)*d.query_row(); }
    float * turn_copy(uint32_t seq) { return ring_at(seq, n_ring); }
    // the first n rows of dev_rows, as the graph scorer reads them
    kvmem_graph_scorer::rows_span span(uint32_t n) const;
    // the owner's rows into its host copy (before another turn replaces them)
    void save_owner();
    // upload the ring's rows of `positions` of seq to dev_rows from row r0 on (runs of consecutive slots, one copy each)
    void upload(uint32_t seq, const std::vector<int32_t> & positions, uint32_t r0);
};
