#pragma once

// KVMem: the state of one tiered sequence and its phase machine (kvmem-llama). See llama-kvmem.h.
//
//   IDLE --prompt batch--> PROMPT --its last batch (the turn's selection)--> GEN --next prompt--> PROMPT
//   GEN or PROMPT --truncated below the turn--> IDLE;  IDLE --generation without a prompt--> GEN
//
// Pure data and transitions: no cells, no copies, so the residency and selection rules can be tested on
// synthetic sequences (tests/kvmem).

#include "llama.h"
#include "llama-kv-cells.h"
#include "llama-kvmem-lexical.h"
#include "llama-kvmem-snapshot.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

enum class kvmem_phase : uint8_t {
    IDLE,   // no prompt being read and no answer being generated (new, released or cut)
    PROMPT, // reading a prompt: its blocks are evicted oldest first, no selection
    GEN,    // answering a turn: the question and the newest blocks stay, re-selections at exact positions
};

// what a batch is for one sequence
enum class kvmem_batch_kind : uint8_t {
    PROMPT, // a prompt chunk that does not end the prompt (no output at its end)
    TURN,   // the end of a prompt: the turn's selection runs after it
    GEN,    // generation: one sampled token, or a speculative verification batch
};

// why a selection runs
enum class kvmem_reason : uint8_t {
    TURN,    // the end of a prompt
    REFRESH, // every --kvmem-refresh generated tokens
    ROOM,    // the sequence's share of the working set plus its reserve is full
    PREFILL, // inside a prompt (--kvmem-prefill retrieval)
};

const char * kvmem_reason_name(kvmem_reason reason);

// what a selection did
enum class kvmem_selected : uint8_t {
    NOTHING, // nothing to score: no completed block, the whole history resident, or the sequence is in the pool
    KEPT,    // scored: the working set already held the picks, nothing staged in
    STAGED,  // scored, and blocks were staged in
};

// a completed block of a sequence: slots of the host pool, maybe also cells of the working set. Most blocks are B
// cells at positions b*B + t in one slot. A block that holds an image is not: the image's tokens share an M-RoPE
// position (many cells at one position) and the positions it spans after that have no cells. Such a block keeps
// each cell's position and takes as many slots as its cells need (cell t in slot t/B, row t%B); it moves, is scored
// and comes back as one unit, and costs its slots in the sequence's share.
struct kvmem_block {
    uint32_t slot     = 0;     // host pool slot (the first, where a summary in the store lives)
    std::vector<uint32_t> more_slots; // the slots after the first, of a block of more than B cells
    std::vector<llama_pos> pos;       // per cell, when the block is not one cell at each of its B positions
    bool     resident = false; // its cells are in the working set
    bool     picked   = false; // chosen by the score of the last selection (picks leave lowest score first)
    float    score    = 0.0f;
    bool     summarized = false; // its summary is in the summary store's slot, the only copy (not in rows.summary)
    bool     on_disk  = false; // in the disk tier's record disk_rec (with its summary), not in the pool (slot is free)
    uint32_t disk_rec = 0;
    std::vector<uint32_t> more_recs; // on disk: a record for each slot after the first (more_slots is then empty)
    std::vector<llama_kv_cell_ext> ext; // per cell (M-RoPE positions)

    // its weight in a share of blocks
    uint32_t n_slots() const { return 1 + (uint32_t) (on_disk ? more_recs.size() : more_slots.size()); }
    bool     irregular() const { return !pos.empty(); }
    uint32_t n_cells(uint32_t B) const { return pos.empty() ? B : (uint32_t) pos.size(); } // a complete block's
    // cells that share a position: an image's (a block after an image's span is irregular only for its gap)
    bool     holds_image() const { return std::adjacent_find(pos.begin(), pos.end()) != pos.end(); }
    // the position of cell t of block b (B cells per block)
    llama_pos cell_pos(int32_t b, uint32_t B, uint32_t t) const { return pos.empty() ? b*(llama_pos) B + (llama_pos) t : pos[t]; }
};

// the undo record of a re-selection during generation: a truncation below `pos` (a rejected speculative draft)
// puts every evicted block back into the very cells it held (the same cell order, so attention sums in the same
// order as one-token decoding) and evicts every block staged in, newest first
struct kvmem_journal {
    using block_id = std::pair<llama_seq_id, int32_t>;

    llama_pos    pos    = -1; // tokens at >= pos saw the new working set
    kvmem_reason reason = kvmem_reason::REFRESH;
    uint32_t     stage_hint = 0; // the cell where stage-in searched next before it
    std::map<int32_t, float> picks_before;
    std::vector<std::pair<block_id, std::vector<uint32_t>>> evicted; // in eviction order, with their cells
    std::vector<block_id> staged;                                    // in stage-in order
};

// what undoing a journal does to the working set, as callbacks (the cache: cells and copies; tests: a model)
struct kvmem_undo_ops {
    std::function<bool(llama_seq_id, int32_t)> is_back;  // the block is resident (or gone: nothing to undo)
    std::function<bool(llama_seq_id, int32_t)> is_staged; // the block is resident and may be evicted again
    std::function<void(llama_seq_id, int32_t)> evict;
    std::function<bool(llama_seq_id, int32_t, const std::vector<uint32_t> &)> stage_at; // into exactly these cells
    std::function<bool(llama_seq_id, int32_t)> stage_any;                              // anywhere free
};

// undo one journal: the blocks it staged in leave (newest first), then the blocks it evicted come back into the
// cells they held (newest first, so each finds its cells free); returns (blocks back in, blocks out)
std::pair<uint32_t, uint32_t> kvmem_undo(const kvmem_journal & journal, const kvmem_undo_ops & ops);

