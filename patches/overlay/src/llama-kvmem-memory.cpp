// KVMem: the llama_memory_i side of the tiered cache (kvmem-llama): batches and ubatches, the life of a sequence
// (its batches, the application's hints, the tokens and states kept to recompute a turn), truncation and removal.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-batch.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

static constexpr llama_pos POS_END = std::numeric_limits<llama_pos>::max();

// tokens kept for recomputing a turn's query span, beyond --kvmem-query-tokens
static constexpr uint32_t KVMEM_TOKEN_SLACK = 1024;

//
// batches
//

bool llama_kvmem_split(llama_kvmem_cache * km, llama_batch_allocr & balloc, uint32_t n_ubatch,
        const std::function<llama_ubatch(llama_batch_allocr &, uint32_t)> & split, std::vector<llama_ubatch> & out) {
    uint32_t n_ub = km->max_ubatch(n_ubatch);
    km->fit_ubatch(balloc, n_ub);
    balloc.split_reset();
    out.clear();
    while (true) {
        llama_ubatch ubatch = split(balloc, n_ub);
        if (ubatch.n_tokens == 0) {
            break;
        }
        out.push_back(std::move(ubatch)); // NOLINT
    }
    return balloc.get_n_used() == balloc.get_n_tokens() && km->host_room_for(out.data(), out.size(), true);
}

llama_memory_context_ptr llama_kvmem_cache::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);
    std::vector<llama_ubatch> ubatches;
    const auto split = [](llama_batch_allocr & b, uint32_t n) { return b.split_simple(n); };
    if (!llama_kvmem_split(this, balloc, n_ubatch, split, ubatches)) {
        return std::make_unique<llama_kv_cache_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }
    slot_info_vec_t sinfos(ubatches.size());
    return std::make_unique<llama_kvmem_context>(this, std::move(sinfos), std::move(ubatches));
}

bool llama_kvmem_context::apply() {
    if (kvmem_has_ubatch() && !km->prepare_ubatch(kvmem_ubatch(), kvmem_sinfo())) {
        return false;
    }
    return llama_kv_cache_context::apply();
}

//
// the life of a sequence
//

kvmem_batch_kind llama_kvmem_cache::begin_batch(llama_seq_id seq_id, uint32_t n, uint32_t n_out, bool last_out, llama_pos p0) {
    kvmem_seq & st = open_seq(seq_id);
    st.released = false;
    const kvmem_batch_kind kind = st.classify(n, n_out, last_out, app_marks_prompts);
    if (kind != kvmem_batch_kind::GEN && st.phase() != kvmem_phase::PROMPT) {
        st.start_prompt(kp.prefill == LLAMA_KVMEM_PREFILL_RETRIEVAL && scorer->scores(), p0);
    }
    if (kind == kvmem_batch_kind::GEN && st.phase() != kvmem_phase::GEN) {
        st.resume_gen(); // e.g. generation resumed without a new prompt
    }
    return kind;
}

void llama_kvmem_cache::remember_tokens(llama_seq_id seq_id, const std::vector<kvmem_prompt_token> & toks) {
    kvmem_seq & st = open_seq(seq_id);
    for (const auto & t : toks) {
        while (!st.tokens.empty() && st.tokens.back().pos[0] >= t.pos[0]) {
            st.tokens.pop_back(); // re-decoded positions (a truncation happened)
        }
        st.tokens.push_back(t);
    }
    if (st.tokens.empty()) {
        return;
    }
    llama_pos keep = st.tokens.back().pos[0] - (llama_pos) (kp.query_tokens + KVMEM_TOKEN_SLACK);
    if (!st.snapshots.empty()) {
        keep = std::min(keep, st.snapshots.front().position());
    }
    while (!st.tokens.empty() && st.tokens.front().pos[0] < keep) {
        st.tokens.pop_front();
    }
}

bool llama_kvmem_cache::admit_embeddings(llama_seq_id seq_id, uint32_t n_embd, llama_pos end) {
    kvmem_seq & st = open_seq(seq_id);
    // an image is in the working set whole whenever it is read or retrieved: its block (with up to B-1 cells of
    // text) must fit the sequence's share next to the sink, the recent window and the partial tail
    const uint32_t B = kp.block;
    const uint32_t need = kvmem_div_up(n_embd + B - 1, B) + geom.floor_share() - 1; // blocks of the share
    const uint32_t share = share_blocks(seq_id);
    if (need > share) {
        const uint32_t n_active = std::max<uint32_t>(1, geom.budget_blocks/std::max<uint32_t>(1, share));
        set_last_error(format("an image of %u tokens does not fit the KV tiering working set (--kvmem-budget %u%s): "
                "its tokens are on the GPU together, next to the conversation's sink and recent window, whenever it "
                "is read or retrieved; this needs --kvmem-budget %u or more%s (or a smaller image)", n_embd, kp.budget,
                n_active > 1 ? format(", shared by %u active slots", n_active).c_str() : "", need*n_active*B,
                n_active > 1 ? ", or fewer parallel slots" : ""));
        return false;
    }
    st.embd_end = std::max(st.embd_end, end);
    return true;
}

