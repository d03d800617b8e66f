// KVMem: block copies staged on the working set's backend (kvmem-llama). See llama-kvmem-stager.h.

#include "llama-kvmem-stager.h"

#include "llama-impl.h"

#include <algorithm>
#include <stdexcept>

// the cell indices of this many blocks' rounds are uploaded before the stager waits for its stream to reuse them
static constexpr size_t KVMEM_STAGE_INDEX_BLOCKS = 1024;

kvmem_stager::~kvmem_stager() {
    wait_stream(); // rounds still read the staging buffer and the index arena
    for (int h = 0; h < 2; ++h) {
        if (used_by_graph[h]) {
            ggml_backend_event_free(used_by_graph[h]);
        }
        if (used_by_copy[h]) {
            ggml_backend_event_free(used_by_copy[h]);
        }
    }
    if (be_copy && be_copy != be) {
        ggml_backend_free(be_copy);
    }
    if (galloc) {
        ggml_gallocr_free(galloc);
    }
    if (idx_buf) {
        ggml_backend_buffer_free(idx_buf);
    }
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

void kvmem_stager::init(ggml_backend_t be_in, const std::vector<kvmem_layer_rows> & layers_in, uint32_t block_in,
        size_t max_bytes) {
    GGML_ASSERT(ctx == nullptr && be_in && !layers_in.empty() && block_in > 0);
    be = be_in;
    layers = layers_in;
    block = block_in;
    for (const auto & l : layers) {
        GGML_ASSERT(l.pool_k == layers[0].pool_k && l.pool_v == layers[0].pool_v && "one pool type for all layers");
        off_k.push_back(slot_bytes);
        off_v.push_back(slot_bytes + (size_t) block*l.hrow_k);
        slot_bytes += (size_t) block*(l.hrow_k + l.hrow_v);
    }
    cap = (uint32_t) std::max<size_t>(1, max_bytes/2/slot_bytes);

    init_copy_stream();
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(be);
    alloc_tensors(buft);
    alloc_index_arena();
    galloc = ggml_gallocr_new(buft);
    const size_t n_nodes = graph_nodes();
    for (auto & m : meta) {
        m.resize(ggml_tensor_overhead()*n_nodes + ggml_graph_overhead_custom(n_nodes, false));
    }
    // the largest round of each direction, planned now: no allocation while a selection stages
    for (const direction d : { direction::to_device, direction::to_host }) {
        ggml_init_params params = { meta[0].size(), meta[0].data(), /*no_alloc*/ true };
        ggml_context * g = ggml_init(params);
        GGML_ASSERT(ggml_gallocr_reserve(galloc, build_graph(g, d, 0, cap)) && "kvmem: cannot reserve the staging graph");
        ggml_free(g);
    }
}

void kvmem_stager::init_copy_stream() {
    be_copy = be;
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        return; // the CPU backend copies at once: nothing to overlap
    }
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    if (!props.caps.events) {
        return;
    }
    for (int h = 0; h < 2; ++h) {
        used_by_graph[h] = ggml_backend_event_new(dev);
        used_by_copy[h]  = ggml_backend_event_new(dev);
    }
    const bool have_events = used_by_graph[0] && used_by_graph[1] && used_by_copy[0] && used_by_copy[1];
    ggml_backend_t copy = have_events ? ggml_backend_dev_init(dev, nullptr) : nullptr;
    if (copy) {
        be_copy = copy;
        return;
    }
    for (int h = 0; h < 2; ++h) { // one stream after all: no events needed
        for (ggml_backend_event_t * ev : { &used_by_graph[h], &used_by_copy[h] }) {
            if (*ev) {
                ggml_backend_event_free(*ev);
                *ev = nullptr;
            }
        }
    }
}

void kvmem_stager::wait_for(ggml_backend_t waiter, ggml_backend_event_t ev) const {
    if (be_copy != be) {
        ggml_backend_event_wait(waiter, ev); // an event not yet recorded has passed
    }
}

void kvmem_stager::record(ggml_backend_event_t ev, ggml_backend_t stream) const {
    if (be_copy != be) {
        ggml_backend_event_record(ev, stream);
    }
}

