// KVMem: the query rows the graph scorer reads (kvmem-llama). See llama-kvmem-queries.h.

#include "llama-kvmem-queries.h"

#include "llama-impl.h"

#include <stdexcept>

kvmem_query_store::~kvmem_query_store() {
    if (pinned) {
        ggml_backend_buffer_free(pinned);
    }
    if (dev_buf) {
        ggml_backend_buffer_free(dev_buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

void kvmem_query_store::init(ggml_backend_t backend, const kvmem_dims & dims, uint32_t seqs, uint32_t ring_rows,
        uint32_t turn_rows, uint32_t newest_rows) {
    GGML_ASSERT(ctx == nullptr && seqs > 0 && ring_rows > 0 && turn_rows > 0 && newest_rows > 0);
    d = dims;
    n_seqs = seqs;
    n_ring = ring_rows;
    n_turn = turn_rows;
    n_newest = newest_rows;
    ggml_init_params params = { ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
    ctx = ggml_init(params);
    dev_rows = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, (int64_t) d.query_row(), n_turn + n_newest);
    ggml_set_name(dev_rows, "kvmem_query_rows");
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backend);
    dev_buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!dev_buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the query rows (%.1f MiB in %s)",
                    (double) device_bytes()/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    // pinned: uploads from it are direct copies, without the host's staging
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_buffer_type_t host_buft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    pinned = host_buft ? ggml_backend_buft_alloc_buffer(host_buft, host_bytes()) : nullptr;
    if (pinned) {
        host = (float *) ggml_backend_buffer_get_base(pinned);
    } else {
        plain.assign(host_bytes()/sizeof(float), 0.0f);
        host = plain.data();
    }
}

size_t kvmem_query_store::device_bytes() const {
    return (size_t) (n_turn + n_newest)*d.query_row()*sizeof(float);
}

size_t kvmem_query_store::host_bytes() const {
    return (size_t) n_seqs*(n_ring + n_turn)*d.query_row()*sizeof(float);
}

float * kvmem_query_store::ring_row(uint32_t seq, int32_t pos) {
    GGML_ASSERT(seq < n_seqs && pos >= 0);
    return ring_at(seq, (uint32_t) pos % n_ring);
}

void kvmem_query_store::upload(uint32_t seq, const std::vector<int32_t> & positions, uint32_t r0) {
    const size_t row = d.query_row()*sizeof(float);
    GGML_ASSERT(seq < n_seqs && r0 + positions.size() <= (size_t) dev_rows->ne[1]);
    for (size_t r = 0; r < positions.size(); ) {
        // a run of consecutive positions is one of consecutive slots up to the ring's end
        const uint32_t slot = (uint32_t) positions[r] % n_ring;
        size_t n = 1;
        while (r + n < positions.size() && positions[r + n] == positions[r] + (int32_t) n && slot + n < n_ring) {
            n++;
        }
        ggml_backend_tensor_set(dev_rows, ring_at(seq, slot), (r0 + r)*row, n*row);
        r += n;
    }
}

void kvmem_query_store::save_owner() {
    if (dev_owner >= 0 && !owner_saved) {
        ggml_backend_tensor_get(dev_rows, turn_copy((uint32_t) dev_owner), 0, (size_t) dev_n*d.query_row()*sizeof(float));
        owner_saved = true;
    }
}

void kvmem_query_store::keep_turn(uint32_t seq, const std::vector<int32_t> & positions) {
    GGML_ASSERT(seq < n_seqs && positions.size() <= n_turn);
    if (dev_owner != (int64_t) seq) {
        save_owner();
    }
    upload(seq, positions, 0);
    dev_owner = seq;
    dev_n = (uint32_t) positions.size();
    owner_saved = false; // saved only when another turn needs the device's rows
}

kvmem_graph_scorer::rows_span kvmem_query_store::selection_rows(uint32_t seq, uint32_t n_question,
        const std::vector<int32_t> & newest) {
    GGML_ASSERT(seq < n_seqs && n_question <= n_turn && newest.size() <= n_newest);
    if (n_question > 0 && (dev_owner != (int64_t) seq || n_question > dev_n)) {
        // another turn took the device's rows, or newest rows took the place of some: from the host copy
        GGML_ASSERT((dev_owner != (int64_t) seq || owner_saved) && "a question's rows are kept by keep_turn first");
        save_owner();
        ggml_backend_tensor_set(dev_rows, turn_copy(seq), 0, (size_t) n_question*d.query_row()*sizeof(float));
        dev_owner = seq;
        dev_n = n_question;
        owner_saved = true;
    }
    if (!newest.empty() && dev_owner >= 0 && dev_n > n_question) {
        save_owner(); // the newest rows take the place of the device's question rows past n_question
        dev_n = n_question;
    }
    upload(seq, newest, n_question);
    return span(n_question + (uint32_t) newest.size());
}

kvmem_graph_scorer::rows_span kvmem_query_store::span(uint32_t n) const {
    return { dev_rows, 0, d.query_row()*sizeof(float), (size_t) d.n_head*d.head_dim*sizeof(float), n };
}

kvmem_graph_scorer::rows_span kvmem_query_store::largest() const {
    return span(n_turn + n_newest);
}
