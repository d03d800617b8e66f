// KVMem: block summaries where the working set lives, and the `mass` scorer as a ggml graph (kvmem-llama).
// See llama-kvmem-summaries.h.

#include "llama-kvmem-summaries.h"

#include "llama-impl.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

// the f16 summaries of this many blocks are put before the store waits for their copies
static constexpr size_t KVMEM_SUMMARY_PUT_BLOCKS = 32;

kvmem_summary_store::~kvmem_summary_store() {
    if (put_buf) {
        ggml_backend_buffer_free(put_buf); // the cache flushes after every ubatch's puts: none is in flight
    }
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

void kvmem_summary_store::init(ggml_backend_t backend_in, const kvmem_dims & dims, uint32_t n_chunks, uint32_t n_slots) {
    GGML_ASSERT(ctx == nullptr && backend_in && n_chunks > 0 && n_slots > 0);
    backend = backend_in;
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backend);
    d = dims;
    n_ch = n_chunks;
    slots = n_slots;
    ggml_init_params params = { ggml_tensor_overhead()*d.n_lt, nullptr, /*no_alloc*/ true };
    ctx = ggml_init(params);
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d.head_dim, (int64_t) slots*n_ch, d.n_head_kv);
        ggml_format_name(t, "kvmem_summaries-%u", lt);
        keys.push_back(t);
    }
    buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the block summaries (%.1f MiB in %s); lower the context "
                    "or --kvmem-host-mib", (double) bytes()/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    ggml_backend_buffer_clear(buf, 0);
    put_cap = KVMEM_SUMMARY_PUT_BLOCKS*d.n_lt*d.n_head_kv*n_ch*d.head_dim;
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_buffer_type_t host = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    put_buf = host ? ggml_backend_buft_alloc_buffer(host, put_cap*sizeof(ggml_fp16_t)) : nullptr;
    if (put_buf) {
        put_base = (ggml_fp16_t *) ggml_backend_buffer_get_base(put_buf);
    } else {
        put_plain.resize(put_cap);
        put_base = put_plain.data();
    }
}

size_t kvmem_summary_store::bytes() const {
    return (size_t) d.n_lt*d.n_head_kv*slots*n_ch*d.head_dim*sizeof(ggml_fp16_t);
}

void kvmem_summary_store::put(uint32_t slot, const float * summary) {
    GGML_ASSERT(slot < slots);
    const size_t n = (size_t) n_ch*d.head_dim;
    if (put_used + d.n_lt*d.n_head_kv*n > put_cap) {
        flush();
    }
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        for (uint32_t kv = 0; kv < d.n_head_kv; ++kv) {
            ggml_fp16_t * row16 = put_base + put_used;
            put_used += n;
            ggml_fp32_to_fp16_row(summary + ((size_t) lt*d.n_head_kv + kv)*n, row16, (int64_t) n);
            ggml_tensor * t = keys[lt];
            ggml_backend_tensor_set_async(backend, t, row16, kv*t->nb[2] + (size_t) slot*n_ch*t->nb[1], n*sizeof(ggml_fp16_t));
        }
    }
}

std::vector<float> kvmem_summary_store::get(uint32_t slot) {
    GGML_ASSERT(slot < slots);
    flush(); // a put of this slot may still be on its way
    const size_t n = (size_t) n_ch*d.head_dim;
    std::vector<ggml_fp16_t> row(n);
    std::vector<float> out((size_t) d.n_lt*d.n_head_kv*n);
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        for (uint32_t kv = 0; kv < d.n_head_kv; ++kv) {
            const ggml_tensor * t = keys[lt];
            ggml_backend_tensor_get(t, row.data(), kv*t->nb[2] + (size_t) slot*n_ch*t->nb[1], n*sizeof(ggml_fp16_t));
            ggml_fp16_to_fp32_row(row.data(), out.data() + ((size_t) lt*d.n_head_kv + kv)*n, (int64_t) n);
        }
    }
    return out;
}

void kvmem_summary_store::flush() {
    if (put_used > 0) {
        ggml_backend_synchronize(backend);
        put_used = 0;
    }
}

kvmem_graph_scorer::kvmem_graph_scorer(ggml_backend_t backend_in, const kvmem_summary_store & store_in,
        size_t step_bytes_in) : backend(backend_in), store(store_in), step_bytes(step_bytes_in) {
    galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
}

uint32_t kvmem_graph_scorer::rows_per_step(size_t n_blocks) const {
    const size_t per_row = std::max<size_t>(1, n_blocks*store.n_chunks()*store.dims().n_head*sizeof(float));
    return (uint32_t) std::clamp<size_t>(step_bytes/per_row, 1, UINT32_MAX);
}

kvmem_graph_scorer::~kvmem_graph_scorer() {
    ggml_gallocr_free(galloc);
}