// a prompt token kept to recompute a turn's query span: positions (M-RoPE: 4) and id
struct kvmem_prompt_token {
    std::array<llama_pos, 4> pos;
    llama_token id;
};

// what scoring knows of a sequence: block summaries, recent key and query rows, token ids per block
struct kvmem_seq_rows {
    // by block index (the scorer's layout): every block's on the host scorer; with a summary store only those of
    // blocks not in the host pool yet (a 27B model's summaries are 1 MiB per block: 2 GiB at 256K)
    std::map<int32_t, std::vector<float>> summary;
    // a block cut by a truncation deep in the history (its older key rows are gone): its old summary and how
    // many leading tokens are unchanged, to rebuild the summary when the block completes again
    std::map<int32_t, std::pair<std::vector<float>, uint32_t>> stale;
    std::map<llama_pos, std::vector<float>> key;       // key rows of the two newest blocks (rebuild after a cut)
    // the newest tokens' query rows: here on the host scorer, empty where they live on the scoring backend
    // (kvmem_query_store; the keys still say which positions have rows)
    std::map<llama_pos, std::vector<float>> query;
    std::map<int32_t, std::vector<llama_token>> tokens; // token ids by block (-1: unknown), for lexical picks
};

// the turn being answered: where its question is and what it asks
struct kvmem_turn {
    llama_pos pos = -1;          // end of the prompt (position of the first generated token)
    llama_pos q0  = -1, q1 = -1; // the question span [q0, q1)
    std::vector<float> q;        // the question's query rows on the host scorer (the graph scorer's are on its backend)
    uint32_t n_q = 0;            // how many rows the question has
    std::vector<std::pair<llama_token, float>> tokens; // the question's tokens, weighted toward its end
};

class kvmem_seq {
public:
    std::map<int32_t, kvmem_block> blocks; // completed blocks in the host pool, by block index
    int32_t next_host = 0;                 // first block index not yet written through

    kvmem_seq_rows rows;
    kvmem_turn     turn;
    kvmem_lexical_index lexicon; // token ids of the blocks on the host (hybrid's lexical picks)

    std::vector<kvmem_journal> events;  // re-selections since the turn (undoable)
    llama_pos next_event   = -1;        // next re-selection position during generation
    bool      next_is_room = false;
    llama_pos next_prefill = -1;        // next selection inside the prompt (retrieval prefill)

    std::deque<kvmem_prompt_token> tokens;                    // recent prompt tokens (recompute)
    std::deque<kvmem_snapshot> snapshots;                      // recurrent states (hybrid models)

    // one past the last position of embedding input (an image's tokens: no token ids, M-RoPE positions shared by
    // many cells): a turn's query span starts after it, since only token ids can be decoded again
    llama_pos embd_end    = -1;

    llama_pos hint_p0     = -1;    // the application's start of the last user message (one prompt; -1: unknown)
    llama_pos hint_p1     = -1;    // and its end, the prompt's (-1: unknown)
    bool      prompt_mark = false; // the application said a new prompt starts
    bool      released    = false; // the application is done with it for now: others may take its cells
    bool      squeezed    = false; // this prompt lost blocks within its share to another's (logged once)

    uint64_t last_used = 0; // when a batch of it last ran (the least recently used goes to disk first)

    int64_t n_select = 0;
    double  last_ms  = 0.0;

    kvmem_phase phase() const { return phase_; }
    bool active() const { return !released && phase_ != kvmem_phase::IDLE; }

    // what a batch of n tokens (n_out outputs, the last one an output or not) is for this sequence; when the
    // application marks its prompts, an unmarked multi-token batch during generation is not a prompt (e.g. a
    // draft context catching up with the accepted tokens)
    kvmem_batch_kind classify(uint32_t n, uint32_t n_out, bool last_out, bool app_marks_prompts) const;

    // whether the query rows of a ubatch ending at position `last` can be a turn's: always, except inside a prompt
    // whose end the application named (set_hint), for ubatches ending more than `reach` tokens before that end
    // (the turn's query is the prompt's last tokens; a long prompt's early ubatches are not read back)
    bool wants_query_rows(llama_pos last, uint32_t reach) const;

    // what the application says of the prompt about to be decoded: its last user message [p0, p1), or only its end
    // p1 (p0 < 0: a prompt without messages); p1 <= p0 or p1 <= 0 clears
    void set_hint(llama_pos p0, llama_pos p1);

    // transitions
    void start_prompt(bool selects_in_prompt, llama_pos p0); // -> PROMPT; the previous turn's picks become ordinary
    void start_turn(llama_pos pos, llama_pos q0, llama_pos q1); // PROMPT -> GEN
    void resume_gen();                                          // -> GEN without a new prompt
    void cut_prompt();                                          // the prompt itself was truncated: -> IDLE

    // the start of the turn's query for a prompt ending at `end`: its last n_q tokens, from the last user message
    // when the application named it, and after the last image (its embeddings cannot be decoded again)
    llama_pos query_start(llama_pos end, uint32_t n_q) const;

    // the resident blocks and all blocks, each counted by its slots (an image's block weighs more than one)
    uint32_t n_resident() const;
    uint32_t n_slots() const;
    bool     all_resident() const { return n_resident() == n_slots(); }
    int32_t  n_blocks() const { return blocks.empty() ? 0 : blocks.rbegin()->first + 1; }
    // picked = in picks and resident; score = its pick score
    void set_picks(const std::map<int32_t, float> & picks);

private:
    kvmem_phase phase_ = kvmem_phase::IDLE;
};

using kvmem_seqs = std::map<llama_seq_id, kvmem_seq>;
