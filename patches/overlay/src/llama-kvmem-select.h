#pragma once

// KVMem: what a selection makes the working set (kvmem-llama). The plan is a pure function of the sequence's
// state, its share and the scorer (tests/kvmem); llama-kvmem-select.cpp applies it as a diff (resident blocks
// that stay are reused, only changes move) and records the undo journal.

#include "llama-kvmem-residency.h"
#include "llama-kvmem-score.h"
#include "llama-kvmem-seq.h"

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <vector>

struct kvmem_plan {
    std::set<int32_t> target;      // the blocks the sequence holds after the selection
    uint32_t weight = 0;            // their slots (a block of an image weighs more than one)
    std::map<int32_t, float> picks; // the picked ones among them, with the priority they leave by (lowest first)
    uint32_t n_sink = 0, n_question = 0, n_recent = 0, n_rows = 0, n_lexical = 0;
};

// the query rows of a selection: the question's rows (st.turn), then the newest rows (during generation the newest
// generated tokens', inside a prompt (retrieval prefill) the prompt's newest rows alone), by position in
// st.rows.query. Where the rows are is the scorer's business (the host's copies, or kvmem_query_store)
struct kvmem_query {
    uint32_t n_turn = 0;
    std::vector<llama_pos> newest; // oldest first

    uint32_t n_newest() const { return (uint32_t) newest.size(); }
    uint32_t n_rows() const { return n_turn + n_newest(); }
};
kvmem_query kvmem_query_rows(const kvmem_seq & st, uint32_t query_tokens);
// the newest generated tokens' rows a re-selection adds to the question's, and the most rows kvmem_query_rows gives
uint32_t kvmem_newest_query_rows(uint32_t query_tokens);
uint32_t kvmem_max_query_rows(uint32_t query_tokens);
// inside a prompt (retrieval prefill) the newest rows a selection scores with
uint32_t kvmem_prompt_query_rows(uint32_t query_tokens);
// the newest tokens whose query rows a sequence keeps: the query itself, the template tokens after the last user
// message, and the rows of speculative drafts that may still be rejected (rows are dropped by position only, so a
// rejected draft leaves the same rows as one-token decoding would)
uint32_t kvmem_kept_query_rows(uint32_t query_tokens);

// scores of the blocks `ids` (all with summaries; `candidate` marks those that may be picked) for the query rows:
// the host scorer over the host summaries, or the graph scorer over the device's (llama-kvmem-summaries.h)
using kvmem_score_fn = std::function<void(const std::vector<int32_t> & ids, const std::vector<char> & candidate,
        const kvmem_query & q, std::vector<float> & out)>;

// the host scorer over the sequence's host summaries
kvmem_score_fn kvmem_host_scores(const kvmem_seq & st, const kvmem_scorer & scorer);

// sink + question + recent + top-k by score until `share` blocks (one of them the partial tail; a block weighs its
// slots); inside a prompt the picks take at most half of what the sink and the recent window leave. hybrid: every
// other pick is the next block that shares the question's rare words (attention first). Room the ranked blocks
// leave goes to blocks without a summary, newest first. trace: log every pick.
kvmem_plan kvmem_plan_selection(const kvmem_geometry & g, const kvmem_seq & st, uint32_t share, kvmem_reason reason,
        const kvmem_scorer & scorer, const kvmem_score_fn & scores, uint32_t query_tokens, bool trace,
        llama_seq_id seq_id);
