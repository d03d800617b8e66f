// KVMem: the host KV pool and the copies between it and the GPU working set (kvmem-llama). See llama-kvmem.h.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-batch.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <map>
#include <stdexcept>

static uint32_t div_up(uint32_t a, uint32_t b) { return (a + b - 1)/b; }

void llama_kvmem_cache::init_pool(uint32_t n_ctx_total) {
    const uint32_t B = kp.block;

    // one backend (own stream) per device holding tiered layers: host<->device block copies are
    // issued asynchronously and waited for once per batch of copies
    copy_backend.assign(n_lt, nullptr);
    for (uint32_t i = 0; i < n_lt; ++i) {
        ggml_backend_buffer_t kbuf = layers[i].k->buffer;
        ggml_backend_dev_t dev = kbuf ? ggml_backend_buft_get_device(ggml_backend_buffer_get_type(kbuf)) : nullptr;
        if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU || ggml_backend_buffer_is_host(kbuf)) {
            continue;
        }
        auto it = std::find_if(copy_backends.begin(), copy_backends.end(),
                [dev](ggml_backend_t be) { return ggml_backend_get_device(be) == dev; });
        if (it == copy_backends.end()) {
            ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
            if (!be) {
                continue;
            }
            copy_backends.push_back(be);
            it = copy_backends.end() - 1;
        }
        copy_backend[i] = *it;
    }

    // host pool: the device's host buffer type (pinned on CUDA), plain CPU memory otherwise
    ggml_backend_buffer_type_t buft = nullptr;
    if (n_lt && layers[0].k->buffer) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(layers[0].k->buffer));
        if (dev) {
            buft = ggml_backend_dev_host_buffer_type(dev);
        }
    }
    if (!buft) {
        buft = ggml_backend_cpu_buffer_type();
    }

    if (kp.host_mib > 0) {
        host_slots = (uint32_t) (((size_t) kp.host_mib*1024*1024)/block_bytes);
        if (host_slots == 0) {
            throw std::runtime_error(format("--kvmem-host-mib %u is too small: one block of %u tokens needs %.2f MiB",
                        kp.host_mib, B, block_bytes/1024.0/1024.0));
        }
    } else {
        host_slots = div_up(n_ctx_total, B) + 1;
    }
    host_buf = ggml_backend_buft_alloc_buffer(buft, (size_t) host_slots*block_bytes);
    if (!host_buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the host KV pool (%.1f MiB in %s); lower --kvmem-host-mib or the context",
                    (double) host_slots*block_bytes/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    host_base = (uint8_t *) ggml_backend_buffer_get_base(host_buf);
    free_slots.reserve(host_slots);
    for (uint32_t i = 0; i < host_slots; ++i) {
        free_slots.push_back(host_slots - 1 - i);
    }
    LLAMA_LOG_INFO("%s: host KV pool %u blocks (%.1f MiB) in %s\n", __func__, host_slots,
            (double) host_slots*block_bytes/1024.0/1024.0, ggml_backend_buft_name(buft));
}

bool llama_kvmem_cache::converts(bool is_v) const {
    return is_v ? pool_type_v != type_v() : pool_type_k != type_k();
}

void llama_kvmem_cache::convert_rows(ggml_type from, const void * src, ggml_type to, void * dst, size_t n_rows, int64_t n_per_row) {
    // through f32 (the pool is quantized, the working set f16, or the reverse)
    conv_f32.resize((size_t) n_rows*n_per_row);
    ggml_get_type_traits(from)->to_float(src, conv_f32.data(), (int64_t) n_rows*n_per_row);
    ggml_quantize_chunk(to, conv_f32.data(), dst, 0, (int64_t) n_rows, n_per_row, nullptr);
}

