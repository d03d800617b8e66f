// KVMem: hybrid models (kvmem-llama): attention + recurrent layers (qwen35). The attention layers are tiered,
// the recurrent state is not; its snapshots in host memory let a turn's query span be recomputed.

#include "llama-kvmem.h"

#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

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
// recurrent state snapshots in host memory (one sequence, via the state I/O of the recurrent memory)
//

namespace {

class kvmem_state_writer : public llama_io_write_i {
public:
    std::vector<uint8_t> buf;

    void write(const void * src, size_t size) override {
        const auto * p = (const uint8_t *) src;
        buf.insert(buf.end(), p, p + size);
    }
    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        const size_t o = buf.size();
        buf.resize(o + size);
        ggml_backend_tensor_get(tensor, buf.data() + o, offset, size);
    }
    size_t n_bytes() override { return buf.size(); }
};

class kvmem_state_reader : public llama_io_read_i {
public:
    explicit kvmem_state_reader(const std::vector<uint8_t> & buf) : buf(buf) {}

    void read(void * dst, size_t size) override {
        take(size);
        std::memcpy(dst, buf.data() + pos - size, size);
    }
    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        take(size);
        ggml_backend_tensor_set(tensor, buf.data() + pos - size, offset, size);
    }
    size_t n_bytes() override { return pos; }

private:
    void take(size_t size) {
        if (pos + size > buf.size()) {
            throw std::runtime_error("kvmem: recurrent state snapshot is truncated");
        }
        pos += size;
    }
    const std::vector<uint8_t> & buf;
    size_t pos = 0;
};

} // namespace

void llama_kvmem_snapshot_recurrent(llama_kvmem_cache * km, llama_seq_id seq_id, llama_pos pos) {
    kvmem_state_writer w;
    km->recurrent()->state_write(w, seq_id);
    km->push_snapshot(seq_id, pos, std::move(w.buf));
}

void llama_kvmem_restore_recurrent(llama_kvmem_cache * km, llama_seq_id seq_id, const std::vector<uint8_t> & snapshot) {
    kvmem_state_reader r(snapshot);
    km->recurrent()->state_read(r, seq_id);
}