std::vector<kvmem_prompt_token> llama_kvmem_cache::tokens_from(llama_seq_id seq_id, llama_pos p0) const {
    std::vector<kvmem_prompt_token> out;
    const kvmem_seq * st = find_seq(seq_id);
    if (!st || st->tokens.empty() || st->tokens.front().pos[0] > p0) {
        return out;
    }
    llama_pos expect = p0;
    for (const auto & t : st->tokens) {
        if (t.pos[0] < p0) {
            continue;
        }
        if (t.pos[0] != expect) {
            return {}; // a gap: not recomputable
        }
        out.push_back(t);
        expect++;
    }
    return out;
}

void llama_kvmem_cache::take_snapshot(ggml_backend_sched_t sched, llama_seq_id seq_id, llama_pos pos) {
    GGML_ASSERT(recurrent_mem);
    kvmem_seq & st = open_seq(seq_id);
    drop_snapshots_from(st, pos);
    if (st.snapshots.size() == 2) { // the batch the query span starts in is one of the last two prompt batches
        spare_rooms.push_back(st.snapshots.front().release_room());
        st.snapshots.pop_front();
    }
    kvmem_room room;
    if (!spare_rooms.empty()) {
        room = std::move(spare_rooms.back());
        spare_rooms.pop_back();
    }
    st.snapshots.emplace_back(pos, std::move(room));
    st.snapshots.back().take(sched, *recurrent_mem, seq_id);
}

void llama_kvmem_cache::drop_snapshots_from(kvmem_seq & st, llama_pos pos) {
    while (!st.snapshots.empty() && st.snapshots.back().position() >= pos) {
        spare_rooms.push_back(st.snapshots.back().release_room());
        st.snapshots.pop_back();
    }
}

const kvmem_snapshot * llama_kvmem_cache::snapshot_at(llama_seq_id seq_id, llama_pos pos) const {
    const kvmem_seq * st = find_seq(seq_id);
    if (!st) {
        return nullptr;
    }
    for (auto s = st->snapshots.rbegin(); s != st->snapshots.rend(); ++s) {
        if (s->position() <= pos) {
            return &*s;
        }
    }
    return nullptr;
}

void llama_kvmem_cache::set_query_span(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    kvmem_seq & st = open_seq(seq_id);
    app_marks_prompts = true;
    st.prompt_mark = st.phase() != kvmem_phase::PROMPT; // a call inside a prompt (its next batch) marks nothing new
    st.set_hint(p0, p1);
}

void llama_kvmem_cache::release_seq(llama_seq_id seq_id) {
    if (kvmem_seq * st = find_seq(seq_id)) {
        st->released = true; // its blocks stay (a later prompt may reuse them) but others may take the cells
        publish();
    }
}

void llama_kvmem_cache::turn_query_span(llama_seq_id seq_id, llama_pos end, llama_pos & p0, llama_pos & p1) const {
    // from the last user message to the prompt's end (a tool result after it included), its last query_tokens
    // tokens: a short question after a long history is only the question; without a hint the prompt's end
    const kvmem_seq * st = find_seq(seq_id);
    p0 = p1 = end;
    if (st && end > 0) {
        p0 = st->query_start(end, kp.query_tokens);
    }
}

llama_pos llama_kvmem_cache::hinted_prompt_end(llama_seq_id seq_id) const {
    const kvmem_seq * st = find_seq(seq_id);
    return st ? st->hint_p1 : -1;
}

//
// memory operations
//

void llama_kvmem_cache::drop_host_blocks(llama_seq_id seq_id, int32_t b0) {
    kvmem_seq * st = find_seq(seq_id);
    if (!st) {
        return;
    }
    for (auto it = st->blocks.lower_bound(b0); it != st->blocks.end(); ) {
        release_storage(it->second);
        it = st->blocks.erase(it);
    }
    st->lexicon.remove_from(b0);
    st->next_host = std::min(st->next_host, b0);
}

void llama_kvmem_cache::clear(bool data) {
    llama_kv_cache::clear(data);
    for (auto & [s, st] : seqs) {
        for (auto & [b, hb] : st.blocks) {
            release_storage(hb);
        }
    }
    seqs.clear();
    publish();
}

bool llama_kvmem_cache::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    const bool ok = seq_rm_impl(seq_id, p0 < 0 ? 0 : p0, p1 < 0 ? POS_END : p1);
    publish();
    return ok;
}

