#pragma once

// KVMem: KV tiering for the attention KV cache (kvmem-llama).
//
// llama_kvmem_cache is a llama_kv_cache whose cells are only the GPU working set
// (budget + gen_reserve cells per sequence). Every completed block of `block` tokens is copied
// (write-through) into a host pool, so evicting a block from the working set is just a seq_rm on
// its cells. The pool has the KV type asked for (-ctk/-ctv); the working set has it too, or f16
// when that type is quantized (--kvmem-gpu-type f16, the default): history is stored small and
// attention reads f16 (stage-in dequantizes, write-through quantizes). Cells keep the token's original
// position: the KQ mask is built from positions, so a working set with holes is valid attention (no re-RoPE).
//
// Residency, per sequence (the invariants; each has a test in tests/test_kvmem_residency.py or tests/kvmem):
//  1. The sink blocks never leave. During generation the current turn's question (the blocks of
//     the last user message) and the newest blocks stay too.
//  2. A selection runs exactly once at the end of every prompt (a "turn"), whatever the size of
//     the prompt's last batch, and never inside a prompt; during generation re-selections run at
//     exact positions (every --kvmem-refresh tokens, or when the reserve is full), so a
//     speculative verification batch sees the working sets one-token decoding would see, and a
//     rejected draft rolls a re-selection back (kvmem_journal).
//  3. When a new prompt starts, the previous turn's picks become ordinary blocks: a prompt evicts
//     the oldest blocks first, never its own newest blocks before older picks.
//  4. A sequence makes room by evicting idle (released) sequences' blocks, then its own, then
//     blocks another active sequence holds beyond its share of the budget, never another active
//     sequence's protected blocks. Only when parallel prompts together outgrow the working set does a
//     prompt take blocks of another sequence that is reading a prompt (within that one's share, logged):
//     the batch goes on with a smaller prefill window instead of failing (kvmem_evict_tier).
//  5. Budget >= context is token-identical to tiering off.
//  6. An image is one unit of residency: M-RoPE gives its tokens one position, so its cells fall in one block,
//     which goes to the host pool, is scored, leaves and comes back whole (kvmem_block::pos, more_slots) and
//     counts its slots against the share.
//
// Because it *is* a llama_kv_cache and its contexts are llama_kv_cache_context, all model graph builders stay
// unchanged. One concern per file:
//   llama-kvmem-seq.*        a sequence's state and phase machine (IDLE / PROMPT / GEN)
//   llama-kvmem-residency.h  shares, protection and eviction order (pure); llama-kvmem.cpp applies them
//   llama-kvmem-select.*     a selection: plan (pure), apply with its journal, undo, schedule
//   llama-kvmem-score.*      block summaries and scorers, the lexical (BM25) picks (pure)
//   llama-kvmem-rows.cpp     key/query rows and token ids captured after each ubatch
//   llama-kvmem-readback.*   a ubatch's captured tensors read back in one round (pinned on a GPU)
//   llama-kvmem-queries.*    the graph scorer's query rows: host rings, the question kept on the device
//   llama-kvmem-pool.*       the host pool and the copies between it and the working set
//   llama-kvmem-disk.*       the disk tier's file under the host pool; llama-kvmem-spill.cpp what goes there and back
//   llama-kvmem-memory.cpp   llama_memory_i operations (batches, seq_rm, clear, ...)
//   llama-kvmem-setup.cpp    construction, the checks that disable tiering, the memory factory
//   llama-kvmem-graph.cpp    the graph hook that captures pre-RoPE K and Q
//   llama-kvmem-hybrid.cpp   hybrid (attention + recurrent) memories, recurrent snapshots
//   llama-kvmem-decode.cpp   llama_context::decode: plan the batch's segments, run, select, recompute
//   llama-kvmem-outputs.cpp  a batch's outputs assembled across several passes
//   llama-kvmem-api.cpp      the C API and the thread-safe stats

