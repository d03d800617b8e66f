#pragma once

// KVMem: KV tiering for the attention KV cache (kvmem-llama).
//
// llama_kvmem_cache is a llama_kv_cache whose cells are only the GPU working set
// (budget + gen_reserve cells). Every completed block of `block` tokens is copied
// (write-through, same ggml type) into a host pool, so evicting a block from the
// working set is just a seq_rm on its cells. Cells keep the token's original
// position: the KQ mask is built from positions, so a working set with holes is
// valid attention (no re-RoPE). Before each new turn the blocks of the sequence
// are scored against the turn's query (Quest-style upper bound of the last query
// tokens' pre-RoPE Q against each block's element-wise pre-RoPE K min/max, per
// layer and KV head) and the working set becomes sink + recent + top-k.
//
// Because it *is* a llama_kv_cache and its contexts are llama_kv_cache_context,
// all model graph builders stay unchanged.

#include "llama-kv-cache.h"
#include "llama-kvmem-params.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <map>
#include <string>
#include <vector>

class llm_graph_result;
class llama_memory_recurrent;
struct llama_cparams;

// defined in llama.h (C API); forward-declared here for the getters
struct llama_kvmem_stats;

class llama_kvmem_cache : public llama_kv_cache {
public:
    llama_kvmem_cache(
            const llama_model & model,
            ggml_type type_k,
            ggml_type type_v,
            bool offload,
            uint32_t n_seq_max,
            uint32_t n_ctx_total,
            const llama_kvmem_params & kp,
            const layer_filter_cb & filter,
            llama_kvmem_cache * target = nullptr); // MTP draft caches: the target cache to follow

    ~llama_kvmem_cache();

    // the tiered cache of a context's memory: the memory itself, or the attention part of a tiered hybrid
    static llama_kvmem_cache * from(llama_memory_i * mem);

    // returns an empty string if tiering can apply to this model/context, otherwise the reason
    static std::string check(const llama_model & model, const llama_cparams & cparams, const llama_kvmem_params & kp);

    //
    // llama_memory_i
    //

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;

    bool get_can_shift() const override { return false; }

    void clear(bool data) override;
    bool seq_rm  (llama_seq_id seq_id, llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id) override;