void llama_kvmem_cache::copy_block(uint8_t * host, const std::vector<uint32_t> & idx, bool to_device) {
    // host slot layout: per tiered layer the block's K rows, then its V rows (pool type); cells idx[t] hold token t.
    // Runs of consecutive cells move in one copy per layer and K/V. When the pool's type is not the working set's,
    // the rows pass through a buffer of the working set's type: filled from the slot before the uploads, or by the
    // downloads and then converted into the slot.
    const uint32_t B = kp.block;
    const bool conv[2] = { converts(false), converts(true) };
    // uploads read their buffer until copies_wait; downloads are waited for here, before their conversion
    std::vector<uint8_t> down_buf;
    uint8_t * ws = nullptr;
    if (conv[0] || conv[1]) {
        size_t n = 0;
        for (uint32_t lt = 0; lt < n_lt; ++lt) {
            n += (size_t) B*((conv[0] ? row_k[lt] : 0) + (conv[1] ? row_v[lt] : 0));
        }
        if (to_device) {
            if (conv_pending > ((size_t) 256 << 20)) {
                copies_wait(); // bound the host memory held by uploads in flight
            }
            conv_bufs.emplace_back(n);
            ws = conv_bufs.back().data();
            conv_pending += n;
        } else {
            down_buf.resize(n);
            ws = down_buf.data();
        }
    }
    struct part { uint32_t lt; ggml_tensor * tensor; uint8_t * host; uint8_t * rows; size_t row; bool conv; ggml_type pool; };
    std::vector<part> parts;
    parts.reserve(2*n_lt);
    for (uint32_t lt = 0; lt < n_lt; ++lt) {
        uint8_t * hv = host + (size_t) B*hrow_k[lt];
        for (const bool is_v : { false, true }) {
            ggml_tensor * tensor = is_v ? layers[lt].v : layers[lt].k;
            if (!tensor) {
                continue;
            }
            const size_t row = is_v ? row_v[lt] : row_k[lt];
            part p = { lt, tensor, is_v ? hv : host, is_v ? hv : host, row, conv[is_v], is_v ? pool_type_v : pool_type_k };
            if (p.conv) {
                p.rows = ws;
                ws += (size_t) B*row;
                if (to_device) {
                    convert_rows(p.pool, p.host, tensor->type, p.rows, B, tensor->ne[0]);
                }
            }
            parts.push_back(p);
        }
        host += (size_t) B*(hrow_k[lt] + hrow_v[lt]);
    }
    for (const part & p : parts) {
        for (uint32_t t = 0; t < B; ) {
            uint32_t r = 1;
            while (t + r < B && idx[t + r] == idx[t] + r) {
                r++;
            }
            uint8_t * h = p.rows + (size_t) t*p.row;
            if (to_device) {
                upload(p.lt, p.tensor, h, (size_t) idx[t]*p.row, (size_t) r*p.row);
            } else {
                download(p.lt, p.tensor, h, (size_t) idx[t]*p.row, (size_t) r*p.row);
            }
            t += r;
        }
    }
    if (!to_device && (conv[0] || conv[1])) {
        copies_wait();
        for (const part & p : parts) {
            if (p.conv) {
                convert_rows(p.tensor->type, p.rows, p.pool, p.host, B, p.tensor->ne[0]);
            }
        }
    }
}

void llama_kvmem_cache::upload(uint32_t lt, ggml_tensor * t, const void * src, size_t offset, size_t size) {
    if (copy_backend[lt]) {
        ggml_backend_tensor_set_async(copy_backend[lt], t, src, offset, size);
        copies_pending = true;
    } else {
        ggml_backend_tensor_set(t, src, offset, size);
    }
}

void llama_kvmem_cache::download(uint32_t lt, ggml_tensor * t, void * dst, size_t offset, size_t size) {
    if (copy_backend[lt]) {
        ggml_backend_tensor_get_async(copy_backend[lt], t, dst, offset, size);
        copies_pending = true;
    } else {
        ggml_backend_tensor_get(t, dst, offset, size);
    }
}

void llama_kvmem_cache::copies_wait() {
    if (copies_pending) {
        for (auto * be : copy_backends) {
            ggml_backend_synchronize(be);
        }
        copies_pending = false;
    }
    conv_bufs.clear();
    conv_pending = 0;
}

bool llama_kvmem_cache::host_room_for(const llama_ubatch * ubatches, size_t n_ubatches) {
    // every block the batch completes is written through to the host pool; when it would not fit, the
    // batch is refused before any work (decode returns 1, as for a full KV cache, so the server frees
    // idle slots of a shared pool and retries)
    std::map<llama_seq_id, llama_pos> pmax;
    for (size_t u = 0; u < n_ubatches; ++u) {
        const llama_ubatch & ub = ubatches[u];
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            const llama_seq_id s = ub.seq_id[i][0];
            const auto it = pmax.find(s);
            pmax[s] = it == pmax.end() ? ub.pos[i] : std::max(it->second, ub.pos[i]);
        }
    }
    uint32_t need = 0;
    for (const auto & [s, p] : pmax) {
        const auto it = seqs.find(s);
        const int32_t next = it == seqs.end() ? 0 : it->second.next_host;
        const int32_t done = (p + 1)/(int32_t) kp.block;
        need += done > next ? done - next : 0;
    }
    if (need <= free_slots.size()) {
        return true;
    }
    set_last_error(format("KV tiering host pool is full (%u blocks of %u tokens, %.1f MiB, %zu free): this request needs %u more; "
            "raise --kvmem-host-mib (or lower the context)", host_slots, kp.block,
            (double) host_slots*block_bytes/1024.0/1024.0, free_slots.size(), need));
    return false;
}

