// KVMem: hybrid models (kvmem-llama): attention + recurrent layers (qwen35). The attention layers are tiered,
// the recurrent state is not; its snapshots (llama-kvmem-snapshot.h) let a turn's query span be recomputed.

#include "llama-kvmem.h"

#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

// llama_memory_hybrid whose attention part is a llama_kvmem_cache: the graph still sees a
// llama_memory_hybrid_context; only the batch split and the lazy attention placement differ
class llama_kvmem_hybrid : public llama_memory_hybrid {
public:
    llama_kvmem_hybrid(const llama_model & model, llama_kvmem_cache * attn, llama_memory_recurrent * recr) :
        llama_memory_hybrid(model, attn, recr), km(attn) {
        km->attach_recurrent(recr);
    }

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override {
        auto * recr = get_mem_recr();
        // same split as upstream's hybrid memory (unified KV): the trailing 1 + n_rs_seq tokens of each
        // sequence stay in one ubatch so that recurrent rollback snapshots remain valid
        const auto split = [&](llama_batch_allocr & b, uint32_t n) {
            return embd_all ? b.split_seq(n) : b.split_equal(n, false, recr->n_rs_seq > 0 ? recr->n_rs_seq + 1 : 0);
        };
        std::vector<llama_ubatch> ubatches;
        if (!llama_kvmem_split(km, balloc, n_ubatch, split, ubatches) || !recr->prepare(ubatches)) {
            return std::make_unique<llama_memory_hybrid_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
        llama_kv_cache::slot_info_vec_t sinfos(ubatches.size());
        llama_memory_context_ptr ctx_attn = std::make_unique<llama_kvmem_context>(km, std::move(sinfos), ubatches);
        return std::make_unique<llama_memory_hybrid_context>(this, std::move(ctx_attn), std::move(ubatches));
    }

private:
    llama_kvmem_cache * km;
};

llama_memory_i * llama_kvmem_create_hybrid(const llama_model & model, const llama_memory_params & params,
        const llama_cparams & cparams, const llama_memory_i::layer_filter_cb & filter_attn,
        const llama_memory_i::layer_filter_cb & filter_recr) {
    if (cparams.kvmem.budget == 0 || params.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT || model.hparams.swa_type != LLAMA_SWA_TYPE_NONE) {
        return nullptr;
    }
    const auto & hp = model.hparams;
    const llama_memory_i::layer_filter_cb attn = filter_attn ? filter_attn : [&hp](int32_t il) { return !hp.is_recr(il); };
    const llama_memory_i::layer_filter_cb recr = filter_recr ? filter_recr : [&hp](int32_t il) { return hp.is_recr(il); };
    auto * km = new llama_kvmem_cache(model, params.type_k, params.type_v, cparams.offload_kqv,
            cparams.n_seq_max, cparams.n_ctx, cparams.kvmem, attn);
    auto * rs = new llama_memory_recurrent(model, GGML_TYPE_F32, GGML_TYPE_F32, cparams.offload_kqv,
            std::max((uint32_t) 1, cparams.n_seq_max), cparams.n_seq_max, cparams.n_rs_seq, recr);
    return new llama_kvmem_hybrid(model, km, rs);
}

//
// recurrent state snapshots (llama-kvmem-snapshot.h)
//

// what state_write writes: its plain bytes go to `meta` at once, its tensors are queued (copied by take())
class kvmem_snapshot_writer : public llama_io_write_i {
public:
    struct queued {
        ggml_tensor * tensor;
        size_t offset, size;
    };
    std::vector<queued> todo;

    explicit kvmem_snapshot_writer(kvmem_snapshot & snap) : snap(snap) {}

    void write(const void * src, size_t size) override {
        const auto * p = (const uint8_t *) src;
        snap.meta.insert(snap.meta.end(), p, p + size);
        n += size;
    }
    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        snap.tensors.emplace_back(snap.meta.size(), size);
        todo.push_back({ tensor, offset, size });
        n += size;
    }
    size_t n_bytes() override { return n; }

private:
    kvmem_snapshot & snap;
    size_t n = 0;
};

// state_read of a snapshot: plain bytes from `meta`, tensor bytes from the room (or from `meta` for a file's)
class kvmem_snapshot_reader : public llama_io_read_i {
public:
    kvmem_snapshot_reader(const kvmem_snapshot & snap, ggml_backend_sched_t sched, bool pinned) :
        snap(snap), sched(sched), pinned(pinned) {}

