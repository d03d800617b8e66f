#pragma once

// KVMem: KV tiering for the attention KV cache (kvmem-llama).
//
// llama_kvmem_cache is a llama_kv_cache whose cells are only the GPU working set
// (budget + gen_reserve cells per sequence). Every completed block of `block` tokens is copied
// (write-through) into a host pool, so evicting a block from the working set is just a seq_rm on
// its cells. The pool has the KV type asked for (-ctk/-ctv); the working set has it too, or f16
// when that type is quantized (--kvmem-gpu-type f16, the default): history is stored small and
// attention reads f16 (stage-in dequantizes, write-through quantizes). Cells keep the token's original position: the KQ mask is built
// from positions, so a working set with holes is valid attention (no re-RoPE).
//
// Residency, per sequence (the invariants; each has a test in tests/test_kvmem_residency.py):
//  1. The sink blocks never leave. During generation the current turn's question (the blocks of
//     the last user message) and the newest blocks stay too.
//  2. A selection runs exactly once at the end of every prompt (a "turn"), whatever the size of
//     the prompt's last batch, and never inside a prompt; during generation re-selections run at
//     exact positions (every --kvmem-refresh tokens, or when the reserve is full), so a
//     speculative verification batch sees the working sets one-token decoding would see, and a
//     rejected draft rolls a re-selection back.
//  3. When a new prompt starts, the previous turn's picks become ordinary blocks: a prompt evicts
//     the oldest blocks first, never its own newest blocks before older picks.
//  4. A sequence makes room by evicting idle (released) sequences' blocks, then its own, then
//     blocks another active sequence holds beyond its share of the budget, never another active
//     sequence's protected blocks. Only when parallel prompts together outgrow the working set does a
//     prompt take blocks of another sequence that is reading a prompt (within that one's share, logged):
//     the batch goes on with a smaller prefill window instead of failing.
//  5. Budget >= context is token-identical to tiering off.
//
// Because it *is* a llama_kv_cache and its contexts are llama_kv_cache_context, all model graph
// builders stay unchanged. Files: llama-kvmem.cpp (residency), llama-kvmem-pool.cpp (host pool and
// copies), llama-kvmem-score.cpp (summaries and scoring), llama-kvmem-decode.cpp (context hooks).

#include "llama-kv-cache.h"
#include "llama-kvmem-params.h"
#include "llama-kvmem-score.h"

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

class llm_graph_result;
class llama_memory_recurrent;
struct llama_cparams;

// defined in llama.h (C API); forward-declared here for the getters
struct llama_kvmem_stats;

