// KVMem: the decode driver (kvmem-llama). llama_context::decode plans a caller's batch for the tiered cache, then
// runs it: the batch is decoded in segments cut where a selection must run (exact positions during generation,
// retrieval prefill inside prompts), where a hybrid model needs a recurrent snapshot, or where a prompt ends in a
// multi-sequence batch; after the batch each turn selects and its query span is recomputed so that it (and the
// turn's first token) sees the picks. See llama-kvmem.h.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-context.h"

#include <algorithm>
#include <limits>
#include <map>

namespace {

enum class kvmem_cut_kind : uint8_t {
    SEGMENT,  // a segment boundary only (a prompt that ends mid-batch, parallel slots)
    SELECT,   // a selection runs here (refresh / room during generation, prefill inside a prompt)
    SNAPSHOT, // hybrid models: the recurrent state at the turn's query span
};

struct kvmem_cut {
    size_t at;
    kvmem_cut_kind kind;
    kvmem_reason reason;
};

// what the batch is for one sequence
struct kvmem_part {
    uint32_t n = 0, n_out = 0;
    uint32_t n_embd = 0;           // embedding inputs (an image's tokens)
    llama_pos embd_end = -1;       // one past their last position
    size_t first = SIZE_MAX, last = 0;
    llama_pos p0 = std::numeric_limits<llama_pos>::max();
    kvmem_batch_kind kind = kvmem_batch_kind::GEN;
};

enum class kvmem_plan_status : uint8_t { OK, UNTRACKED, REFUSED };

class kvmem_decoder {
public:
    kvmem_decoder(llama_context & ctx, ggml_backend_sched_t sched, llama_kvmem_cache & km, const llama_batch_ext & batch,
            bool one_pass) :
        ctx(ctx), sched(sched), km(km), batch(batch), n(batch.tokens.size()), one_pass(one_pass), acc(batch.tokens.size()) {}

    int run();

private:
    llama_context & ctx;
    ggml_backend_sched_t sched; // the recurrent snapshots' copies go on its backends' streams
    llama_kvmem_cache & km;
    const llama_batch_ext & batch;
    const size_t n;
    // backend samplers keep their own per-output state: such batches are decoded in one pass (a turn's first
    // token then does not see the blocks its selection staged in; the next token does)
    const bool one_pass;

    std::map<llama_seq_id, kvmem_part> parts;
    llama_seq_id single = -1; // the batch's only sequence, -1 = several
    bool hybrid = false;      // a recurrent state to snapshot (and a selection that may stage)
    std::vector<kvmem_cut> cuts;

    kvmem_assembled_outputs acc;
    size_t start = 0; // first token not decoded yet

    // where a turn's time goes (the TURN line): the host's own waits, not the device's queued work
    struct {
        int64_t t0 = 0, snapshot_us = 0, restore_us = 0, recompute_us = 0;
        uint32_t segments = 0, snapshots = 0, turns = 0;
        size_t recompute_tokens = 0;
    } clock;
    void take_snapshot(llama_seq_id s, llama_pos pos);
    void log_turn() const;

