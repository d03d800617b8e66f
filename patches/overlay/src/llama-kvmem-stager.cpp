// KVMem: block copies staged on the working set's backend (kvmem-llama). See llama-kvmem-stager.h.

#include "llama-kvmem-stager.h"

#include "llama-impl.h"

#include <algorithm>
#include <stdexcept>

kvmem_stager::~kvmem_stager() {
    if (in_flight) {
        ggml_backend_synchronize(be); // rounds still read the staging buffer
    }
    if (galloc) {
        ggml_gallocr_free(galloc);
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
    cap = (uint32_t) std::max<size_t>(1, max_bytes/slot_bytes);

    // the staging memory is viewed as rows of the pool's K type and of its V type: one 1-D base tensor of each
    // type over the same buffer
    ggml_init_params params = { 2*ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
    ctx = ggml_init(params);
    const size_t total = (size_t) cap*slot_bytes;
    auto make_base = [&](ggml_type type, const char * name) {
        const int64_t n_units = (int64_t) ((total + ggml_type_size(type) - 1)/ggml_type_size(type));
        ggml_tensor * t = ggml_new_tensor_1d(ctx, type, n_units*ggml_blck_size(type));
        ggml_set_name(t, name);
        return t;
    };
    base_k = make_base(layers[0].pool_k, "kvmem_stage_k");
    base_v = make_base(layers[0].pool_v, "kvmem_stage_v");
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(be);
    const size_t size = std::max(ggml_backend_buft_get_alloc_size(buft, base_k), ggml_backend_buft_get_alloc_size(buft, base_v));
    buf = ggml_backend_buft_alloc_buffer(buft, size);
    if (!buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the staging buffer (%.1f MiB in %s)",
                    size/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    void * base = ggml_backend_buffer_get_base(buf);
    GGML_ASSERT(ggml_backend_tensor_alloc(buf, base_k, base) == GGML_STATUS_SUCCESS);
    GGML_ASSERT(ggml_backend_tensor_alloc(buf, base_v, base) == GGML_STATUS_SUCCESS);
    galloc = ggml_gallocr_new(buft);
}

size_t kvmem_stager::staging_bytes() const {
    return buf ? ggml_backend_buffer_get_size(buf) : 0;
}

void kvmem_stager::queue(direction d, queued item) {
    GGML_ASSERT(item.idx.size() == block);
    if (dir != d || q.size() == cap) {
        submit();
    }
    dir = d;
    q.push_back(std::move(item));
}

void kvmem_stager::to_device(const uint8_t * host, const std::vector<uint32_t> & idx) {
    queue(direction::to_device, { host, nullptr, idx });
    // on the stager's own stream, so the graph that reads it comes after it
    ggml_backend_tensor_set_async(be, base_k, host, (q.size() - 1)*slot_bytes, slot_bytes);
}

void kvmem_stager::to_host(uint8_t * host, const std::vector<uint32_t> & idx) {
    queue(direction::to_host, { nullptr, host, idx });
}

ggml_tensor * kvmem_stager::slot_rows(ggml_context * g, uint32_t lt, bool is_v) const {
    const kvmem_layer_rows & l = layers[lt];
    ggml_tensor * t = is_v ? l.v : l.k;
    return ggml_view_3d(g, is_v ? base_v : base_k, t->ne[0], block, (int64_t) q.size(), is_v ? l.hrow_v : l.hrow_k,
            slot_bytes, is_v ? off_v[lt] : off_k[lt]);
}

void kvmem_stager::run_graph() {
    const int64_t n = (int64_t) q.size();
    const bool in = dir == direction::to_device;
    const size_t n_nodes = layers.size()*2*8 + 16;
    meta.resize(ggml_tensor_overhead()*n_nodes + ggml_graph_overhead_custom(n_nodes, false));
    ggml_init_params params = { meta.size(), meta.data(), /*no_alloc*/ true };
    ggml_context * g = ggml_init(params);
    ggml_cgraph * gf = ggml_new_graph_custom(g, n_nodes, false);

    // in: rows t of every staged slot (get_rows) into the cells (set_rows); out: the cells (get_rows) into rows t of
    // every staging slot (set_rows)
    ggml_tensor * cells = ggml_new_tensor_1d(g, in ? GGML_TYPE_I64 : GGML_TYPE_I32, n*block);
    ggml_tensor * rows  = in ? ggml_new_tensor_2d(g, GGML_TYPE_I32, block, n) : ggml_new_tensor_2d(g, GGML_TYPE_I64, block, 1);
    ggml_set_input(cells);
    ggml_set_input(rows);
    for (uint32_t lt = 0; lt < layers.size(); ++lt) {
        for (const bool is_v : { false, true }) {
            ggml_tensor * t = is_v ? layers[lt].v : layers[lt].k;
            if (!t) {
                continue;
            }
            ggml_tensor * ws = ggml_view_2d(g, t, t->ne[0], t->ne[1], t->nb[1], 0);
            ggml_tensor * out = nullptr;
            if (in) {
                ggml_tensor * f = ggml_get_rows(g, slot_rows(g, lt, is_v), rows); // [n_per_row, block, n] f32
                out = ggml_set_rows(g, ws, ggml_reshape_2d(g, f, t->ne[0], n*block), cells);
            } else {
                ggml_tensor * f = ggml_get_rows(g, ws, cells); // [n_per_row, n*block] f32
                out = ggml_set_rows(g, slot_rows(g, lt, is_v), ggml_reshape_3d(g, f, t->ne[0], block, n), rows);
            }
            ggml_build_forward_expand(gf, out);
        }
    }
    GGML_ASSERT(ggml_gallocr_alloc_graph(galloc, gf) && "kvmem: cannot allocate the staging graph");

    std::vector<int64_t> i64;
    std::vector<int32_t> i32;
    if (in) {
        for (const auto & item : q) {
            i64.insert(i64.end(), item.idx.begin(), item.idx.end());
            for (uint32_t t = 0; t < block; ++t) {
                i32.push_back((int32_t) t);
            }
        }
        ggml_backend_tensor_set_async(be, cells, i64.data(), 0, ggml_nbytes(cells));
        ggml_backend_tensor_set_async(be, rows, i32.data(), 0, ggml_nbytes(rows));
    } else {
        for (const auto & item : q) {
            i32.insert(i32.end(), item.idx.begin(), item.idx.end());
        }
        for (uint32_t t = 0; t < block; ++t) {
            i64.push_back(t);
        }
        ggml_backend_tensor_set_async(be, cells, i32.data(), 0, ggml_nbytes(cells));
        ggml_backend_tensor_set_async(be, rows, i64.data(), 0, ggml_nbytes(rows));
    }
    // ordered on the stager's stream after this round's copies and before the next round's: no host wait
    GGML_ASSERT(ggml_backend_graph_compute_async(be, gf) == GGML_STATUS_SUCCESS);
    ggml_free(g);
}

void kvmem_stager::submit() {
    if (q.empty()) {
        return;
    }
    run_graph();
    if (dir == direction::to_host) {
        for (size_t j = 0; j < q.size(); ++j) {
            ggml_backend_tensor_get_async(be, base_k, q[j].dst, j*slot_bytes, slot_bytes);
        }
    }
    q.clear();
    dir = direction::none;
    in_flight = true;
}

void kvmem_stager::flush() {
    submit();
    if (in_flight) {
        ggml_backend_synchronize(be);
        in_flight = false;
    }
}