// what a batch is for one sequence
enum kvmem_batch_kind {
    KVMEM_BATCH_PROMPT, // a prompt chunk that does not end the prompt (no output at its end)
    KVMEM_BATCH_TURN,   // the end of a prompt: the turn's selection runs after it
    KVMEM_BATCH_GEN,    // generation: one sampled token, or a speculative verification batch
};

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
    // batches (llama-kvmem-decode.cpp drives these around llama_context::decode)
    //

    // what the batch's tokens of seq_id are (n tokens, n_out outputs, the last one an output or not);
    // a prompt that starts here ends the previous turn (its picks become ordinary blocks)
    kvmem_batch_kind begin_batch(llama_seq_id seq_id, uint32_t n, uint32_t n_out, bool last_out, llama_pos p0);

    // the tokens of a prompt batch, kept (a bounded tail) so that the turn's query span can be recomputed
    void remember_tokens(llama_seq_id seq_id, const std::vector<std::pair<std::array<llama_pos, 4>, llama_token>> & toks);

    // the span of the turn's query for a prompt that ends at `end`: [p0, p1) of the last user message as the
    // application told (set_query_span), at most its last query_tokens tokens; else the prompt's last
    // query_tokens tokens (p1 = end)
    void turn_query_span(llama_seq_id seq_id, llama_pos end, llama_pos & p0, llama_pos & p1) const;

    // the tokens [p0, end of the prompt) of seq_id that can be recomputed (empty when they are not all kept)
    std::vector<std::pair<std::array<llama_pos, 4>, llama_token>> tokens_from(llama_seq_id seq_id, llama_pos p0) const;

    // the application's hints (C API)
    void set_query_span(llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    void release_seq(llama_seq_id seq_id);

    // before a ubatch: make room (evict resident blocks that are on the host) and place the ubatch
    bool prepare_ubatch(const llama_ubatch & ubatch, slot_info & sinfo);
    slot_info place(const llama_ubatch & ubatch) const; // the lowest free cells, empty if too few

    // after a ubatch was computed: block summaries and query rows, write completed blocks through to the host
    void after_ubatch(ggml_backend_sched_t sched, const llm_graph_result * res, const llama_ubatch & ubatch);

    // score the blocks of seq_id and make its working set sink + question + recent + top-k, at position pos
    // (reason: "turn" at a prompt's end, "refresh"/"room" during generation, "prefill" inside a prompt in
    // retrieval prefill mode); returns true if blocks were staged in
    bool select(llama_seq_id seq_id, const char * reason);

    // the position at which seq_id is re-selected next during generation, -1 = none
    llama_pos event_pos(llama_seq_id seq_id) const;
    // the reason of that re-selection ("refresh" or "room")
    const char * event_reason(llama_seq_id seq_id) const;

    // retrieval prefill: the position inside a prompt where the next prefill selection runs, -1 = none;
    // selections inside a prompt are prefill_step() tokens apart
    llama_pos prefill_pos(llama_seq_id seq_id) const;
    llama_pos prefill_step() const;

    // thread-safe: the server reads these while a decode runs on its worker thread
    void get_stats(llama_kvmem_stats * out) const;
    bool get_seq_stats(llama_seq_id seq_id, llama_kvmem_stats * out) const;
    std::string get_last_error() const;
    void set_last_error(const std::string & msg);

    const llama_kvmem_params & params() const { return kp; }

    // false (and the error set) when the blocks these ubatches complete do not fit in the host pool
    bool host_room_for(const llama_ubatch * ubatches, size_t n_ubatches);

    // sequences the working set holds at once, each at its floor share (sink + recent + 2 blocks) plus an open
    // block or its generation reserve
    uint32_t max_active() const;

    // largest ubatch that fits next to the sink and one block of history
    uint32_t max_ubatch(uint32_t n_ubatch) const;

    // lowers n_ub to what the working set can take for this batch's sequences now (parallel slots share it)
    void fit_ubatch(const llama_batch_allocr & balloc, uint32_t & n_ub) const;

    // false when nothing was ever evicted and adding n_new tokens cannot evict anything: a selection could not
    // stage anything in (identity with tiering off needs no recompute)
    bool may_stage(uint32_t n_new) const;

    // true while the context recomputes the tail of a turn after a selection
    bool in_redecode = false;

    // hybrid models: the recurrent state next to the tiered attention layers (snapshotted before prompt
    // batches so that the turn's query span can be recomputed after a selection)
    llama_memory_recurrent * recr = nullptr;
    void push_snapshot(llama_seq_id seq_id, llama_pos pos, std::vector<uint8_t> && data);
    // the newest snapshot at or before pos (nullptr: none); its position in *at
    const std::vector<uint8_t> * snapshot_at(llama_seq_id seq_id, llama_pos pos, llama_pos * at) const;

    // MTP draft contexts: the draft's cache follows the target's selection (same resident blocks)
    // instead of selecting on its own
    void set_leader(llama_kvmem_cache * target);
    bool is_follower() const { return leader != nullptr; }
    void follow_leader();

private:
    struct hblock {
        uint32_t slot     = 0;     // host pool slot
        bool     resident = false; // cells of this block are in the working set
        bool     picked   = false; // chosen by the score of the last selection
        float    score    = 0.0f;  // its score (picks are evicted lowest score first)
        std::vector<llama_kv_cell_ext> ext;
    };

    enum phase_t { PHASE_IDLE, PHASE_PROMPT, PHASE_GEN };

    // a re-selection during generation, kept so that a truncation below its position can undo it exactly:
    // the blocks it evicted go back into the very cells they held (the same cell order, so attention sums
    // in the same order as when nothing was speculated) and the blocks it staged in leave
    struct gen_event {
        llama_pos pos = -1;                    // tokens at >= pos saw the new working set
        bool room = false;
        std::map<int32_t, float> picks_before; // picks (and scores) before it
        std::vector<std::pair<std::pair<llama_seq_id, int32_t>, std::vector<uint32_t>>> evicted; // (seq, block), cells
        std::vector<std::pair<llama_seq_id, int32_t>> staged;
        uint32_t stage_hint = 0;
    };
    gen_event * journal = nullptr; // the event being made: evictions and stage-ins are recorded in it

    struct seq_state {
        std::map<int32_t, hblock> blocks;            // completed blocks on the host, by block index
        std::map<int32_t, std::vector<float>> summ;  // block summaries (the scorer's), by block index
        // a block cut by a truncation deep in the history (its older key rows are gone): its old summary and
        // how many leading tokens are unchanged, to rebuild the summary when the block completes again
        std::map<int32_t, std::pair<std::vector<float>, uint32_t>> stale;
        std::map<llama_pos, std::vector<float>> krow; // key rows of the two newest blocks: a summary is rebuilt
                                                      // exactly after a truncation
        std::map<llama_pos, std::vector<float>> qrow; // query rows of the newest tokens, by position
        std::vector<float> turn_q;                   // the turn's query rows (the question), kept for refreshes
        std::map<int32_t, std::vector<llama_token>> btok; // token ids by block (-1: unknown), for lexical picks
        std::vector<std::pair<llama_token, float>> turn_tok; // the question's tokens, weighted toward its end
        std::vector<llama_pos> turn_q_pos;
        int32_t next_host = 0;                       // first block index not yet on the host

        phase_t   phase      = PHASE_IDLE;
        bool      released   = false;               // the application is done with it for now (C API)
        llama_pos prompt_p0  = -1;                  // first position of the current prompt
        llama_pos turn_pos   = -1;                  // end of the last prompt (position of the first generated token)
        llama_pos q0 = -1, q1 = -1;                  // the turn's question span
        llama_pos hint_p0 = -1, hint_p1 = -1;        // the application's span of the last user message
        bool      prompt_mark = false;               // the application said a new prompt starts (set_query_span)
        bool      squeezed    = false;               // this prompt lost blocks within its share to another's (logged once)

        std::vector<gen_event> events;               // re-selections since the turn
        llama_pos next_event = -1;                   // next re-selection position during generation
        bool      next_is_room = false;
        llama_pos next_prefill = -1;                 // next prefill selection (retrieval prefill mode)

        std::deque<std::pair<std::array<llama_pos, 4>, llama_token>> toks; // recent prompt tokens (recompute)
        std::deque<std::pair<llama_pos, std::vector<uint8_t>>> snaps;      // recurrent snapshots (hybrid)

        int64_t n_select = 0;
        double  last_ms  = 0.0;
    };

    llama_kvmem_params kp;
    kvmem_dims dims;
    std::unique_ptr<kvmem_scorer> scorer;

    uint32_t n_lt          = 0; // tiered layers
    uint32_t n_head        = 0;
    uint32_t n_head_kv     = 0;
    uint32_t head_dim      = 0;
    uint32_t sink_blocks   = 0;
    uint32_t recent_blocks = 0;
    uint32_t budget_blocks = 0;
    uint32_t n_seq_cap     = 1; // sequences the working set was sized for

    std::vector<int32_t> il_to_lt; // model layer -> tiered layer index (-1 = not tiered)
    std::vector<size_t>  row_k;    // bytes per K row in the working set, per tiered layer
    std::vector<size_t>  row_v;
    std::vector<size_t>  hrow_k;   // bytes per K row in the host pool (differ when the pool is quantized and the set is not)
    std::vector<size_t>  hrow_v;
    ggml_type pool_type_k = GGML_TYPE_F16;
    ggml_type pool_type_v = GGML_TYPE_F16;
    size_t block_bytes = 0;        // one host slot
    size_t ws_block_bytes = 0;     // one block in the working set

    ggml_backend_buffer_t host_buf = nullptr;
    uint8_t * host_base = nullptr;
    uint32_t host_slots = 0;
    std::vector<uint32_t> free_slots;

    std::map<llama_seq_id, seq_state> seqs;
    bool app_marks_prompts = false; // the application calls set_query_span at every prompt: only those start turns

    llama_kvmem_cache * leader = nullptr;
    std::vector<llama_kvmem_cache *> followers;
    bool resident_in_leader(llama_seq_id seq_id, int32_t b) const;

    // residency (llama-kvmem.cpp)
    bool active(const seq_state & st) const { return !st.released && st.phase != PHASE_IDLE; }
    uint32_t share_blocks(llama_seq_id seq_id) const;         // the sequence's part of the budget
    uint32_t n_resident(const seq_state & st) const;
    bool protected_block(const seq_state & st, int32_t b) const;
    bool evict_one(llama_seq_id for_seq);                    // per invariant 4
    void evict_block(llama_seq_id seq_id, int32_t b, hblock & hb);
    std::set<int32_t> plan_target(llama_seq_id seq_id, seq_state & st, const char * reason, std::map<int32_t, float> & picks,
            uint32_t & n_sink, uint32_t & n_question, uint32_t & n_recent, uint32_t & query_rows, uint32_t & n_lex);
    void apply_target(llama_seq_id seq_id, seq_state & st, const std::set<int32_t> & target, uint32_t & staged_in,
            uint32_t & staged_out, uint32_t & reused);
    void schedule_event(llama_seq_id seq_id, seq_state & st, llama_pos pos);
    void undo_events(llama_seq_id seq_id, seq_state & st, llama_pos p0);
    void trace_resident(llama_seq_id seq_id, const seq_state & st, llama_pos pos, const char * reason) const;
    // drop key rows, query rows and (unless keep_summaries) block summaries in [p0, p1)
    void forget_from(seq_state & st, llama_pos p0, llama_pos p1, bool keep_summaries = false);
    bool seq_rm_impl(llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    void drop_host_blocks(llama_seq_id seq_id, int32_t b0); // drop host blocks with index >= b0
    void end_turn(seq_state & st);                          // a new prompt starts: picks become ordinary blocks
    void query_rows(const seq_state & st, std::vector<float> & rows, uint32_t & n_rows) const;
    // blocks (not in `exclude`) that share rare words with the question, best first: BM25 over block tokens with
    // the question's tokens weighted toward its end (the span may start inside a long message), kept only when a
    // block stands out (mean + 2 sd of the candidates) and holds a rare word from near the question's end, so a
    // question without rare words adds none
    std::vector<std::pair<float, int32_t>> lexical_rank(const seq_state & st, const std::set<int32_t> & exclude) const;
    void build_summary(seq_state & st, int32_t b, const std::function<const float * (llama_pos, uint32_t)> & key_row);
    std::vector<float> kscratch; // the ubatch's key rows, reused across ubatches

    // host pool and copies (llama-kvmem-pool.cpp)
    std::vector<ggml_backend_t> copy_backends; // owned, one per device
    std::vector<ggml_backend_t> copy_backend;  // per tiered layer, nullptr = host memory
    bool copies_pending = false;
    uint32_t stage_hint = 0; // cell where the next search for free cells starts
    void init_pool(uint32_t n_ctx_total);
    void upload(uint32_t lt, ggml_tensor * t, const void * src, size_t offset, size_t size);
    void download(uint32_t lt, ggml_tensor * t, void * dst, size_t offset, size_t size);
    void copies_wait();
    void copy_block(uint8_t * host, const std::vector<uint32_t> & idx, bool to_device); // a host slot <-> cells idx
    // type conversion between the pool and the working set: rows of the working set's type kept until the
    // copies that read or fill them are done
    std::deque<std::vector<uint8_t>> conv_bufs;
    size_t conv_pending = 0;
    std::vector<float> conv_f32;
    bool converts(bool is_v) const;
    void convert_rows(ggml_type from, const void * src, ggml_type to, void * dst, size_t n_rows, int64_t n_per_row);
    uint8_t * slot_ptr(uint32_t slot) const { return host_base + (size_t) slot*block_bytes; }
    bool stage_in(llama_seq_id seq_id, int32_t b, hblock & hb);
    bool stage_in_at(llama_seq_id seq_id, int32_t b, hblock & hb, const std::vector<uint32_t> & idx); // into these cells
    std::vector<uint32_t> block_cells(llama_seq_id seq_id, int32_t b) const;
    void write_through(llama_seq_id seq_id);
    uint32_t n_resident_blocks() const;
    uint32_t n_host_blocks() const;

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
};

// a llama_kv_cache_context that places each ubatch in the tiered cache only when it is applied (evicting
// blocks to make room), for plain and hybrid memories
class llama_kvmem_context : public llama_kv_cache_context {
public:
    // note: the slot infos are sized by the caller (argument evaluation order is unspecified)
    llama_kvmem_context(llama_kvmem_cache * km, slot_info_vec_t sinfos, std::vector<llama_ubatch> ubs) :
        llama_kv_cache_context(km, std::move(sinfos), std::move(ubs)), km(km) {}

    bool apply() override;

private:
    llama_kvmem_cache * km;
};

// outputs of one decode (logits, embeddings, unmasked next-n rows, batch index -> row), kept on the host
// while the context decodes again, then put back (kvmem recomputes or splits batches)
struct llama_kvmem_outputs {
    std::vector<int32_t> ids;
    int32_t n_out = 0;
    std::vector<float> logits, embd, nextn;
};

// graph hook: called from the attention builder for every attention layer when kvmem is on; records the
// K rows (all tokens) and Q rows (last n_q tokens) of the layer, before or after RoPE, as graph outputs
void llama_kvmem_graph_capture(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_result * res,
        ggml_tensor * q_cur, ggml_tensor * k_cur, int il, const llama_kvmem_params & kp);

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