void kvmem_stager::alloc_tensors(ggml_backend_buffer_type_t buft) {
    // the staging memory is viewed as rows of the pool's K type and of its V type (one 1-D base tensor of each type
    // over the same bytes); the constant row indices and each half's cell indices follow it
    ggml_init_params params = { 5*ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
    ctx = ggml_init(params);
    const size_t total = (size_t) 2*cap*slot_bytes;
    auto make_base = [&](ggml_type type, const char * name) {
        const int64_t n_units = (int64_t) ((total + ggml_type_size(type) - 1)/ggml_type_size(type));
        ggml_tensor * t = ggml_new_tensor_1d(ctx, type, n_units*ggml_blck_size(type));
        ggml_set_name(t, name);
        return t;
    };
    base_k = make_base(layers[0].pool_k, "kvmem_stage_k");
    base_v = make_base(layers[0].pool_v, "kvmem_stage_v");
    slot_tok  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, block, cap);
    block_tok = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, block);
    cells = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, (int64_t) cap*block, 2);
    const size_t align = ggml_backend_buft_get_alignment(buft);
    auto aligned = [align](size_t n) { return (n + align - 1)/align*align; };
    const size_t staging = aligned(std::max(ggml_backend_buft_get_alloc_size(buft, base_k), ggml_backend_buft_get_alloc_size(buft, base_v)));
    const size_t off_tok = staging;
    const size_t off_blk = off_tok + aligned(ggml_backend_buft_get_alloc_size(buft, slot_tok));
    const size_t off_cells = off_blk + aligned(ggml_backend_buft_get_alloc_size(buft, block_tok));
    const size_t size = off_cells + aligned(ggml_backend_buft_get_alloc_size(buft, cells));
    buf = ggml_backend_buft_alloc_buffer(buft, size);
    if (!buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the staging buffer (%.1f MiB in %s)",
                    size/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    uint8_t * base = (uint8_t *) ggml_backend_buffer_get_base(buf);
    GGML_ASSERT(ggml_backend_tensor_alloc(buf, base_k, base) == GGML_STATUS_SUCCESS);
    GGML_ASSERT(ggml_backend_tensor_alloc(buf, base_v, base) == GGML_STATUS_SUCCESS);
    GGML_ASSERT(ggml_backend_tensor_alloc(buf, slot_tok, base + off_tok) == GGML_STATUS_SUCCESS);
    GGML_ASSERT(ggml_backend_tensor_alloc(buf, block_tok, base + off_blk) == GGML_STATUS_SUCCESS);
    GGML_ASSERT(ggml_backend_tensor_alloc(buf, cells, base + off_cells) == GGML_STATUS_SUCCESS);
    std::vector<int32_t> tok32((size_t) block*cap);
    std::vector<int64_t> tok64(block);
    for (size_t i = 0; i < tok32.size(); ++i) {
        tok32[i] = (int32_t) (i % block);
    }
    for (uint32_t t = 0; t < block; ++t) {
        tok64[t] = t;
    }
    ggml_backend_tensor_set(slot_tok, tok32.data(), 0, ggml_nbytes(slot_tok));
    ggml_backend_tensor_set(block_tok, tok64.data(), 0, ggml_nbytes(block_tok));
}

void kvmem_stager::alloc_index_arena() {
    idx_size = KVMEM_STAGE_INDEX_BLOCKS*block*sizeof(int32_t);
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_buffer_type_t host = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    idx_buf = host ? ggml_backend_buft_alloc_buffer(host, idx_size) : nullptr;
    if (idx_buf) {
        idx_base = (uint8_t *) ggml_backend_buffer_get_base(idx_buf);
    } else {
        idx_plain.resize(idx_size);
        idx_base = idx_plain.data();
    }
}

size_t kvmem_stager::staging_bytes() const {
    return buf ? ggml_backend_buffer_get_size(buf) : 0;
}

void kvmem_stager::queue(direction d, queued item) {
    GGML_ASSERT(item.idx.size() == block);
    if (dir != d || q.size() == cap) {
        submit();
    }
    if (q.empty()) {
        // a round starts in `half`: what the copy stream puts there (its copies in, its cell indices) waits for the
        // graph that last used the half, two rounds ago
        wait_for(be_copy, used_by_graph[half]);
    }
    dir = d;
    q.push_back(std::move(item));
}

void kvmem_stager::to_device(const uint8_t * host, const std::vector<uint32_t> & idx) {
    queue(direction::to_device, { host, nullptr, idx });
    // the round's graph waits for its copies (run_graph)
    ggml_backend_tensor_set_async(be_copy, base_k, host, slot_offset(half, q.size() - 1), slot_bytes);
}

void kvmem_stager::to_host(uint8_t * host, const std::vector<uint32_t> & idx) {
    queue(direction::to_host, { nullptr, host, idx });
}

ggml_tensor * kvmem_stager::slot_rows(ggml_context * g, int h, uint32_t lt, bool is_v, int64_t n) const {
    const kvmem_layer_rows & l = layers[lt];
    ggml_tensor * t = is_v ? l.v : l.k;
    return ggml_view_3d(g, is_v ? base_v : base_k, t->ne[0], block, n, is_v ? l.hrow_v : l.hrow_k,
            slot_bytes, slot_offset(h, 0) + (is_v ? off_v[lt] : off_k[lt]));
}