    kvmem_plan_status plan_parts();
    void begin_parts();
    void plan_single_cuts();
    void plan_multi_cuts();
    int  run_segment(size_t end);
    int  run_cuts();
    int  run_gen_events();
    void select_multi_events();
    int  recompute_turns();
    int64_t batch_index(llama_seq_id s, llama_pos pos) const;
};

kvmem_plan_status kvmem_decoder::plan_parts() {
    for (size_t i = 0; i < n; ++i) {
        const auto & tok = batch.tokens[i];
        if (tok.seq_ids.size() != 1) {
            return kvmem_plan_status::UNTRACKED; // tokens shared by several sequences: no turn bookkeeping
        }
        auto & p = parts[*tok.seq_ids.begin()];
        if (tok.has_embd) {
            p.n_embd++;
            p.embd_end = std::max(p.embd_end, tok.pos[0] + 1);
        }
        p.n++;
        p.n_out += tok.output ? 1 : 0;
        p.first = std::min(p.first, i);
        p.last = i;
        p.p0 = std::min(p.p0, tok.pos[0]);
    }
    single = parts.size() == 1 ? parts.begin()->first : -1;
    for (const auto & [s, p] : parts) {
        if (p.n_embd > 0 && !km.admit_embeddings(s, p.n_embd, p.embd_end)) {
            LLAMA_LOG_ERROR("%s: %s\n", __func__, km.get_last_error().c_str());
            return kvmem_plan_status::REFUSED;
        }
    }
    return kvmem_plan_status::OK;
}

void kvmem_decoder::begin_parts() {
    for (auto & [s, p] : parts) {
        p.kind = km.begin_batch(s, p.n, p.n_out, batch.tokens[p.last].output, p.p0);
        if (p.kind == kvmem_batch_kind::GEN) {
            continue;
        }
        std::vector<kvmem_prompt_token> toks;
        for (const auto & tok : batch.tokens) {
            if (*tok.seq_ids.begin() == s && !tok.has_embd) { // embeddings are not decoded again (turn_query_span)
                toks.push_back({ { tok.pos[0], tok.pos[1], tok.pos[2], tok.pos[3] }, tok.id });
            }
        }
        km.remember_tokens(s, toks);
        // hybrid models: the recurrent state before this prompt batch, so that the turn's query span can be
        // recomputed after the selection
        if (hybrid && !one_pass) {
            take_snapshot(s, p.p0);
        }
    }
}

void kvmem_decoder::plan_single_cuts() {
    // at the exact positions of re-selections during generation (refresh, room) and inside prompts (retrieval
    // prefill), and for hybrid models at the turn's query span (a recurrent snapshot there avoids recomputing
    // the whole batch); a generation batch that crosses further re-selections is cut in run_gen_events()
    const kvmem_part & p = parts.begin()->second;
    const bool gen = p.kind == kvmem_batch_kind::GEN;
    llama_pos next = gen ? km.event_pos(single) : km.prefill_pos(single);
    const kvmem_reason reason = gen ? km.event_reason(single) : kvmem_reason::PREFILL;
    llama_pos q0 = -1, q1 = -1;
    const llama_pos end = batch.tokens[p.last].pos[0] + 1;
    if (hybrid && p.kind == kvmem_batch_kind::TURN) {
        km.turn_query_span(single, end, q0, q1); // the prompt ends with this batch
    } else if (hybrid && p.kind == kvmem_batch_kind::PROMPT) {
        // the prompt may end a few tokens after this batch (llama-server decodes a hybrid model's last 4 prompt
        // tokens on their own, for its checkpoint), and then its question starts in this batch: a snapshot where it
        // would start keeps the turn's recompute to the question instead of this whole batch
        km.turn_query_span(single, std::max(end, km.hinted_prompt_end(single)), q0, q1);
    }
    for (size_t i = 0; i < n; ++i) {
        const llama_pos pos = batch.tokens[i].pos[0];
        if (next >= 0 && pos >= next) {
            cuts.push_back({ i, kvmem_cut_kind::SELECT, reason });
            next = gen ? -1 : pos + km.prefill_step();
        }
        if (q0 > p.p0 && pos == q0) {
            cuts.push_back({ i, kvmem_cut_kind::SNAPSHOT, reason });
        }
    }
}

void kvmem_decoder::plan_multi_cuts() {
    // parallel slots: the query rows of a ubatch are those of its last tokens, so a prompt that ends in the
    // middle of a batch (another slot's tokens follow) is decoded as a segment of its own; otherwise its turn
    // would be scored without its question
    for (const auto & [s, p] : parts) {
        if (p.kind != kvmem_batch_kind::TURN) {
            continue;
        }
        bool contiguous = true;
        for (size_t i = p.first; i <= p.last && contiguous; ++i) {
            contiguous = *batch.tokens[i].seq_ids.begin() == s;
        }
        if (contiguous && p.first > 0) {
            cuts.push_back({ p.first, kvmem_cut_kind::SEGMENT, kvmem_reason::TURN });
        }
        if (p.last + 1 < n) {
            cuts.push_back({ p.last + 1, kvmem_cut_kind::SEGMENT, kvmem_reason::TURN });
        }
    }
    std::sort(cuts.begin(), cuts.end(), [](const kvmem_cut & a, const kvmem_cut & b) { return a.at < b.at; });
}

int kvmem_decoder::run_segment(size_t end) {
    if (end <= start) {
        return 0;
    }
    const bool whole = start == 0 && end == n;
    llama_batch_ext seg = batch;
    if (!whole) {
        seg.tokens.assign(batch.tokens.begin() + start, batch.tokens.begin() + end);
    }
    const int64_t t0 = ggml_time_us();
    const int ret = ctx.decode_impl(seg);
    km.note_decode_pass(ggml_time_us() - t0);
    clock.segments++;
    if (ret == 0 && (!whole || !cuts.empty())) {
        std::vector<int64_t> index(end - start);
        for (size_t j = 0; j < index.size(); ++j) {
            index[j] = (int64_t) (start + j);
        }
        ctx.kvmem_collect_outputs(index, acc);
    }
    start = end;
    return ret;
}

int kvmem_decoder::run_cuts() {
    for (const auto & c : cuts) {
        const int ret = run_segment(c.at);
        if (ret != 0) {
            return ret;
        }
        switch (c.kind) {
            case kvmem_cut_kind::SEGMENT:  break;
            case kvmem_cut_kind::SNAPSHOT: take_snapshot(single, batch.tokens[c.at].pos[0]); break;
            case kvmem_cut_kind::SELECT:   km.select(single, c.reason); break;
        }
    }
    return 0;
}

int kvmem_decoder::run_gen_events() {
    // generation: a batch that crosses a second re-selection is cut there too
    while (single >= 0 && !one_pass && parts.begin()->second.kind == kvmem_batch_kind::GEN) {
        const llama_pos next = km.event_pos(single);
        size_t j = start;
        while (j < n && (next < 0 || batch.tokens[j].pos[0] < next)) {
            j++;
        }
        if (j >= n || next < 0) {
            break;
        }
        const int ret = run_segment(j);
        if (ret != 0) {
            return ret;
        }
        km.select(single, km.event_reason(single));
    }
    return 0;
}

void kvmem_decoder::select_multi_events() {
    // multi-sequence batches: re-selections of the sequences whose next position reached theirs (not exact:
    // parallel slots are not speculative)
    if (single >= 0) {
        return;
    }
    for (const auto & [s, p] : parts) {
        const llama_pos r = km.event_pos(s);
        if (p.kind == kvmem_batch_kind::GEN && r >= 0 && batch.tokens[p.last].pos[0] + 1 >= r) {
            km.select(s, km.event_reason(s));
        }
    }
}

int64_t kvmem_decoder::batch_index(llama_seq_id s, llama_pos pos) const {
    for (size_t i = 0; i < n; ++i) {
        if (*batch.tokens[i].seq_ids.begin() == s && batch.tokens[i].pos[0] == pos) {
            return (int64_t) i;
        }
    }
    return -1; // a token of an earlier batch
}

int kvmem_decoder::recompute_turns() {
    // turns: select, then recompute the query span so that it (and the first token's logits) see the picks
    std::map<llama_seq_id, llama_pos> redo;
    for (const auto & [s, p] : parts) {
        if (p.kind != kvmem_batch_kind::TURN) {
            continue;
        }
        const kvmem_selected done = km.select(s, kvmem_reason::TURN);
        if (done == kvmem_selected::NOTHING) {
            continue;
        }
        clock.turns++; // a scored turn has its TURN line, also when the working set already held its picks
        if (one_pass || done == kvmem_selected::KEPT) {
            continue;
        }
        llama_pos q0 = -1, q1 = -1;
        km.turn_query_span(s, batch.tokens[p.last].pos[0] + 1, q0, q1);
        llama_pos from = q0;
        if (km.recurrent()) {
            // from the state before the question, else before this batch (a prompt decoded before, sent again: its
            // last tokens are this batch, the rest of the question was read with the whole history resident)
            const kvmem_snapshot * snap = km.snapshot_at(s, q0);
            snap = snap ? snap : km.snapshot_at(s, p.p0);
            if (!snap) {
                continue; // no recurrent state to recompute from: the selection applies from the next token
            }
            from = snap->position();
        }
        if (!km.tokens_from(s, from).empty()) {
            redo[s] = from;
        }
    }
    if (redo.empty()) {
        return 0;
    }
    if (!acc.any) {
        std::vector<int64_t> index(n);
        for (size_t j = 0; j < n; ++j) {
            index[j] = (int64_t) j;
        }
        ctx.kvmem_collect_outputs(index, acc);
    }
    llama_batch_ext tail = batch;
    tail.tokens.clear();
    std::vector<int64_t> index;
    for (const auto & [s, from] : redo) {
        const auto toks = km.tokens_from(s, from);
        if (km.recurrent()) {
            const int64_t t0 = ggml_time_us();
            km.snapshot_at(s, from)->restore(sched, *km.recurrent(), s);
            clock.restore_us += ggml_time_us() - t0;
        }
        km.cut_for_recompute(s, from); // the attention cache only: the recurrent state was put back above
        for (size_t k = 0; k < toks.size(); ++k) {
            llama_batch_ext::token t = batch.tokens[parts.at(s).last];
            t.id = toks[k].id;
            for (size_t c = 0; c < t.pos.size(); ++c) {
                t.pos[c] = toks[k].pos[c];
            }
            t.output = k + 1 == toks.size();
            tail.tokens.push_back(t);
            index.push_back(batch_index(s, toks[k].pos[0]));
        }
        if (km.params().trace) {
            LLAMA_LOG_WARN("kvmem_trace: recompute seq=%d from=%d\n", s, from);
        }
    }
    const int64_t t0 = ggml_time_us();
    const int ret = ctx.decode_impl(tail);
    km.note_decode_pass(ggml_time_us() - t0);
    if (ret == 0) {
        ctx.kvmem_collect_outputs(index, acc);
    }
    clock.recompute_us += ggml_time_us() - t0;
    clock.recompute_tokens += tail.tokens.size();
    return ret;
}

void kvmem_decoder::take_snapshot(llama_seq_id s, llama_pos pos) {
    const int64_t t0 = ggml_time_us();
    km.take_snapshot(sched, s, pos);
    clock.snapshot_us += ggml_time_us() - t0;
    clock.snapshots++;
}

void kvmem_decoder::log_turn() const {
    if (clock.turns == 0) {
        return; // no turn selected in this batch (a warm-up, or tiering has nothing to do)
    }
    // the whole batch of a turn (its prompt's last batch: what the first token waits for), next to its SELECT line
    LLAMA_LOG_WARN("kvmem_score: TURN seq=%d tokens=%zu segments=%u snapshots=%u snapshot_ms=%.3f restore_ms=%.3f "
            "recompute_tokens=%zu recompute_ms=%.3f ms=%.3f\n", single, n, clock.segments, clock.snapshots,
            clock.snapshot_us/1e3, clock.restore_us/1e3, clock.recompute_tokens, clock.recompute_us/1e3,
            (ggml_time_us() - clock.t0)/1e3);
}

int kvmem_decoder::run() {
    clock.t0 = ggml_time_us();
    switch (plan_parts()) {
        case kvmem_plan_status::REFUSED:   return -1;
        case kvmem_plan_status::UNTRACKED: return ctx.decode_impl(batch);
        case kvmem_plan_status::OK:        break;
    }
    hybrid = km.recurrent() != nullptr && km.may_stage((uint32_t) n);
    begin_parts();
    // an image's embeddings go in whole: no selection inside them (its cells stay together in the working set)
    const bool embd = std::any_of(parts.begin(), parts.end(), [](const auto & sp) { return sp.second.n_embd > 0; });
    if (!one_pass && !embd && single >= 0) {
        plan_single_cuts();
    } else if (!one_pass && !embd && km.may_stage((uint32_t) n)) {
        plan_multi_cuts();
    }
    int ret = run_cuts();
    ret = ret != 0 ? ret : run_gen_events();
    ret = ret != 0 ? ret : run_segment(n);
    if (ret != 0) {
        return ret;
    }
    select_multi_events();
    ret = recompute_turns();
    if (ret != 0) {
        return ret;
    }
    log_turn();
    return acc.any ? (ctx.kvmem_restore_outputs(batch, acc) ? 0 : -2) : 0;
}

} // namespace

int llama_context::decode(const llama_batch_ext & batch) {
    auto * km = llama_kvmem_cache::from(memory.get());
    if (!km) {
        return decode_impl(batch);
    }
    km->set_last_error("");
    if (km->is_follower()) {
        // before: drop what the target dropped (room for the batch); after: take the new blocks in line
        km->follow_leader();
        const int ret = decode_impl(batch);
        km->follow_leader();
        return ret;
    }
    if (batch.tokens.empty()) {
        return decode_impl(batch);
    }
    return kvmem_decoder(*this, sched.get(), *km, batch, /*one_pass*/ !sampling.samplers.empty()).run();
}

void llama_context::kvmem_after_ubatch(const llm_graph_result * res, const llama_ubatch & ubatch) {
    if (auto * km = llama_kvmem_cache::from(memory.get())) {
        km->after_ubatch(sched.get(), res, ubatch);
    }
}
