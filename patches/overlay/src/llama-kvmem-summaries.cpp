// KVMem: block summaries where the working set lives, and the `mass` scorer as a ggml graph (kvmem-llama).
// See llama-kvmem-summaries.h.

#include "llama-kvmem-summaries.h"

#include "llama-impl.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

// query rows per graph step: the step's [keys, rows, heads] attention matrix is the largest tensor of the graph
static constexpr uint32_t KVMEM_ROWS_PER_STEP = 16;

kvmem_summary_store::~kvmem_summary_store() {
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

void kvmem_summary_store::init(ggml_backend_buffer_type_t buft, const kvmem_dims & dims, uint32_t n_chunks, uint32_t slots) {
    GGML_ASSERT(ctx == nullptr && n_chunks > 0 && slots > 0);
    d = dims;
    n_ch = n_chunks;
    n_slots = slots;
    ggml_init_params params = { ggml_tensor_overhead()*d.n_lt, nullptr, /*no_alloc*/ true };
    ctx = ggml_init(params);
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d.head_dim, (int64_t) n_slots*n_ch, d.n_head_kv);
        ggml_format_name(t, "kvmem_summaries-%u", lt);
        keys.push_back(t);
    }
    buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the block summaries (%.1f MiB in %s); lower the context "
                    "or --kvmem-host-mib", (double) bytes()/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    ggml_backend_buffer_clear(buf, 0);
}

size_t kvmem_summary_store::bytes() const {
    return (size_t) d.n_lt*d.n_head_kv*n_slots*n_ch*d.head_dim*sizeof(ggml_fp16_t);
}

void kvmem_summary_store::put(uint32_t slot, const float * summary) {
    GGML_ASSERT(slot < n_slots);
    const size_t n = (size_t) n_ch*d.head_dim;
    row16.resize(n);
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        for (uint32_t kv = 0; kv < d.n_head_kv; ++kv) {
            ggml_fp32_to_fp16_row(summary + ((size_t) lt*d.n_head_kv + kv)*n, row16.data(), (int64_t) n);
            ggml_tensor * t = keys[lt];
            ggml_backend_tensor_set(t, row16.data(), kv*t->nb[2] + (size_t) slot*n_ch*t->nb[1], n*sizeof(ggml_fp16_t));
        }
    }
}

kvmem_graph_scorer::kvmem_graph_scorer(ggml_backend_t backend_in, const kvmem_summary_store & store_in) :
        backend(backend_in), store(store_in) {
    galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
}

kvmem_graph_scorer::~kvmem_graph_scorer() {
    ggml_gallocr_free(galloc);
}

void kvmem_graph_scorer::score(const std::vector<uint32_t> & slots, const float * q, uint32_t n_rows, std::vector<float> & out) {
    const kvmem_dims & d = store.dims();
    const uint32_t n_ch = store.n_chunks();
    const int64_t n_blocks = (int64_t) slots.size();
    out.assign(slots.size(), 0.0f);
    if (n_blocks == 0 || n_rows == 0) {
        return;
    }
    const uint32_t n_steps = (n_rows + KVMEM_ROWS_PER_STEP - 1)/KVMEM_ROWS_PER_STEP;
    const size_t n_nodes = (size_t) d.n_lt*(2 + 12*n_steps) + 16;
    meta.resize(ggml_tensor_overhead()*n_nodes + ggml_graph_overhead_custom(n_nodes, false));
    ggml_init_params params = { meta.size(), meta.data(), /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(params);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, n_nodes, false);

    // the chunk rows of these blocks, the same for every KV head; the query rows laid out per (layer, step) as
    // contiguous [head_dim, rows, heads] blocks
    ggml_tensor * idx = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_blocks*n_ch, d.n_head_kv);
    ggml_tensor * qin = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, (int64_t) d.n_lt*n_rows*d.n_head*d.head_dim);
    ggml_set_input(idx);
    ggml_set_input(qin);
    ggml_tensor * total = nullptr;
    const float scale = 1.0f/std::sqrt((float) d.head_dim);
    size_t q_off = 0;
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        ggml_tensor * k = ggml_get_rows(ctx, store.layer(lt), idx); // [head_dim, keys, kv heads] f32
        for (uint32_t s = 0; s < n_steps; ++s) {
            const int64_t nr = std::min<int64_t>(KVMEM_ROWS_PER_STEP, n_rows - (int64_t) s*KVMEM_ROWS_PER_STEP);
            ggml_tensor * qs = ggml_view_3d(ctx, qin, d.head_dim, nr, d.n_head, d.head_dim*sizeof(float),
                    nr*d.head_dim*sizeof(float), q_off*sizeof(float));
            q_off += (size_t) nr*d.n_head*d.head_dim;
            ggml_tensor * kq = ggml_mul_mat(ctx, k, qs); // [keys, rows, heads]: a head reads its group's KV head
            kq = ggml_soft_max_ext(ctx, kq, nullptr, scale, 0.0f);
            ggml_tensor * best = ggml_pool_1d(ctx, kq, GGML_OP_POOL_MAX, n_ch, n_ch, 0); // [blocks, rows, heads]
            best = ggml_reshape_2d(ctx, ggml_sqr(ctx, best), n_blocks, nr*d.n_head);
            ggml_tensor * sum = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_transpose(ctx, best))); // [1, blocks]
            total = total ? ggml_add(ctx, total, sum) : sum;
        }
    }
    ggml_set_output(total);
    ggml_build_forward_expand(gf, total);
    GGML_ASSERT(ggml_gallocr_alloc_graph(galloc, gf) && "kvmem: cannot allocate the scoring graph");

    idx_host.resize((size_t) n_blocks*n_ch*d.n_head_kv);
    for (size_t i = 0; i < (size_t) n_blocks*n_ch; ++i) {
        idx_host[i] = (int32_t) (slots[i/n_ch]*n_ch + i % n_ch);
    }
    for (uint32_t kv = 1; kv < d.n_head_kv; ++kv) {
        std::copy(idx_host.begin(), idx_host.begin() + n_blocks*n_ch, idx_host.begin() + kv*n_blocks*n_ch);
    }
    // q rows arrive as [row][layer][head][head_dim]
    q_host.resize((size_t) d.n_lt*n_rows*d.n_head*d.head_dim);
    size_t o = 0;
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        for (uint32_t r0 = 0; r0 < n_rows; r0 += KVMEM_ROWS_PER_STEP) {
            const uint32_t nr = std::min(KVMEM_ROWS_PER_STEP, n_rows - r0);
            for (uint32_t h = 0; h < d.n_head; ++h) {
                for (uint32_t r = r0; r < r0 + nr; ++r) {
                    const float * src = q + (size_t) r*d.query_row() + ((size_t) lt*d.n_head + h)*d.head_dim;
                    std::copy(src, src + d.head_dim, q_host.data() + o);
                    o += d.head_dim;
                }
            }
        }
    }
    ggml_backend_tensor_set(idx, idx_host.data(), 0, ggml_nbytes(idx));
    ggml_backend_tensor_set(qin, q_host.data(), 0, ggml_nbytes(qin));
    GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);
    ggml_backend_tensor_get(total, out.data(), 0, out.size()*sizeof(float));
    ggml_free(ctx);
}
