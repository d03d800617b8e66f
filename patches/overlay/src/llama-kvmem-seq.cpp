// KVMem: the state of one tiered sequence and its phase machine (kvmem-llama). See llama-kvmem-seq.h.

#include "llama-kvmem-seq.h"

#include "ggml.h"

#include <algorithm>

const char * kvmem_reason_name(kvmem_reason reason) {
    switch (reason) {
        case kvmem_reason::TURN:    return "turn";
        case kvmem_reason::REFRESH: return "refresh";
        case kvmem_reason::ROOM:    return "room";
        case kvmem_reason::PREFILL: return "prefill";
    }
    return "?";
}

kvmem_batch_kind kvmem_seq::classify(uint32_t n, uint32_t n_out, bool last_out, bool app_marks_prompts) const {
    kvmem_batch_kind kind = kvmem_batch_kind::GEN;
    if (n_out == 0) {
        kind = kvmem_batch_kind::PROMPT;
    } else if (n_out == 1 && last_out && (n >= 2 || phase_ == kvmem_phase::PROMPT)) {
        kind = kvmem_batch_kind::TURN; // a prompt's end, however few tokens its last batch has
    }
    if (kind != kvmem_batch_kind::GEN && phase_ != kvmem_phase::PROMPT && app_marks_prompts && !prompt_mark) {
        kind = kvmem_batch_kind::GEN;
    }
    return kind;
}

void kvmem_seq::start_prompt(bool selects_in_prompt, llama_pos p0) {
    GGML_ASSERT(phase_ != kvmem_phase::PROMPT);
    // the finished turn's picks are ordinary blocks now (evicted oldest first by this prompt)
    for (auto & [b, hb] : blocks) {
        hb.picked = false;
        hb.score  = 0.0f;
    }
    events.clear();
    next_event   = -1;
    next_is_room = false;
    next_prefill = selects_in_prompt ? p0 : -1; // the first prompt batch already selects with the rows there are
    turn.q0 = turn.q1 = -1;
    turn.q.clear();
    turn.n_q = 0;
    turn.tokens.clear();
    squeezed    = false;
    prompt_mark = false;
    phase_      = kvmem_phase::PROMPT;
}

void kvmem_seq::start_turn(llama_pos pos, llama_pos q0, llama_pos q1) {
    GGML_ASSERT(phase_ == kvmem_phase::PROMPT && "a turn ends a prompt");
    GGML_ASSERT(q0 <= q1 && q1 <= pos);
    turn.pos = pos;
    turn.q0  = q0;
    turn.q1  = q1;
    hint_p0  = -1; // a hint is for one prompt
    hint_p1  = -1;
    events.clear();
    phase_ = kvmem_phase::GEN;
}

void kvmem_seq::set_hint(llama_pos p0, llama_pos p1) {
    hint_p1 = p1 > 0 && p1 > p0 ? p1 : -1;
    hint_p0 = hint_p1 >= 0 && p0 >= 0 ? p0 : -1;
}

bool kvmem_seq::wants_query_rows(llama_pos last, uint32_t reach) const {
    return phase_ != kvmem_phase::PROMPT || hint_p1 < 0 || last + (llama_pos) reach >= hint_p1;
}

void kvmem_seq::resume_gen() {
    phase_ = kvmem_phase::GEN;
}

void kvmem_seq::cut_prompt() {
    turn.pos = -1;
    phase_   = kvmem_phase::IDLE;
}

llama_pos kvmem_seq::query_start(llama_pos end, uint32_t n_q) const {
    const llama_pos last = std::max<llama_pos>(0, end - (llama_pos) n_q);
    llama_pos p0 = hint_p0 >= 0 && hint_p0 < end ? std::max(hint_p0, last) : last;
    if (embd_end > p0) {
        p0 = std::min(embd_end, end); // a prompt that ends with an image has no query to recompute
    }
    return p0;
}

uint32_t kvmem_seq::n_resident() const {
    uint32_t n = 0;
    for (const auto & [b, hb] : blocks) {
        n += hb.resident ? hb.n_slots() : 0;
    }
    return n;
}

uint32_t kvmem_seq::n_slots() const {
    uint32_t n = 0;
    for (const auto & [b, hb] : blocks) {
        n += hb.n_slots();
    }
    return n;
}

void kvmem_seq::set_picks(const std::map<int32_t, float> & picks) {
    for (auto & [b, hb] : blocks) {
        const auto p = picks.find(b);
        hb.picked = p != picks.end() && hb.resident;
        hb.score  = hb.picked ? p->second : 0.0f;
    }
}

std::pair<uint32_t, uint32_t> kvmem_undo(const kvmem_journal & journal, const kvmem_undo_ops & ops) {
    uint32_t back_in = 0, back_out = 0;
    for (auto it = journal.staged.rbegin(); it != journal.staged.rend(); ++it) {
        if (ops.is_staged(it->first, it->second)) {
            ops.evict(it->first, it->second);
            back_out++;
        }
    }
    for (auto it = journal.evicted.rbegin(); it != journal.evicted.rend(); ++it) {
        const auto [s, b] = it->first;
        if (ops.is_back(s, b)) {
            continue; // dropped by the truncation itself, or already back
        }
        if (ops.stage_at(s, b, it->second) || ops.stage_any(s, b)) {
            back_in++;
        }
    }
    return { back_in, back_out };
}