kvmem_graph_scorer::graph kvmem_graph_scorer::build(size_t n_blocks_in, const std::vector<rows_span> & rows) {
    const kvmem_dims & d = store.dims();
    const uint32_t n_ch = store.n_chunks();
    const int64_t n_blocks = (int64_t) n_blocks_in;
    GGML_ASSERT(d.n_head % d.n_head_kv == 0);
    const int64_t group = d.n_head/d.n_head_kv; // query heads per KV head
    const uint32_t step_rows = rows_per_step(n_blocks_in);
    graph g;
    for (const rows_span & r : rows) {
        GGML_ASSERT(r.t && r.t->type == GGML_TYPE_F32 && r.t->buffer && "query rows are f32 on the scorer's backend");
        g.n_steps += (r.n + step_rows - 1)/step_rows;
    }
    const size_t n_nodes = (size_t) d.n_lt*(2 + 14*(size_t) g.n_steps) + 16; // n_steps: per layer
    meta.resize(ggml_tensor_overhead()*n_nodes + ggml_graph_overhead_custom(n_nodes, false));
    ggml_init_params params = { meta.size(), meta.data(), /*no_alloc*/ true };
    g.ctx = ggml_init(params);
    ggml_context * ctx = g.ctx;
    g.gf = ggml_new_graph_custom(ctx, n_nodes, false);

    // the chunk rows of these blocks, the same for every KV head; the query rows where they are, regrouped so that
    // each KV head's summaries are read once per step for all the query heads that share it
    g.idx = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_blocks*n_ch, d.n_head_kv);
    ggml_set_input(g.idx);
    ggml_tensor * total = nullptr;
    const float scale = 1.0f/std::sqrt((float) d.head_dim);
    const size_t fl = sizeof(float);
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        // [head_dim, keys, kv heads] gathered as f32: f32 products (an f16 operand with f32 sums converts it back
        // to f32 inside every product on CUDA; measured slower on the H200)
        ggml_tensor * k = ggml_get_rows(ctx, store.layer(lt), g.idx);
        for (const rows_span & r : rows) {
            for (uint32_t r0 = 0; r0 < r.n; r0 += step_rows) {
                const int64_t nr = std::min(step_rows, r.n - r0);
                // [head_dim, group, kv heads, rows] of this layer -> [head_dim, group*rows, kv heads]
                ggml_tensor * qs = ggml_view_4d(ctx, const_cast<ggml_tensor *>(r.t), d.head_dim, group, d.n_head_kv, nr,
                        d.head_dim*fl, group*d.head_dim*fl, r.row_nb, r.offs + lt*r.layer_nb + r0*r.row_nb);
                qs = ggml_cont(ctx, ggml_permute(ctx, qs, 0, 1, 3, 2));
                qs = ggml_reshape_3d(ctx, qs, d.head_dim, group*nr, d.n_head_kv);
                ggml_tensor * kq = ggml_mul_mat(ctx, k, qs); // [keys, group*rows, kv heads]
                // each block's best chunk, then the softmax over those: the keys x rows logits are written once and
                // read once (a softmax over every chunk first would read and write them once more)
                ggml_tensor * best = ggml_pool_1d(ctx, kq, GGML_OP_POOL_MAX, n_ch, n_ch, 0); // [blocks, group*rows, kv heads]
                best = ggml_soft_max_ext(ctx, best, nullptr, scale, 0.0f);
                best = ggml_reshape_2d(ctx, ggml_sqr(ctx, best), n_blocks, group*nr*d.n_head_kv);
                ggml_tensor * sum = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_transpose(ctx, best))); // [1, blocks]
                total = total ? ggml_add(ctx, total, sum) : sum;
            }
        }
    }
    ggml_set_output(total);
    ggml_build_forward_expand(g.gf, total);
    g.total = total;
    return g;
}

void kvmem_graph_scorer::reserve(const std::vector<rows_span> & largest) {
    graph g = build(store.n_slots(), largest);
    GGML_ASSERT(ggml_gallocr_reserve(galloc, g.gf) && "kvmem: cannot allocate the scoring graph");
    ggml_free(g.ctx);
}

void kvmem_graph_scorer::warm_up(const std::vector<rows_span> & largest) {
    std::vector<uint32_t> every(store.n_slots());
    std::iota(every.begin(), every.end(), 0u);
    std::vector<float> thrown_away;
    score(every, largest, thrown_away);
    last = {};
}

size_t kvmem_graph_scorer::compute_bytes() const {
    return ggml_gallocr_get_buffer_size(galloc, 0);
}

void kvmem_graph_scorer::score(const std::vector<uint32_t> & slots, const std::vector<rows_span> & rows, std::vector<float> & out) {
    const kvmem_dims & d = store.dims();
    const uint32_t n_ch = store.n_chunks();
    const size_t n_blocks = slots.size();
    uint32_t n_rows = 0;
    for (const auto & r : rows) {
        n_rows += r.n;
    }
    out.assign(n_blocks, 0.0f);
    last = {};
    if (n_blocks == 0 || n_rows == 0) {
        return;
    }
    const int64_t t0 = ggml_time_us();
    graph g = build(n_blocks, rows);
    GGML_ASSERT(ggml_gallocr_alloc_graph(galloc, g.gf) && "kvmem: cannot allocate the scoring graph");
    const int64_t t1 = ggml_time_us();
    idx_host.resize(n_blocks*n_ch*d.n_head_kv);
    for (size_t i = 0; i < n_blocks*n_ch; ++i) {
        idx_host[i] = (int32_t) (slots[i/n_ch]*n_ch + i % n_ch);
    }
    for (uint32_t kv = 1; kv < d.n_head_kv; ++kv) {
        std::copy(idx_host.begin(), idx_host.begin() + n_blocks*n_ch, idx_host.begin() + kv*n_blocks*n_ch);
    }
    ggml_backend_tensor_set(g.idx, idx_host.data(), 0, ggml_nbytes(g.idx));
    const int64_t t2 = ggml_time_us();
    GGML_ASSERT(ggml_backend_graph_compute(backend, g.gf) == GGML_STATUS_SUCCESS);
    ggml_backend_tensor_get(g.total, out.data(), 0, out.size()*sizeof(float));
    ggml_free(g.ctx);
    last = { t1 - t0, t2 - t1, ggml_time_us() - t2, g.n_steps };
}