    void read(void * dst, size_t size) override {
        std::memcpy(dst, take_meta(size), size);
    }
    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        if (snap.whole) {
            ggml_backend_tensor_set(tensor, take_meta(size), offset, size);
            return;
        }
        if (i_tensor >= snap.tensors.size() || snap.tensors[i_tensor] != std::make_pair(at_meta, size)) {
            throw std::runtime_error("kvmem: a recurrent state snapshot is read in another order than it was written");
        }
        const uint8_t * src = snap.room.data() + at_room;
        ggml_backend_t be = sched ? kvmem_backend_of(sched, tensor) : nullptr;
        if (be && pinned) {
            ggml_backend_tensor_set_async(be, tensor, src, offset, size);
        } else {
            ggml_backend_tensor_set(tensor, src, offset, size);
        }
        i_tensor++;
        at_room += size;
        n += size;
    }
    size_t n_bytes() override { return n; }

private:
    const uint8_t * take_meta(size_t size) {
        if (at_meta + size > snap.meta.size()) {
            throw std::runtime_error("kvmem: recurrent state snapshot is truncated");
        }
        at_meta += size;
        n += size;
        return snap.meta.data() + at_meta - size;
    }
    const kvmem_snapshot & snap;
    ggml_backend_sched_t sched;
    const bool pinned;
    size_t at_meta = 0, at_room = 0, i_tensor = 0, n = 0;
};

kvmem_snapshot::kvmem_snapshot(llama_pos pos, std::vector<uint8_t> && written) :
    pos(pos), meta(std::move(written)), whole(true) {}

// the pinned memory type of the first device that owns one of the tensors; nullptr: none has one
static ggml_backend_buffer_type_t kvmem_pinned_type(ggml_backend_sched_t sched,
        const std::vector<kvmem_snapshot_writer::queued> & todo) {
    for (const auto & q : todo) {
        if (ggml_backend_buffer_type_t host = kvmem_pinned_type_of(kvmem_backend_of(sched, q.tensor))) {
            return host;
        }
    }
    return nullptr;
}

void kvmem_snapshot::take(ggml_backend_sched_t sched, const llama_memory_recurrent & recr, llama_seq_id seq_id) {
    meta.clear();
    tensors.clear();
    whole = false;
    kvmem_snapshot_writer w(*this);
    recr.state_write(w, seq_id);
    size_t bytes = 0;
    for (const auto & q : w.todo) {
        bytes += q.size;
    }
    ggml_backend_buffer_type_t host = sched ? kvmem_pinned_type(sched, w.todo) : nullptr;
    room.reserve(host, bytes);
    pending.clear();
    size_t at = 0;
    for (const auto & q : w.todo) {
        ggml_backend_t be = host ? kvmem_backend_of(sched, q.tensor) : nullptr;
        if (be) {
            ggml_backend_tensor_get_async(be, q.tensor, room.data() + at, q.offset, q.size);
            if (std::find(pending.begin(), pending.end(), be) == pending.end()) {
                pending.push_back(be);
            }
        } else {
            ggml_backend_tensor_get(q.tensor, room.data() + at, q.offset, q.size);
        }
        at += q.size;
    }
}

void kvmem_snapshot::restore(ggml_backend_sched_t sched, llama_memory_recurrent & recr, llama_seq_id seq_id) const {
    kvmem_snapshot_reader r(*this, sched, room.is_pinned());
    recr.state_read(r, seq_id);
}

std::vector<uint8_t> kvmem_snapshot::written() const {
    if (whole) {
        return meta;
    }
    for (ggml_backend_t be : pending) {
        ggml_backend_synchronize(be);
    }
    pending.clear();
    std::vector<uint8_t> out;
    size_t from_meta = 0, from_room = 0;
    const uint8_t * src = room.data();
    for (const auto & [at, size] : tensors) {
        out.insert(out.end(), meta.begin() + from_meta, meta.begin() + at);
        out.insert(out.end(), src + from_room, src + from_room + size);
        from_meta = at;
        from_room += size;
    }
    out.insert(out.end(), meta.begin() + from_meta, meta.end());
    return out;
}