uint32_t llama_kvmem_cache::n_resident_blocks() const {
    uint32_t n = 0;
    for (const auto & [s, st] : seqs) {
        n += n_resident(st);
    }
    return n;
}

uint32_t llama_kvmem_cache::n_host_blocks() const {
    return host_slots - (uint32_t) free_slots.size();
}

void llama_kvmem_cache::write_through(llama_seq_id seq_id) {
    const int32_t B = kp.block;
    auto & cells = v_cells[0];
    const llama_pos pmax = cells.seq_pos_max(seq_id);
    if (pmax < 0) {
        return;
    }
    auto & st = seqs[seq_id];
    const int32_t done = (pmax + 1)/B;
    const auto & sp = cells.seq_pos_get(seq_id);

    std::vector<uint32_t> idx;
    for (int32_t b = st.next_host; b < done; ++b) {
        if (st.blocks.count(b)) {
            continue;
        }
        idx.clear();
        for (auto it = sp.lower_bound({ b*B, 0 }); it != sp.end() && it->first < (b + 1)*B; ++it) {
            idx.push_back(it->second);
        }
        if ((int32_t) idx.size() != B) {
            continue; // not a whole block in the working set (e.g. after a restore): stays GPU-only
        }
        if (free_slots.empty()) {
            if (!host_full_logged) {
                LLAMA_LOG_ERROR("%s: kvmem host pool is full; raise --kvmem-host-mib\n", __func__);
                host_full_logged = true;
            }
            break;
        }
        hblock hb;
        hb.slot = free_slots.back();
        free_slots.pop_back();
        hb.resident = true;
        hb.ext.resize(B);
        for (int32_t t = 0; t < B; ++t) {
            hb.ext[t] = cells.ext_get(idx[t]);
        }
        copy_block(slot_ptr(hb.slot), idx, /*to_device*/ false);
        st.blocks.emplace(b, std::move(hb));
    }
    copies_wait();
    st.next_host = std::max(st.next_host, done);
}

std::vector<uint32_t> llama_kvmem_cache::block_cells(llama_seq_id seq_id, int32_t b) const {
    const int32_t B = kp.block;
    std::vector<uint32_t> idx;
    const auto & sp = v_cells[0].seq_pos_get(seq_id);
    for (auto it = sp.lower_bound({ b*B, 0 }); it != sp.end() && it->first < (b + 1)*B; ++it) {
        idx.push_back(it->second);
    }
    return idx;
}

bool llama_kvmem_cache::stage_in(llama_seq_id seq_id, int32_t b, hblock & hb) {
    const int32_t B = kp.block;
    const auto & cells = v_cells[0];

    // prefer B contiguous free cells (one copy per layer for K and for V), searched from where the
    // last stage-in ended so that a selection staging many blocks scans the cells about once
    std::vector<uint32_t> idx;
    idx.reserve(B);
    const uint32_t n_cells = cells.size();
    uint32_t run = 0;
    for (uint32_t k = 0; k < n_cells && run < (uint32_t) B; ++k) {
        const uint32_t i = (stage_hint + k) % n_cells;
        run = cells.is_empty(i) ? (i == 0 ? 1 : run + 1) : 0; // runs do not wrap around
        if (run == (uint32_t) B) {
            for (uint32_t j = 0; j < (uint32_t) B; ++j) {
                idx.push_back(i + 1 - B + j);
            }
        }
    }
    if (idx.empty()) {
        for (uint32_t i = 0; i < n_cells && (int32_t) idx.size() < B; ++i) {
            if (cells.is_empty(i)) {
                idx.push_back(i);
            }
        }
    }
    if ((int32_t) idx.size() < B) {
        return false;
    }
    stage_hint = (idx.back() + 1) % n_cells;
    return stage_in_at(seq_id, b, hb, idx);
}

bool llama_kvmem_cache::stage_in_at(llama_seq_id seq_id, int32_t b, hblock & hb, const std::vector<uint32_t> & idx) {
    const int32_t B = kp.block;
    auto & cells = v_cells[0];
    if ((int32_t) idx.size() != B) {
        return false;
    }
    for (const uint32_t i : idx) {
        if (i >= cells.size() || !cells.is_empty(i)) {
            return false;
        }
    }
    copy_block(slot_ptr(hb.slot), idx, /*to_device*/ true);
    for (int32_t t = 0; t < B; ++t) {
        cells.pos_set(idx[t], b*B + t);
        cells.ext_set(idx[t], hb.ext[t]);
        cells.seq_add(idx[t], seq_id);
    }
    hb.resident = true;
    if (journal) {
        journal->staged.push_back({ seq_id, b });
    }
    return true;
}