    void state_read(llama_io_read_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    //
    // kvmem
    //

    // before a ubatch: make room (evict resident blocks that are on the host) and place the ubatch
    bool prepare_ubatch(const llama_ubatch & ubatch, slot_info & sinfo);

    // after a ubatch was computed: accumulate block key summaries + query, write completed blocks through to the host
    void after_ubatch(ggml_backend_sched_t sched, const llm_graph_result * res, const llama_ubatch & ubatch);

    // turn start: score the blocks of seq_id and make the working set sink + recent + top-k
    // returns true if blocks were staged in (the caller then recomputes the turn's last tokens)
    bool select(llama_seq_id seq_id);

    // thread-safe: the server reads these while a decode runs on its worker thread
    void get_stats(llama_kvmem_stats * out) const;
    bool get_seq_stats(llama_seq_id seq_id, llama_kvmem_stats * out) const;
    std::string get_last_error() const;
    void set_last_error(const std::string & msg);

    const llama_kvmem_params & params() const { return kp; }

    // false (and the error set) when the blocks these ubatches complete do not fit in the host pool
    bool host_room_for(const llama_ubatch * ubatches, size_t n_ubatches);

    // largest ubatch that fits next to the sink and one block of history
    uint32_t max_ubatch(uint32_t n_ubatch) const;

    // false when adding n_new tokens cannot evict anything, so a selection could not stage anything in
    bool may_stage(uint32_t n_new) const;

    // true while the context recomputes the tail of a turn after a selection
    bool in_redecode = false;

    // hybrid models: the recurrent state next to the tiered attention layers (its state is
    // snapshotted before a turn's tail so that the tail can be recomputed after a selection)
    llama_memory_recurrent * recr = nullptr;

    // MTP draft contexts: the draft's cache follows the target's selection (same resident blocks)
    // instead of selecting on its own
    void set_leader(llama_kvmem_cache * target);
    bool is_follower() const { return leader != nullptr; }
    void follow_leader();

    // decode-time refresh: the position at which the sequence is re-selected next, -1 = none
    llama_pos refresh_pos(llama_seq_id seq_id) const;

private:
    struct hblock {
        uint32_t slot     = 0;     // host pool slot
        bool     resident = false; // cells of this block are in the working set
        bool     pinned   = false; // chosen by the last selection (evicted last)
        std::vector<llama_kv_cell_ext> ext;
    };

    struct seq_state {
        std::map<int32_t, hblock> blocks;                   // completed blocks on the host, by block index
        std::map<int32_t, std::vector<float>> kbox;          // [n_lt][n_head_kv][max | min][head_dim] per complete block
        std::map<llama_pos, std::vector<float>> krow;       // pre-RoPE keys [n_lt][n_head_kv][head_dim] of the two
                                                            // newest blocks: a box is rebuilt exactly after a truncation
        std::deque<std::pair<llama_pos, std::vector<float>>> q; // last query rows [n_lt][n_head][head_dim], by position
        int32_t next_host = 0;                              // first block index not yet on the host
        llama_pos refresh_at = -1;                          // next decode-time re-selection at this position
        int64_t n_select = 0;
        double  last_ms  = 0.0;
    };

    llama_kvmem_params kp;

    uint32_t n_lt       = 0; // tiered layers
    uint32_t n_head     = 0;
    uint32_t n_head_kv  = 0;
    uint32_t head_dim   = 0;
    uint32_t sink_blocks   = 0;
    uint32_t recent_blocks = 0;
    uint32_t budget_blocks = 0;

    std::vector<int32_t> il_to_lt; // model layer -> tiered layer index (-1 = not tiered)
    std::vector<size_t>  row_k;    // bytes per K row, per tiered layer
    std::vector<size_t>  row_v;
    size_t block_bytes = 0;

    ggml_backend_buffer_t host_buf = nullptr;
    uint8_t * host_base = nullptr;
    uint32_t host_slots = 0;
    std::vector<uint32_t> free_slots;

    std::map<llama_seq_id, seq_state> seqs;

    llama_kvmem_cache * leader = nullptr;
    std::vector<llama_kvmem_cache *> followers;
    bool resident_in_leader(llama_seq_id seq_id, int32_t b) const;
    void forget_from(seq_state & st, llama_pos p0, llama_pos p1); // drop key rows, boxes and query rows in [p0, p1)
    // the block's box from its key rows (by position, per tiered layer), if all rows are there
    void build_box(seq_state & st, int32_t b, const std::function<const float * (llama_pos, uint32_t)> & key_row);
    std::vector<float> kscratch; // the ubatch's pre-RoPE keys, reused across ubatches

    // totals
    int64_t n_selections   = 0;
    int64_t n_staged_in    = 0;
    int64_t n_staged_out   = 0;
    int64_t n_evicted      = 0;
    double  last_select_ms = 0.0;
    bool    host_full_logged = false;

    // snapshot for the getters, refreshed after every mutation
    struct snap_t {
        int32_t n_blocks_gpu = 0;
        int32_t n_blocks_host = 0;
        int64_t n_select = 0;
        double  last_ms = 0.0;
    };
    mutable std::mutex snap_mutex;
    snap_t snap_total;
    std::map<llama_seq_id, snap_t> snap_seq;
    std::string last_error;
    void publish();

    // host <-> device copies of block rows: asynchronous on a device's own stream, plain on CPU
    std::vector<ggml_backend_t> copy_backends; // owned, one per device
    std::vector<ggml_backend_t> copy_backend;  // per tiered layer, nullptr = host memory
    bool copies_pending = false;
    uint32_t stage_hint = 0; // cell where the next search for free cells starts
    void upload(uint32_t lt, ggml_tensor * t, const void * src, size_t offset, size_t size);
    void download(uint32_t lt, ggml_tensor * t, void * dst, size_t offset, size_t size);
    void copies_wait();
    void copy_block(uint8_t * host, const std::vector<uint32_t> & idx, bool to_device); // a host slot <-> cells idx

    uint8_t * slot_ptr(uint32_t slot) const { return host_base + (size_t) slot*block_bytes; }

    bool seq_rm_impl(llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    void drop_host_blocks(llama_seq_id seq_id, int32_t b0); // drop host blocks with index >= b0
    bool evict_one(llama_seq_id prefer_seq);
    void evict_block(llama_seq_id seq_id, int32_t b, hblock & hb);
    bool stage_in(llama_seq_id seq_id, int32_t b, hblock & hb);
    void write_through(llama_seq_id seq_id);
    uint32_t n_resident_blocks() const;
    uint32_t n_host_blocks() const;
};

// outputs of one decode (logits, embeddings, unmasked next-n rows, batch index -> row), kept on the host
// while the context decodes again, then put back (kvmem recomputes or splits batches)
struct llama_kvmem_outputs {
    std::vector<int32_t> ids;
    int32_t n_out = 0;
    std::vector<float> logits, embd, nextn;
};

// graph hook: called from the attention builder for every attention layer when kvmem is on;
// records the pre-RoPE K (all tokens) and pre-RoPE Q (last n_q tokens) of the layer as graph outputs
void llama_kvmem_graph_capture(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_result * res,
        ggml_tensor * q_cur, ggml_tensor * k_cur, int il, uint32_t n_q);

// context setup hooks (llama-context.cpp)
void llama_kvmem_configure(llama_cparams & cparams, const llama_context_params & params); // copy + validate (throws)
void llama_kvmem_check(const llama_model & model, llama_cparams & cparams);               // DISABLED (<reason>) -> budget 0
void llama_kvmem_check_memory(llama_memory_i * mem, llama_cparams & cparams);             // the memory must be ours

// memory factory hooks (llama-model.cpp): nullptr if tiering is off
llama_memory_i * llama_kvmem_create_memory(const llama_model & model, const llama_memory_params & params,
        const llama_cparams & cparams, const llama_memory_i::layer_filter_cb & filter);

// hybrid models (attention + recurrent layers): the attention layers are tiered, the recurrent state is not
llama_memory_i * llama_kvmem_create_hybrid(const llama_model & model, const llama_memory_params & params,
        const llama_cparams & cparams, const llama_memory_i::layer_filter_cb & filter_attn,
        const llama_memory_i::layer_filter_cb & filter_recr);