#include "llama-kv-cache.h"
#include "llama-kvmem-disk.h"
#include "llama-kvmem-params.h"
#include "llama-kvmem-pool.h"
#include "llama-kvmem-queries.h"
#include "llama-kvmem-readback.h"
#include "llama-kvmem-residency.h"
#include "llama-kvmem-score.h"
#include "llama-kvmem-seq.h"
#include "llama-kvmem-select.h"
#include "llama-kvmem-summaries.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
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
    static std::string check(const llama_model & model, const llama_cparams & cparams);

    //
    // llama_memory_i
    //

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;

    bool get_can_shift() const override { return false; }

    void clear(bool data) override;
    bool seq_rm  (llama_seq_id seq_id, llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id) override;

    // refused (std::runtime_error, which llama_state_* report and return 0 for): a state holds only the working set,
    // not the history in the host pool, so a restore would be a context with holes that looks whole
    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read(llama_io_read_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    //
    // batches (llama-kvmem-decode.cpp drives these around llama_context::decode)
    //

    // what the batch's tokens of seq_id are (n tokens, n_out outputs, the last one an output or not) and the
    // phase transition it makes: a prompt that starts here ends the previous turn
    kvmem_batch_kind begin_batch(llama_seq_id seq_id, uint32_t n, uint32_t n_out, bool last_out, llama_pos p0);

    // a batch's n_embd embedding inputs (an image) ending at position `end`: they are in the working set together
    // whenever they are read or retrieved, so they and the sequence's floor must fit the budget; false (last error:
    // the budget it needs) when they do not
    bool admit_embeddings(llama_seq_id seq_id, uint32_t n_embd, llama_pos end);

    // the tokens of a prompt batch, kept (a bounded tail) so that the turn's query span can be recomputed
    void remember_tokens(llama_seq_id seq_id, const std::vector<kvmem_prompt_token> & toks);

    // the span of the turn's query for a prompt that ends at `end`: from the last user message as the
    // application told (set_query_span), at most its last query_tokens tokens; else the prompt's last
    // query_tokens tokens
    void turn_query_span(llama_seq_id seq_id, llama_pos end, llama_pos & p0, llama_pos & p1) const;

    // the tokens [p0, end of the prompt) of seq_id that can be recomputed (empty when they are not all kept)
    std::vector<kvmem_prompt_token> tokens_from(llama_seq_id seq_id, llama_pos p0) const;

    // a turn's query span is recomputed after its selection: drop [p0, end) from the working set (not the
    // sequence's turn, journal or recompute state: the same tokens come back), summaries rebuilt where they can be
    void cut_for_recompute(llama_seq_id seq_id, llama_pos p0);

    // the application's hints (C API)
    void set_query_span(llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    void release_seq(llama_seq_id seq_id);

    // before a ubatch: make room (evict resident blocks that are on the host) and place the ubatch
    bool prepare_ubatch(const llama_ubatch & ubatch, slot_info & sinfo);
    slot_info place(const llama_ubatch & ubatch) const; // the lowest free cells, empty if too few

    // after a ubatch was computed: block summaries and query rows, write completed blocks through to the host
    void after_ubatch(ggml_backend_sched_t sched, const llm_graph_result * res, const llama_ubatch & ubatch);

    // score the blocks of seq_id and make its working set sink + question + recent + top-k at its next position;
    // says whether it scored and whether it staged blocks in
    kvmem_selected select(llama_seq_id seq_id, kvmem_reason reason);

    // the position at which seq_id is re-selected next during generation (-1 = none) and why
    llama_pos    event_pos(llama_seq_id seq_id) const;
    kvmem_reason event_reason(llama_seq_id seq_id) const;

    // retrieval prefill: the position inside a prompt where the next prefill selection runs, -1 = none;
    // selections inside a prompt are prefill_step() tokens apart
    llama_pos prefill_pos(llama_seq_id seq_id) const;
    llama_pos prefill_step() const;

    // thread-safe: the server reads these while a decode runs on its worker thread
    void get_stats(llama_kvmem_stats * out) const;
    void get_seq_stats(llama_seq_id seq_id, llama_kvmem_stats * out) const;
    std::string get_last_error() const;
    void set_last_error(const std::string & msg);

    const llama_kvmem_params & params() const { return kp; }

    // false (and the error set) when the blocks these ubatches complete do not fit in the host pool; with a disk
    // tier, other sequences' blocks go to disk to make room, and the ubatches' sequences' blocks on disk come back.
    // whole_batch: these are a whole batch's ubatches (init_batch), whose sequences none of its ubatches sends to
    // disk (they are selected after the batch)
    bool host_room_for(const llama_ubatch * ubatches, size_t n_ubatches, bool whole_batch = false);

    // sequences the working set holds at once, each at its floor share plus an open block or its reserve
    uint32_t max_active() const;

    // largest ubatch that fits next to the sink and one block of history
    uint32_t max_ubatch(uint32_t n_ubatch) const;

    // lowers n_ub to what the working set can take for this batch's sequences now (parallel slots share it)
    void fit_ubatch(const llama_batch_allocr & balloc, uint32_t & n_ub) const;

    // false when nothing was ever evicted and adding n_new tokens cannot evict anything: a selection could not
    // stage anything in (identity with tiering off needs no recompute)
    bool may_stage(uint32_t n_new) const;

    // the wall time of one of llama's own decode passes (the model's graph, with our hooks): the next SELECT line
    // says how much of the time between selections the passes took, the rest being ours and the application's
    void note_decode_pass(int64_t us) { capture.decode_us += us; capture.decodes++; }

    // hybrid models: the recurrent state next to the tiered attention layers (snapshotted before prompt
    // batches so that the turn's query span can be recomputed after a selection)
    void attach_recurrent(llama_memory_recurrent * recr) { recurrent_mem = recr; }
    llama_memory_recurrent * recurrent() const { return recurrent_mem; }
    // where the application said the prompt ends (-1: it did not)
    llama_pos hinted_prompt_end(llama_seq_id seq_id) const;
    // snapshots the recurrent state of seq_id at pos (the copies queued on sched's backends; the newest two kept)
    void take_snapshot(ggml_backend_sched_t sched, llama_seq_id seq_id, llama_pos pos);
    // the newest snapshot at or before pos (nullptr: none)
    const kvmem_snapshot * snapshot_at(llama_seq_id seq_id, llama_pos pos) const;

    // MTP draft contexts: the draft's cache follows the target's selection (same resident blocks)
    bool is_follower() const { return leader != nullptr; }
    void follow_leader();

private:
    const llama_kvmem_params kp;
    const kvmem_geometry     geom;
    const kvmem_residency    rules;
    std::unique_ptr<kvmem_scorer> scorer;
    kvmem_dims dims;

    uint32_t n_seq_cap = 1; // sequences the working set was sized for

    std::vector<kvmem_layer_rows> lrows; // per tiered layer: tensors, row sizes, pool types

    kvmem_host_pool pool;
    kvmem_copier    copier;
    uint32_t stage_hint = 0; // cell where the next search for free cells starts

    // mass and hybrid score on the backend of the working set (llama-kvmem-summaries.h); other methods on the host
    ggml_backend_t score_backend = nullptr;      // the copier's device backend, or own_score_backend; nullptr: the host scorer
    ggml_backend_t own_score_backend = nullptr;  // a CPU backend for --kvmem-score-on device without a device
    std::unique_ptr<kvmem_summary_store> summaries;
    std::unique_ptr<kvmem_graph_scorer>  graph_scorer;
    std::unique_ptr<kvmem_query_store>   query_store; // the graph scorer's query rows
    void init_summaries();
    kvmem_score_fn score_fn(llama_seq_id seq_id, const kvmem_seq & st);

    kvmem_seqs seqs;
    bool app_marks_prompts = false; // the application calls set_query_span at every prompt: only those start turns

    llama_memory_recurrent * recurrent_mem = nullptr;
    std::vector<kvmem_room> spare_rooms; // pinned memory of dropped snapshots, for the next ones
    void drop_snapshots_from(kvmem_seq & st, llama_pos pos);

    llama_kvmem_cache * leader = nullptr;
    std::vector<llama_kvmem_cache *> followers;
    bool resident_in_leader(llama_seq_id seq_id, int32_t b) const;

    // sequences (explicit creation: only batches, hints and write-through open one)
    kvmem_seq & open_seq(llama_seq_id seq_id) { return seqs[seq_id]; }
    const kvmem_seq * find_seq(llama_seq_id seq_id) const;
    kvmem_seq * find_seq(llama_seq_id seq_id);
    kvmem_block * find_block(llama_seq_id seq_id, int32_t b);
    size_t ws_block_bytes() const; // one block in the working set

    // residency (llama-kvmem.cpp)
    uint32_t share_blocks(llama_seq_id seq_id) const { return std::min(geom.budget_blocks, rules.share_blocks(seqs, seq_id)); }
    bool evict_one(llama_seq_id for_seq, kvmem_journal * journal);
    void evict_block(llama_seq_id seq_id, int32_t b, kvmem_block & hb, kvmem_journal * journal);
    void log_no_room(uint32_t n_tokens);

    // selection (llama-kvmem-select.cpp)
    void begin_turn_query(llama_seq_id seq_id, kvmem_seq & st, llama_pos pos);
    void apply_target(llama_seq_id seq_id, kvmem_seq & st, const std::set<int32_t> & target, kvmem_journal * journal,
            uint32_t & staged_in, uint32_t & staged_out, uint32_t & reused);
    // the whole history is resident and stays so: the selection is a no-op, logged as SELECT ... fits=1
    // the SELECT line's fields of the time since the previous one (captures, decode passes) and the images' blocks
    std::string capture_fields(const kvmem_seq & st) const;
    void log_fitting(llama_seq_id seq_id, kvmem_seq & st, kvmem_reason reason, llama_pos pos, uint32_t share,
            double gather_ms);
    void schedule_event(llama_seq_id seq_id, kvmem_seq & st, llama_pos pos);
    void undo_events(llama_seq_id seq_id, kvmem_seq & st, llama_pos p0);
    void trace_resident(llama_seq_id seq_id, const kvmem_seq & st, llama_pos pos, kvmem_reason reason) const;

    // rows (llama-kvmem-rows.cpp): drop key rows, query rows and (unless keep_summaries) host summaries in [p0, p1);
    // a cut inside a block whose first rows are gone keeps its summary aside (read from the store: call this before
    // the host blocks go)
    void forget_from(kvmem_seq & st, llama_pos p0, llama_pos p1, bool keep_summaries = false);
    // the ubatch's captured K and Q tensors read back in one round (cap_k/cap_q per tiered layer; nullptr: none)
    void fetch_captures(ggml_backend_sched_t sched, const llm_graph_result * res, uint32_t n_tokens, bool keys,
            bool queries);
    bool wants_query_rows(const llama_ubatch & ubatch) const; // any of its sequences' (kvmem_seq::wants_query_rows)
    // a generating sequence whose whole history stays resident through position `until`: no re-selection before
    // then does anything, so the query rows it would read need not be captured
    bool fits_through(llama_seq_id seq_id, const kvmem_seq & st, llama_pos until) const;
    void capture_keys(const llama_ubatch & ubatch);
    void capture_queries(const llama_ubatch & ubatch);
    void capture_tokens(const llama_ubatch & ubatch);
    // block b's summary once the sequence reached its end (reached: the newest position it decoded)
    void build_summary(llama_seq_id seq_id, kvmem_seq & st, int32_t b, llama_pos reached, const kvmem_key_rows & key_row);
    // a block in the host pool whose summary is on the host goes to the summary store, its host copy with it
    void store_summary(kvmem_seq & st, int32_t b, kvmem_block & hb);
    // a block's summary where it is (host, or read back from the store); empty when it has none
    std::vector<float> block_summary(const kvmem_seq & st, int32_t b) const;
    kvmem_readback readback;
    std::vector<const float *> cap_k, cap_q; // into readback, for the ubatch being captured
    uint32_t n_cap_q = 0;                    // query rows per layer in cap_q
    bool warned_no_keys = false;

    // memory operations (llama-kvmem-memory.cpp)
    // a saved state (llama-kvmem-state.cpp)
    std::string model_id; // the model a state must have been saved with
    std::string state_layout() const;
    // a draft's cache (MTP) follows the target's residency: its state is not saved; a restore into the target
    // needs the followers empty for the sequence (the draft starts it anew, after the restored history)
    void refuse_state_of_follower() const;
    void find_images(kvmem_seq & st) const; // st.embd_end from the blocks of images (a restored sequence)
    void check_block_cells(int32_t b, const kvmem_block & hb) const; // a saved block's cells are its own (or throws)
    void refuse_restore_under_full_followers(llama_seq_id seq_id) const;
    void write_seq(llama_io_write_i & io, llama_seq_id seq_id, const kvmem_seq & st) const;
    void read_header(llama_io_read_i & io) const;
    // where a restored sequence's cells go: the saved cells when all are free (the sequence emptied first)
    slot_info_vec_t saved_layout(const std::vector<uint32_t> & cells, llama_seq_id seq_id);
    void read_seq(llama_io_read_i & io, llama_seq_id seq_id);

    bool seq_rm_impl(llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    void drop_host_blocks(llama_seq_id seq_id, int32_t b0); // drop host blocks with index >= b0
    void bring_back_last(llama_seq_id seq_id, kvmem_seq & st, llama_pos p0);

    // host pool and copies (llama-kvmem-pool.cpp)
    void init_pool(uint32_t n_ctx_total);
    bool stage_in(llama_seq_id seq_id, int32_t b, kvmem_block & hb, kvmem_journal * journal);
    bool stage_in_at(llama_seq_id seq_id, int32_t b, kvmem_block & hb, const std::vector<uint32_t> & idx,
            kvmem_journal * journal); // into these cells
    // the cells' side of a stage-in whose copy is queued: the block's positions, sequence and journal entry
    void book_stage_in(llama_seq_id seq_id, int32_t b, kvmem_block & hb, const std::vector<uint32_t> & idx,
            kvmem_journal * journal);
    bool stage_in_making_room(llama_seq_id seq_id, int32_t b, kvmem_block & hb, kvmem_journal * journal);
    std::vector<uint32_t> free_run(uint32_t n) const;
    // the cells of stage-ins of sizes[j] cells each, one after the other, as free_run would choose them once the
    // leaving blocks of seq_id are evicted (before they are); fewer when the cells run out
    std::vector<std::vector<uint32_t>> place_stage_ins(llama_seq_id seq_id, const std::vector<int32_t> & leaving,
            const std::vector<uint32_t> & sizes);
    // a sequence's cells at the block's positions, by position then cell
    std::vector<uint32_t> block_cells(llama_seq_id seq_id, int32_t b) const;
    // the sequence's completed blocks into the host pool; embd: after an image's ubatch (its position's block
    // may get more of its cells)
    void write_through(llama_seq_id seq_id, bool embd = false);
    // whether cells idx of block b are one at each of its B positions (a pool slot's layout; an image's are not)
    bool one_cell_per_position(int32_t b, const std::vector<uint32_t> & idx) const;
    // n free host slots for hb (false, taking none, when fewer are free)
    bool take_slots(kvmem_block & hb, uint32_t n);
    // a block's cells idx (its cell order) to or from its slots; asynchronous until copier.wait()
    void copy_block(const kvmem_block & hb, const std::vector<uint32_t> & idx, bool to_dev);
    // a block's first slot's bytes in the pool (asserts it is not on disk)
    uint8_t * pool_bytes(const kvmem_block & hb) const;
    // a block's storage given back: its pool slot, or its disk record
    void release_storage(kvmem_block & hb);

    // the disk tier (llama-kvmem-spill.cpp)
    kvmem_disk_tier disk;
    uint64_t use_clock = 0; // ticks at every batch: sequences' last use
    void init_disk();
    // `need` free pool slots: blocks of sequences outside `keep` go to disk (released, then idle, then the others,
    // least recently used first; within one, blocks out of the working set first); false when they do not suffice
    bool make_host_room(uint32_t need, const std::set<llama_seq_id> & keep);
    // pool slots of sequences outside keep (what make_host_room can move), of blocks of at most max_slots slots
    uint32_t n_spillable(const std::set<llama_seq_id> & keep, uint32_t max_slots = UINT32_MAX) const;
    std::string disk_full_message() const;
    bool spill(kvmem_block & hb, std::string & err);
    std::string spill_error;                 // why the last make_host_room stopped short ("" if it did not)
    std::set<llama_seq_id> batch_seqs;       // the sequences of the batch being decoded (host_room_for)
    uint32_t n_spilled = 0; // disk records written since the last settle_disk (a slot each)
    // the blocks moved to disk on the disk, out of the page cache, and said in the log
    void settle_disk(const char * why);
    // every block of seq_id on disk back into the pool (others' leave for them); false with the error set when some stay
    bool bring_home(llama_seq_id seq_id, const std::set<llama_seq_id> & keep);
    // a block's slots, src[j] / dst[j], to or from its records recs[j] (the summary with the first; a null dst[j] is
    // not read); false with the reason
    bool write_records(const std::vector<uint32_t> & recs, const std::vector<const uint8_t *> & src,
            const std::vector<float> & summary, std::string & err);
    bool read_records(const kvmem_block & hb, const std::vector<uint8_t *> & dst, std::vector<float> & summary,
            std::string & err) const;
    // a block read back into these pool slots (its records already given), its summary in the store
    void place_home(kvmem_block & hb, const std::vector<uint32_t> & slots, const std::vector<float> & summary);
    // a block's records into free pool slots (one per slot), its summary into the store; false with the reason
    bool read_home(kvmem_block & hb, std::string & err);
    // a block into a full pool when the tier lacks records to make room: read aside, one-slot blocks of other
    // sequences take its records
    bool trade_places(kvmem_block & hb, const std::set<llama_seq_id> & kept, std::string & err);
    uint32_t n_on_disk(const kvmem_seq & st) const; // in slots, as the pool counts them
    // the bytes and the summary of a block on disk (state saves read them there)
    void read_spilled(const kvmem_block & hb, std::vector<uint8_t> & bytes, std::vector<float> & summary) const;
    // the same, false with the reason instead of throwing
    bool read_aside(const kvmem_block & hb, std::vector<uint8_t> & bytes, std::vector<float> & summary, std::string & err) const;

    // stats (llama-kvmem-api.cpp): totals written by the decode thread, published under the lock
    struct counters {
        int32_t n_blocks_gpu  = 0;
        int32_t n_blocks_host = 0;
        int32_t n_blocks_disk = 0;
        int64_t n_select      = 0;
        int64_t n_staged_in   = 0;
        int64_t n_staged_out  = 0;
        int64_t n_evicted     = 0;
        double  last_ms       = 0.0;
    };
    counters totals;
    // host time spent after ubatches since the last SELECT line (which says it), by part: reading the captured rows
    // back (with the wait for their copies), the write-through of completed blocks; the query rows captured; and
    // the decode passes in that time (note_decode_pass)
    struct {
        int64_t us = 0, fetch_us = 0, write_us = 0, decode_us = 0;
        uint32_t ubatches = 0, q_rows = 0, decodes = 0;
    } capture;
    bool host_full_logged = false;

    mutable std::mutex snap_mutex;
    counters snap_total;
    std::map<llama_seq_id, counters> snap_seq;
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

// split a batch into ubatches that the tiered cache can take (plain memories: split_simple); nullptr if it cannot
bool llama_kvmem_split(llama_kvmem_cache * km, llama_batch_allocr & balloc, uint32_t n_ubatch,
        const std::function<llama_ubatch(llama_batch_allocr &, uint32_t)> & split, std::vector<llama_ubatch> & out);

// outputs of one decode (logits, embeddings, unmasked next-n rows, batch index -> row), kept on the host
// while the context decodes again, then put back (kvmem recomputes or splits batches)
struct llama_kvmem_outputs {
    std::vector<int32_t> ids;
    int32_t n_out = 0;
    std::vector<float> logits, embd, nextn;
};

// the outputs of a caller's batch decoded in several passes, kept per batch token: a later pass replaces an earlier
// one's rows for the same token (llama-kvmem-outputs.cpp)
struct kvmem_assembled_outputs {
    std::vector<std::vector<float>> logits, embd, nextn;
    bool any = false;

    explicit kvmem_assembled_outputs(size_t n) : logits(n), embd(n), nextn(n) {}
};

// graph hook: called from the attention builder for every attention layer when kvmem is on; records the
// pre-RoPE K rows (all tokens) and Q rows (last tokens) of the layer as graph outputs
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