ggml_cgraph * kvmem_stager::build_graph(ggml_context * g, direction d, int h, int64_t n) const {
    const bool in = d == direction::to_device;
    ggml_cgraph * gf = ggml_new_graph_custom(g, graph_nodes(), false);
    // in: rows t of every staged slot (get_rows) into the cells (set_rows); out: the cells (get_rows) into rows t of
    // every staging slot (set_rows)
    ggml_tensor * idx = ggml_view_1d(g, cells, n*block, (size_t) h*cells->nb[1]);
    ggml_tensor * rows = in ? ggml_view_2d(g, slot_tok, block, n, slot_tok->nb[1], 0) : ggml_view_2d(g, block_tok, block, 1, ggml_nbytes(block_tok), 0);
    for (uint32_t lt = 0; lt < layers.size(); ++lt) {
        for (const bool is_v : { false, true }) {
            ggml_tensor * t = is_v ? layers[lt].v : layers[lt].k;
            if (!t) {
                continue;
            }
            ggml_tensor * ws = ggml_view_2d(g, t, t->ne[0], t->ne[1], t->nb[1], 0);
            ggml_tensor * out = nullptr;
            if (in) {
                ggml_tensor * f = ggml_get_rows(g, slot_rows(g, h, lt, is_v, n), rows); // [n_per_row, block, n] f32
                out = ggml_set_rows(g, ws, ggml_reshape_2d(g, f, t->ne[0], n*block), idx);
            } else {
                ggml_tensor * f = ggml_get_rows(g, ws, idx); // [n_per_row, n*block] f32
                out = ggml_set_rows(g, slot_rows(g, h, lt, is_v, n), ggml_reshape_3d(g, f, t->ne[0], block, n), rows);
            }
            ggml_build_forward_expand(gf, out);
        }
    }
    return gf;
}

uint8_t * kvmem_stager::index_room(size_t bytes) {
    GGML_ASSERT(bytes <= idx_size);
    if (idx_used + bytes > idx_size) {
        wait_stream(); // every upload from the arena has run
    }
    uint8_t * p = idx_base + idx_used;
    idx_used += bytes;
    return p;
}

void kvmem_stager::run_graph() {
    const int64_t n = (int64_t) q.size();
    ggml_init_params params = { meta[half].size(), meta[half].data(), /*no_alloc*/ true };
    ggml_context * g = ggml_init(params);
    ggml_cgraph * gf = build_graph(g, dir, half, n);
    GGML_ASSERT(ggml_gallocr_alloc_graph(galloc, gf) && "kvmem: cannot allocate the staging graph");

    const size_t idx_bytes = (size_t) n*block*sizeof(int32_t);
    int32_t * room = (int32_t *) index_room(idx_bytes);
    for (int64_t j = 0; j < n; ++j) {
        for (uint32_t t = 0; t < block; ++t) {
            room[j*block + t] = (int32_t) q[j].idx[t];
        }
    }
    // the cell indices go up on the copy stream (after the wait of queue()), behind this round's copies in or the
    // last copies out of the half: an upload on the graph's stream queued behind the next round's copies in the same
    // copy engine, and each graph then waited for the next round's copies
    ggml_backend_tensor_set_async(be_copy, cells, room, (size_t) half*cells->nb[1], idx_bytes);
    record(used_by_copy[half], be_copy);
    wait_for(be, used_by_copy[half]);
    GGML_ASSERT(ggml_backend_graph_compute_async(be, gf) == GGML_STATUS_SUCCESS);
    record(used_by_graph[half], be);
    ggml_free(g);
}

void kvmem_stager::submit() {
    if (q.empty()) {
        return;
    }
    run_graph();
    if (dir == direction::to_host) {
        wait_for(be_copy, used_by_graph[half]); // the graph has written the half
        for (size_t j = 0; j < q.size(); ++j) {
            ggml_backend_tensor_get_async(be_copy, base_k, q[j].dst, slot_offset(half, j), slot_bytes);
        }
        record(used_by_copy[half], be_copy);
    }
    q.clear();
    dir = direction::none;
    half ^= 1;
    in_flight = true;
}

void kvmem_stager::wait_stream() {
    if (in_flight) {
        ggml_backend_synchronize(be);
        if (be_copy != be) {
            ggml_backend_synchronize(be_copy);
        }
        in_flight = false;
    }
    idx_used = 0;
}

void kvmem_stager::flush() {
    submit();
    wait_stream();
}
