// KVMem: the C API (kvmem-llama) and the stats it reads: counters written by the decode thread are published under
// a lock after every change, so the server's HTTP threads read a consistent snapshot while a decode runs.

#include "llama-kvmem.h"

#include "llama-context.h"

#include <cstring>

void llama_kvmem_cache::publish() {
    counters total = totals;
    std::map<llama_seq_id, counters> per;
    total.n_blocks_gpu = 0;
    for (const auto & [s, st] : seqs) {
        counters & x = per[s];
        // in host slots of B tokens, as the pool counts them (an image's block takes several)
        x.n_blocks_gpu  = (int32_t) st.n_resident();
        x.n_blocks_disk = (int32_t) n_on_disk(st);
        x.n_blocks_host = (int32_t) st.n_slots() - x.n_blocks_disk;
        x.n_select      = st.n_select;
        x.last_ms       = st.last_ms;
        total.n_blocks_gpu += x.n_blocks_gpu;
    }
    total.n_blocks_host = (int32_t) pool.n_used();
    total.n_blocks_disk = (int32_t) (disk.capacity() - disk.n_free());
    std::lock_guard<std::mutex> lock(snap_mutex);
    snap_total = total;
    snap_seq.swap(per);
}

void llama_kvmem_cache::get_stats(llama_kvmem_stats * out) const {
    std::lock_guard<std::mutex> lock(snap_mutex);
    out->enabled             = 1;
    out->budget              = kp.budget;
    out->block_tokens        = kp.block;
    out->n_blocks_gpu        = snap_total.n_blocks_gpu;
    out->n_blocks_host       = snap_total.n_blocks_host;
    out->host_bytes          = (int64_t) snap_total.n_blocks_host*pool.block_bytes();
    out->host_capacity_bytes = (int64_t) pool.capacity()*pool.block_bytes();
    out->n_selections        = snap_total.n_select;
    out->n_staged_in         = snap_total.n_staged_in;
    out->n_staged_out        = snap_total.n_staged_out;
    out->n_evicted           = snap_total.n_evicted;
    out->last_select_ms      = snap_total.last_ms;
    out->n_blocks_disk       = snap_total.n_blocks_disk;
    out->disk_bytes          = (int64_t) snap_total.n_blocks_disk*disk.record_bytes();
    out->disk_capacity_bytes = (int64_t) disk.capacity()*disk.record_bytes();
}

void llama_kvmem_cache::get_seq_stats(llama_seq_id seq_id, llama_kvmem_stats * out) const {
    get_stats(out);
    std::lock_guard<std::mutex> lock(snap_mutex);
    const auto it = snap_seq.find(seq_id);
    const counters x = it == snap_seq.end() ? counters() : it->second;
    out->n_blocks_gpu   = x.n_blocks_gpu;
    out->n_blocks_host  = x.n_blocks_host;
    out->host_bytes     = (int64_t) x.n_blocks_host*pool.block_bytes();
    out->n_blocks_disk  = x.n_blocks_disk;
    out->disk_bytes     = (int64_t) x.n_blocks_disk*disk.record_bytes();
    out->n_selections   = x.n_select;
    out->last_select_ms = x.last_ms;
}

std::string llama_kvmem_cache::get_last_error() const {
    std::lock_guard<std::mutex> lock(snap_mutex);
    return last_error;
}

void llama_kvmem_cache::set_last_error(const std::string & msg) {
    std::lock_guard<std::mutex> lock(snap_mutex);
    last_error = msg;
}

//
// C API
//

int32_t llama_kvmem_get_stats(const struct llama_context * ctx, struct llama_kvmem_stats * out) {
    if (!ctx || !out) {
        return -1;
    }
    std::memset(out, 0, sizeof(*out));
    auto * km = llama_kvmem_cache::from(llama_get_memory(ctx));
    if (!km) {
        return 1; // tiering off
    }
    km->get_stats(out);
    return 0;
}

int32_t llama_kvmem_get_seq_stats(const struct llama_context * ctx, llama_seq_id seq_id, struct llama_kvmem_stats * out) {
    if (!ctx || !out) {
        return -1;
    }
    std::memset(out, 0, sizeof(*out));
    auto * km = llama_kvmem_cache::from(llama_get_memory(ctx));
    if (!km) {
        return 1;
    }
    km->get_seq_stats(seq_id, out);
    return 0;
}

const char * llama_kvmem_last_error(const struct llama_context * ctx) {
    // thread-local copy so the pointer stays valid for the caller
    static thread_local std::string msg;
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    msg = km ? km->get_last_error() : std::string();
    return msg.c_str();
}

int32_t llama_kvmem_set_query_span(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    if (!km) {
        return 1;
    }
    km->set_query_span(seq_id, p0, p1);
    return 0;
}

int32_t llama_kvmem_seq_release(struct llama_context * ctx, llama_seq_id seq_id) {
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    if (!km) {
        return 1;
    }
    km->release_seq(seq_id);
    return 0;
}

int32_t llama_kvmem_max_active(const struct llama_context * ctx) {
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    return km ? (int32_t) km->max_active() : 0;
}

const char * llama_kvmem_method_name(int32_t method) {
    return kvmem_scorer::method_name(method);
}

int32_t llama_kvmem_method_from_name(const char * name) {
    return name ? kvmem_scorer::method_from_name(name) : -1;
}