void llama_kvmem_cache::bring_back_last(llama_seq_id seq_id, kvmem_seq & st, llama_pos p0) {
    // the last kept position p0-1 must be in the working set, so that the next batch (starting at p0) is
    // consistent with seq_pos_max
    if (p0 <= 0) {
        return;
    }
    const int32_t bl = (p0 - 1)/(int32_t) kp.block;
    const auto it = st.blocks.find(bl);
    if (it != st.blocks.end() && !it->second.resident) {
        const bool staged = !it->second.on_disk && stage_in_making_room(seq_id, bl, it->second, nullptr);
        copier.wait();
        if (!staged) {
            LLAMA_LOG_WARN("%s: kvmem: could not bring back block %d of seq %d\n", __func__, bl, seq_id);
        }
    }
}

bool llama_kvmem_cache::seq_rm_impl(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    const int32_t B = kp.block;
    if (seq_id < 0) {
        bool ok = true;
        std::vector<llama_seq_id> ids;
        for (const auto & [s, st] : seqs) {
            ids.push_back(s);
        }
        for (const auto s : ids) {
            ok = seq_rm_impl(s, p0, p1) && ok;
        }
        return llama_kv_cache::seq_rm(seq_id, p0, p1) && ok;
    }
    kvmem_seq * st = find_seq(seq_id);
    if (!st) {
        return llama_kv_cache::seq_rm(seq_id, p0, p1);
    }
    if (p0 == 0 && p1 == POS_END) {
        const bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1);
        drop_host_blocks(seq_id, 0);
        seqs.erase(seq_id);
        return ok;
    }
    if (p1 != POS_END) {
        // a hole in the middle (not produced by the server with shifting off): drop the touched host blocks
        const bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1);
        forget_from(*st, p0, p1);
        for (int32_t b = p0/B; b <= (p1 - 1)/B; ++b) {
            const auto it = st->blocks.find(b);
            if (it != st->blocks.end()) {
                release_storage(it->second);
                st->blocks.erase(it);
                st->lexicon.remove(b);
            }
        }
        return ok;
    }
    // truncation [p0, inf): re-selections at or after p0 are undone (a rejected draft, or the same request again).
    // The blocks wholly past the cut go first: the undo then finds free the cells they held (a long answer cut off
    // held them), so every block a re-selection evicted goes back into its own cells
    const int32_t b_past = (p0 + B - 1)/B;
    const bool ok_past = llama_kv_cache::seq_rm(seq_id, b_past*B, POS_END);
    drop_host_blocks(seq_id, b_past);
    if (!bring_home(seq_id, { seq_id })) {
        // blocks that stay on disk are out of the working set until the sequence's next batch brings them back (or
        // is refused with the reason)
        LLAMA_LOG_WARN("%s: kvmem: %s\n", __func__, get_last_error().c_str());
    }
    undo_events(seq_id, *st, p0);
    if (st->turn.pos >= 0 && p0 < st->turn.pos) {
        st->cut_prompt(); // the prompt itself is cut: what follows is a new prompt
    }
    bring_back_last(seq_id, *st, p0); // the cut block, whose kept part the next batch follows
    const bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1) && ok_past;
    // the cut block's summary is rebuilt from the kept key rows when the block completes again (its old one is
    // read from the store while the block still holds its slot)
    forget_from(*st, p0, POS_END);
    drop_host_blocks(seq_id, p0/B);
    while (!st->tokens.empty() && st->tokens.back().pos[0] >= p0) {
        st->tokens.pop_back();
    }
    drop_snapshots_from(*st, p0 + 1);
    return ok;
}

void llama_kvmem_cache::cut_for_recompute(llama_seq_id seq_id, llama_pos p0) {
    kvmem_seq * st = find_seq(seq_id);
    GGML_ASSERT(st && p0 >= 0);
    bring_back_last(seq_id, *st, p0);
    llama_kv_cache::seq_rm(seq_id, p0, POS_END);
    forget_from(*st, p0, POS_END, /*keep_summaries*/ true);
    drop_host_blocks(seq_id, p0/(int32_t) kp.block);
    publish();
}

void llama_kvmem_cache::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    // only the working set is shared; the host pool stays per sequence
    llama_kv_cache::seq_cp(seq_id_src, seq_id_dst, p0, p1);
}

void llama_kvmem_cache::seq_keep(llama_seq_id seq_id) {
    llama_kv_cache::seq_keep(seq_id);
    for (auto it = seqs.begin(); it != seqs.end(); ) {
        if (it->first != seq_id) {
            drop_host_blocks(it->first, 0);
            it = seqs.erase(it);
        } else {
            ++it;
        }
    }
    publish();
}
