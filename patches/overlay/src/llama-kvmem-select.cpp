// KVMem: selections (kvmem-llama): the plan, applying it with its undo journal, undoing it, and when the next
// one runs. See llama-kvmem-select.h and invariant 2 of llama-kvmem.h.

#include "llama-kvmem.h"
#include "llama-kvmem-select.h"

#include "llama-impl.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

// hybrid picks: a question token's weight halves every this many tokens before the question's end (measured
// offline on 30 samples each of niah_single_essay/multikey/followup at 7.8K tokens, SmolLM2 tokenizer, 128-token
// query span: the needle block stands out and ranks first in 26, 30, 28 with 16; 11, 10, 17 unweighted)
static constexpr float KVMEM_LEX_HALF = 16.0f;

// query rows kept beyond the query itself (kvmem_kept_query_rows)
static constexpr uint32_t KVMEM_ROW_SLACK = 256;

static constexpr llama_pos POS_END = std::numeric_limits<llama_pos>::max();

//
// the plan (pure)
//

uint32_t kvmem_newest_query_rows(uint32_t query_tokens) {
    return std::max<uint32_t>(1, query_tokens/2);
}

uint32_t kvmem_max_query_rows(uint32_t query_tokens) {
    return query_tokens + kvmem_newest_query_rows(query_tokens);
}

uint32_t kvmem_prompt_query_rows(uint32_t query_tokens) {
    return std::min<uint32_t>(query_tokens, 64);
}

uint32_t kvmem_kept_query_rows(uint32_t query_tokens) {
    return query_tokens + KVMEM_ROW_SLACK + 1;
}

kvmem_query kvmem_query_rows(const kvmem_seq & st, uint32_t query_tokens) {
    kvmem_query q;
    // the newest rows (of positions >= from), at most `want`, oldest first
    auto add_newest = [&](uint32_t want, llama_pos from) {
        for (auto it = st.rows.query.rbegin(); it != st.rows.query.rend() && it->first >= from && q.newest.size() < want; ++it) {
            q.newest.push_back(it->first);
        }
        std::reverse(q.newest.begin(), q.newest.end());
    };
    if (st.phase() == kvmem_phase::PROMPT && st.turn.q0 < 0) {
        add_newest(kvmem_prompt_query_rows(query_tokens), 0); // inside a prompt (retrieval prefill)
        return q;
    }
    q.n_turn = st.turn.n_q;
    if (st.phase() == kvmem_phase::GEN && st.turn.pos >= 0) {
        add_newest(kvmem_newest_query_rows(query_tokens), st.turn.pos);
    }
    return q;
}

// b joins the target if its slots fit under `cap` (false: it is in already, or does not fit)
static bool kvmem_plan_add(const kvmem_seq & st, int32_t b, size_t cap, kvmem_plan & plan) {
    const uint32_t w = st.blocks.at(b).n_slots();
    if (plan.target.count(b) || plan.weight + w > cap) {
        return false;
    }
    plan.target.insert(b);
    plan.weight += w;
    return true;
}

// the blocks every selection keeps: the sink, the question (newest blocks of it first), the recent window
static void kvmem_plan_fixed(const kvmem_geometry & g, const kvmem_seq & st, uint32_t avail, kvmem_plan & plan) {
    const int32_t B = g.block;
    for (const auto & [b, hb] : st.blocks) {
        if ((uint32_t) b < g.sink_blocks && kvmem_plan_add(st, b, avail, plan)) {
            plan.n_sink++;
        }
    }
    if (st.turn.q0 >= 0) {
        for (int32_t b = (st.turn.q1 - 1)/B; b >= st.turn.q0/B; --b) {
            if (st.blocks.count(b) && kvmem_plan_add(st, b, avail, plan)) {
                plan.n_question++;
            }
        }
    }
    // the newest blocks (those the question already covers count: the window does not grow past them)
    for (auto it = st.blocks.rbegin(); it != st.blocks.rend() && plan.n_recent < g.recent_blocks && plan.weight < avail; ++it) {
        kvmem_plan_add(st, it->first, avail, plan);
        plan.n_recent++;
    }
}

kvmem_score_fn kvmem_host_scores(const kvmem_seq & st, const kvmem_scorer & scorer) {
    return [&st, &scorer](const std::vector<int32_t> & ids, const std::vector<char> & candidate, const kvmem_query & q,
            std::vector<float> & out) {
        std::vector<const float *> sums;
        for (const int32_t b : ids) {
            sums.push_back(st.rows.summary.at(b).data());
        }
        GGML_ASSERT(st.turn.q.size() == (size_t) q.n_turn*scorer.dims().query_row() && "the question's rows are on the host");
        std::vector<float> rows(st.turn.q);
        for (const llama_pos p : q.newest) {
            const std::vector<float> & r = st.rows.query.at(p);
            GGML_ASSERT(r.size() == scorer.dims().query_row() && "a query row is [layer][head][head_dim]");
            rows.insert(rows.end(), r.begin(), r.end());
        }
        scorer.score(sums, candidate, rows.data(), q.n_rows(), out);
    };
}

// the other blocks by attention score, best first; recency (newest first) when there is nothing to score with
static std::vector<std::pair<float, int32_t>> kvmem_rank_blocks(const kvmem_seq & st, const kvmem_scorer & scorer,
        const kvmem_score_fn & score_fn, const kvmem_query & q, const std::set<int32_t> & target) {
    std::vector<std::pair<float, int32_t>> ranked;
    if (scorer.scores() && q.n_rows() > 0) {
        // every block with a summary is scored (the sink and the recent window take their share of the query's
        // attention); those outside the target are ranked
        std::vector<int32_t> ids;
        std::vector<char> cand;
        for (const auto & [b, hb] : st.blocks) {
            if (hb.summarized || st.rows.summary.count(b)) {
                ids.push_back(b);
                cand.push_back(!target.count(b));
            }
        }
        std::vector<float> scores;
        if (!ids.empty()) {
            score_fn(ids, cand, q, scores);
        }
        for (size_t i = 0; i < ids.size(); ++i) {
            if (cand[i]) {
                ranked.push_back({ scores[i], ids[i] });
            }
        }
        std::stable_sort(ranked.begin(), ranked.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    }
    if (ranked.empty()) {
        for (auto it = st.blocks.rbegin(); it != st.blocks.rend(); ++it) {
            if (!target.count(it->first)) {
                ranked.push_back({ 0.0f, it->first });
            }
        }
    }
    return ranked;
}

// the orders a selection picks from (blocks outside the sink, question and recent window, best first): why a block
// was or was not picked, for the eval's answer-block rank (kvmem_llama/evaluation/records.py)
static void kvmem_trace_ranked(llama_seq_id seq_id, kvmem_reason reason, const std::vector<std::pair<float, int32_t>> & ranked,
        const std::vector<std::pair<float, int32_t>> & lex) {
    auto list = [](const std::vector<std::pair<float, int32_t>> & order) {
        std::string out;
        for (const auto & [score, b] : order) {
            out += (out.empty() ? "" : ",") + std::to_string(b);
        }
        return out;
    };
    LLAMA_LOG_WARN("kvmem_trace: ranked seq=%d reason=%s attention=%s lexical=%s\n", seq_id, kvmem_reason_name(reason),
            list(ranked).c_str(), list(lex).c_str());
}

kvmem_plan kvmem_plan_selection(const kvmem_geometry & g, const kvmem_seq & st, uint32_t share, kvmem_reason reason,
        const kvmem_scorer & scorer, const kvmem_score_fn & score_fn, uint32_t query_tokens, bool trace,
        llama_seq_id seq_id) {
    GGML_ASSERT(share >= 2);
    const uint32_t avail = share - 1; // one block of the share is the partial tail
    kvmem_plan plan;
    kvmem_plan_fixed(g, st, avail, plan);

    const kvmem_query q = kvmem_query_rows(st, query_tokens);
    plan.n_rows = q.n_rows();
    const auto ranked = kvmem_rank_blocks(st, scorer, score_fn, q, plan.target);
    std::vector<std::pair<float, int32_t>> lex;
    if (scorer.lexical() && plan.n_rows > 0 && !st.turn.tokens.empty()) {
        lex = st.lexicon.rank(st.turn.tokens, plan.target);
    }
    if (trace) {
        kvmem_trace_ranked(seq_id, reason, ranked, lex);
    }
    // inside a prompt (retrieval prefill) the picks take at most half: the newest blocks are the other half
    const size_t n_fixed = plan.weight;
    const size_t cap = reason == kvmem_reason::PREFILL ? n_fixed + (avail - std::min<size_t>(avail, n_fixed))/2 : avail;
    std::map<int32_t, float> att;
    for (const auto & [score, b] : ranked) {
        att[b] = score;
    }
    size_t ia = 0, il = 0, n_order = 0;
    bool lex_turn = false;
    while (plan.weight < cap && (ia < ranked.size() || il < lex.size())) {
        const bool from_lex = il < lex.size() && (lex_turn || ia >= ranked.size());
        const int32_t b = from_lex ? lex[il++].second : ranked[ia++].second;
        if (!kvmem_plan_add(st, b, cap, plan)) {
            continue;
        }
        lex_turn = !from_lex;
        plan.n_lexical += from_lex ? 1 : 0;
        if (!scorer.scores() || plan.n_rows == 0) {
            continue; // recency: the extended window has no picks
        }
        // picks leave lowest first under pressure: attention score, or for hybrid the merged order
        plan.picks[b] = scorer.lexical() ? (float) (ranked.size() + lex.size() - n_order++) : att[b];
        if (trace) {
            LLAMA_LOG_WARN("kvmem_trace: pick seq=%d block=%d score=%.4f lexical=%d\n", seq_id, b,
                    att.count(b) ? att[b] : 0.0f, (int) from_lex);
        }
    }
    // blocks nobody could rank (no summary: their keys were not all captured) take the room that is left; inside a
    // prompt that room is the prompt's own
    for (auto it = st.blocks.rbegin(); reason != kvmem_reason::PREFILL && it != st.blocks.rend() && plan.weight < cap; ++it) {
        kvmem_plan_add(st, it->first, cap, plan);
    }
    return plan;
}

//
// the cache: running a selection
//

kvmem_score_fn llama_kvmem_cache::score_fn(llama_seq_id seq_id, const kvmem_seq & st) {
    if (!graph_scorer) {
        return kvmem_host_scores(st, *scorer);
    }
    return [this, seq_id, &st](const std::vector<int32_t> & ids, const std::vector<char> &, const kvmem_query & q,
            std::vector<float> & out) {
        std::vector<uint32_t> slots;
        for (const int32_t b : ids) {
            GGML_ASSERT(!st.blocks.at(b).on_disk && "a sequence's blocks come back from disk before it runs");
            slots.push_back(st.blocks.at(b).slot);
        }
        copier.wait(); // the summaries' uploads share the device's stream
        graph_scorer->score(slots, { query_store->selection_rows((uint32_t) seq_id, q.n_turn, q.newest) }, out);
    };
}

void llama_kvmem_cache::begin_turn_query(llama_seq_id seq_id, kvmem_seq & st, llama_pos pos) {
    // the question: the span of the last user message (its end), whose query rows form the turn's query
    llama_pos q0 = -1, q1 = -1;
    turn_query_span(seq_id, pos, q0, q1);
    st.start_turn(pos, q0, q1);
    // the question's rows: from the graph scorer's ring onto its device, or gathered on the host
    std::vector<llama_pos> positions;
    for (auto r = st.rows.query.lower_bound(q0); r != st.rows.query.end() && r->first < q1; ++r) {
        positions.push_back(r->first);
    }
    st.turn.q.clear();
    if (query_store) {
        query_store->keep_turn((uint32_t) seq_id, positions);
    } else {
        for (const llama_pos p : positions) {
            const std::vector<float> & r = st.rows.query.at(p);
            st.turn.q.insert(st.turn.q.end(), r.begin(), r.end());
        }
    }
    st.turn.n_q = (uint32_t) positions.size();
    std::vector<llama_token> span;
    for (llama_pos qp = std::max<llama_pos>(0, q0); qp < q1; ++qp) {
        const auto bt = st.rows.tokens.find(qp/kp.block);
        span.push_back(bt == st.rows.tokens.end() ? -1 : bt->second[qp % kp.block]);
    }
    st.turn.tokens = kvmem_question_tokens(span, KVMEM_LEX_HALF);
}

void llama_kvmem_cache::apply_target(llama_seq_id seq_id, kvmem_seq & st, const std::set<int32_t> & target,
        kvmem_journal * journal, uint32_t & staged_in, uint32_t & staged_out, uint32_t & reused) {
    // a diff: resident blocks in the target stay, others leave, missing ones come in. The blocks coming in take the
    // cells they would take once the others have left, and their copies are queued first: the device copies while
    // the host keeps the cells' books (evictions, then stage-ins). Those that find no room then make it.
    staged_in = staged_out = reused = 0;
    std::vector<int32_t> leaving, coming;
    for (const auto & [b, hb] : st.blocks) {
        if (target.count(b) && hb.resident) {
            reused++;
        } else if (target.count(b)) {
            coming.push_back(b);
        } else if (hb.resident) {
            leaving.push_back(b);
        }
    }
    std::vector<uint32_t> sizes;
    for (const int32_t b : coming) {
        sizes.push_back((uint32_t) st.blocks.at(b).ext.size());
    }
    const std::vector<std::vector<uint32_t>> placed = place_stage_ins(seq_id, leaving, sizes);
    for (size_t j = 0; j < placed.size(); ++j) {
        copy_block(st.blocks.at(coming[j]), placed[j], /*to_dev*/ true);
    }
    for (const int32_t b : leaving) {
        evict_block(seq_id, b, st.blocks.at(b), journal);
        staged_out++;
    }
    for (size_t j = 0; j < coming.size(); ++j) {
        kvmem_block & hb = st.blocks.at(coming[j]);
        if (j < placed.size()) {
            book_stage_in(seq_id, coming[j], hb, placed[j], journal);
        } else if (!stage_in_making_room(seq_id, coming[j], hb, journal)) {
            LLAMA_LOG_WARN("%s: kvmem: no free cells to stage in block %d of seq %d\n", __func__, coming[j], seq_id);
            break;
        }
        staged_in++;
    }
}

kvmem_selected llama_kvmem_cache::select(llama_seq_id seq_id, kvmem_reason reason) {
    kvmem_seq * found = find_seq(seq_id);
    GGML_ASSERT(found && "a selection is for a sequence that decoded a batch");
    kvmem_seq & st = *found;
    if (!bring_home(seq_id, { seq_id })) { // its batch keeps it in the pool; this is the guard
        LLAMA_LOG_WARN("%s: kvmem: no selection for seq %d: %s\n", __func__, seq_id, get_last_error().c_str());
        return kvmem_selected::NOTHING;
    }
    const llama_pos pos = kvmem_cells().seq_pos_max(seq_id) + 1;
    // a turn first gathers its question's query rows (device or host copies): part of the selection's time, said apart
    const int64_t t_start = ggml_time_us();
    if (reason == kvmem_reason::TURN) {
        begin_turn_query(seq_id, st, pos);
    }
    const double gather_ms = (ggml_time_us() - t_start)/1000.0;
    if (st.blocks.empty()) {
        if (reason == kvmem_reason::TURN) {
            schedule_event(seq_id, st, pos);
        }
        return kvmem_selected::NOTHING;
    }
    const uint32_t share = share_blocks(seq_id);
    if (st.all_resident() && st.n_slots() < share) {
        // the whole history is resident and stays so (the share holds it and the partial tail): nothing to score
        log_fitting(seq_id, st, reason, pos, share, gather_ms);
        return kvmem_selected::NOTHING;
    }

    // re-selections during generation are undone by a truncation below their position (a rejected draft)
    const bool undoable = reason == kvmem_reason::REFRESH || reason == kvmem_reason::ROOM;
    kvmem_journal journal;
    if (undoable) {
        journal.pos = pos;
        journal.reason = reason;
        journal.stage_hint = stage_hint;
        for (const auto & [b, hb] : st.blocks) {
            if (hb.picked) {
                journal.picks_before[b] = hb.score;
            }
        }
    }
    // the scorer's part of the selection, for the SELECT line
    int64_t score_us = 0;
    const kvmem_score_fn scores = [&score_us, inner = score_fn(seq_id, st)](const std::vector<int32_t> & ids,
            const std::vector<char> & candidate, const kvmem_query & q, std::vector<float> & out) {
        const int64_t t0 = ggml_time_us();
        inner(ids, candidate, q, out);
        score_us += ggml_time_us() - t0;
    };
    const kvmem_plan plan = kvmem_plan_selection(geom, st, share, reason, *scorer, scores, kp.query_tokens,
            kp.trace, seq_id);

    const int64_t t_stage = ggml_time_us();
    uint32_t staged_in = 0, staged_out = 0, reused = 0;
    apply_target(seq_id, st, plan.target, undoable ? &journal : nullptr, staged_in, staged_out, reused);
    st.set_picks(plan.picks);
    const int64_t t_wait = ggml_time_us(); // what is left after the host's part: the device's copies still running
    copier.wait();
    const double stage_ms = (ggml_time_us() - t_stage)/1000.0;
    const double stage_wait_ms = (ggml_time_us() - t_wait)/1000.0;

    for (auto * f : followers) {
        f->follow_leader();
    }
    if (undoable) {
        st.events.push_back(std::move(journal));
    }
    if (reason == kvmem_reason::PREFILL) {
        st.next_prefill = pos + prefill_step();
    } else {
        schedule_event(seq_id, st, pos);
    }

    const double ms = (ggml_time_us() - t_start)/1000.0;
    // the graph scorer's part by phase (host clock: its compute part waits for the device); zeros on the host scorer
    const kvmem_graph_scorer::timing gt =
            graph_scorer && score_us > 0 ? graph_scorer->last_timing() : kvmem_graph_scorer::timing{};
    st.n_select++;
    st.last_ms = ms;
    totals.n_select++;
    totals.n_staged_in  += staged_in;
    totals.n_staged_out += staged_out;
    totals.last_ms = ms;

    LLAMA_LOG_WARN("kvmem_score: SELECT seq=%d n_blocks=%d budget_blocks=%u share=%u sink=%u recent=%u scored=%zu staged_in=%u "
            "staged_out=%u reused=%u query_tokens=%u ms=%.3f stage_ms=%.3f stage_mib=%.1f reason=%s pos=%d question=%u method=%s lexical=%u "
            "score_ms=%.3f capture_ms=%.3f plan_ms=%.3f score_steps=%u score_build_ms=%.3f score_upload_ms=%.3f "
            "score_compute_ms=%.3f gather_ms=%.3f stage_wait_ms=%.3f %s\n",
            seq_id, st.n_blocks(), geom.budget_blocks, share, plan.n_sink, plan.n_recent, plan.picks.size(), staged_in,
            staged_out, reused, plan.n_rows, ms, stage_ms, (double) staged_in*ws_block_bytes()/1024.0/1024.0,
            kvmem_reason_name(reason), pos, plan.n_question, kvmem_scorer::method_name(scorer->method()), plan.n_lexical,
            score_us/1000.0, capture.us/1000.0, (t_stage - t_start - score_us)/1000.0 - gather_ms, gt.n_steps, gt.build_us/1000.0,
            gt.upload_us/1000.0, gt.compute_us/1000.0, gather_ms, stage_wait_ms, capture_fields(st).c_str());
    capture = {};
    if (kp.trace) {
        trace_resident(seq_id, st, pos, reason);
    }
    publish();
    return staged_in > 0 ? kvmem_selected::STAGED : kvmem_selected::KEPT;
}

std::string llama_kvmem_cache::capture_fields(const kvmem_seq & st) const {
    uint32_t images = 0, images_resident = 0; // blocks that hold an image (its cells share positions)
    for (const auto & [b, hb] : st.blocks) {
        images += hb.holds_image() ? 1 : 0;
        images_resident += hb.holds_image() && hb.resident ? 1 : 0;
    }
    return format("captured_q=%u image_blocks=%u image_resident=%u capture_fetch_ms=%.3f capture_write_ms=%.3f "
            "capture_ubatches=%u decode_ms=%.3f decodes=%u", capture.q_rows, images, images_resident,
            capture.fetch_us/1000.0, capture.write_us/1000.0, capture.ubatches, capture.decode_us/1000.0, capture.decodes);
}

void llama_kvmem_cache::log_fitting(llama_seq_id seq_id, kvmem_seq & st, kvmem_reason reason, llama_pos pos, uint32_t share,
        double gather_ms) {
    st.set_picks({});
    if (reason == kvmem_reason::PREFILL) {
        st.next_prefill = pos + prefill_step();
    } else {
        schedule_event(seq_id, st, pos);
    }
    st.n_select++;
    st.last_ms = 0.0;
    totals.n_select++;
    totals.last_ms = 0.0;
    LLAMA_LOG_WARN("kvmem_score: SELECT seq=%d n_blocks=%d budget_blocks=%u share=%u sink=0 recent=0 scored=0 staged_in=0 "
            "staged_out=0 reused=%zu query_tokens=0 ms=0.000 stage_ms=0.000 stage_mib=0.0 reason=%s pos=%d question=0 "
            "method=%s lexical=0 fits=1 capture_ms=%.3f gather_ms=%.3f %s\n", seq_id,
            st.n_blocks(), geom.budget_blocks, share, st.blocks.size(), kvmem_reason_name(reason), pos,
            kvmem_scorer::method_name(scorer->method()), capture.us/1000.0, gather_ms, capture_fields(st).c_str());
    capture = {};
    publish();
}

void llama_kvmem_cache::schedule_event(llama_seq_id seq_id, kvmem_seq & st, llama_pos pos) {
    // the next re-selection during generation: every --kvmem-refresh tokens, or earlier when the
    // sequence's cells (its share of the budget + the reserve) would run out. A position, not a
    // count of decodes: speculative batches are cut there (llama-kvmem-decode.cpp)
    const int32_t B = kp.block;
    const int64_t allowance = (int64_t) share_blocks(seq_id)*B + kp.gen_reserve;
    const int64_t used = (int64_t) st.n_resident()*B + pos % B;
    const int64_t room = std::max<int64_t>(1, allowance - used); // the cells left before the sequence's part is full
    const int64_t every = kp.refresh > 0 ? (int64_t) kp.refresh : std::numeric_limits<int32_t>::max();
    st.next_is_room = room < every;
    st.next_event = (llama_pos) std::min<int64_t>(pos + std::min(every, room), POS_END - 1);
}

void llama_kvmem_cache::undo_events(llama_seq_id seq_id, kvmem_seq & st, llama_pos p0) {
    // a truncation below a re-selection's position (a rejected speculative draft): one-token decoding
    // would not have re-selected yet, so the working set goes back to what it was before, cell for cell
    const kvmem_undo_ops undo_ops = {
        // a block another sequence moved to disk meanwhile is gone for the undo: its sequence selects again
        /*is_back   =*/ [this](llama_seq_id s, int32_t b) { const kvmem_block * hb = find_block(s, b); return !hb || hb->resident || hb->on_disk; },
        /*is_staged =*/ [this](llama_seq_id s, int32_t b) { const kvmem_block * hb = find_block(s, b); return hb && hb->resident; },
        /*evict     =*/ [this](llama_seq_id s, int32_t b) { evict_block(s, b, *find_block(s, b), nullptr); },
        /*stage_at  =*/ [this](llama_seq_id s, int32_t b, const std::vector<uint32_t> & idx) {
            return stage_in_at(s, b, *find_block(s, b), idx, nullptr); },
        /*stage_any =*/ [this, seq_id](llama_seq_id s, int32_t b) {
            if (stage_in(s, b, *find_block(s, b), nullptr)) {
                return true;
            }
            LLAMA_LOG_WARN("kvmem: could not put block %d of seq %d back (undo for seq %d)\n", b, s, seq_id);
            return false;
        },
    };
    bool undone = false;
    while (!st.events.empty() && st.events.back().pos >= p0) {
        kvmem_journal ev = std::move(st.events.back());
        st.events.pop_back();
        const auto [back_in, back_out] = kvmem_undo(ev, undo_ops);
        st.set_picks(ev.picks_before);
        stage_hint      = ev.stage_hint;
        st.next_event   = ev.pos;
        st.next_is_room = ev.reason == kvmem_reason::ROOM;
        totals.n_staged_in  += back_in;
        totals.n_staged_out += back_out;
        undone = true;
        if (kp.trace) {
            LLAMA_LOG_WARN("kvmem_trace: undo seq=%d pos=%d staged_in=%u staged_out=%u\n", seq_id, ev.pos, back_in, back_out);
        }
    }
    if (undone) {
        copier.wait();
        for (auto * f : followers) {
            f->follow_leader();
        }
    }
}

void llama_kvmem_cache::trace_resident(llama_seq_id seq_id, const kvmem_seq & st, llama_pos pos, kvmem_reason reason) const {
    std::string ranges;
    int32_t start = -1, prev = -1;
    auto flush = [&]() {
        if (start >= 0) {
            ranges += (ranges.empty() ? "" : ",") + (start == prev ? std::to_string(start) : std::to_string(start) + "-" + std::to_string(prev));
        }
    };
    for (const auto & [b, hb] : st.blocks) {
        if (!hb.resident) {
            continue;
        }
        if (start >= 0 && b == prev + 1) {
            prev = b;
            continue;
        }
        flush();
        start = prev = b;
    }
    flush();
    // layers= tells the caches of a target and its draft model apart in one log
    LLAMA_LOG_WARN("kvmem_trace: resident seq=%d pos=%d reason=%s layers=%zu blocks=%s\n", seq_id, pos,
            kvmem_reason_name(reason), lrows.size(), ranges.c_str());
}

llama_pos llama_kvmem_cache::event_pos(llama_seq_id seq_id) const {
    const kvmem_seq * st = find_seq(seq_id);
    return !st || leader || st->phase() != kvmem_phase::GEN ? -1 : st->next_event;
}

kvmem_reason llama_kvmem_cache::event_reason(llama_seq_id seq_id) const {
    const kvmem_seq * st = find_seq(seq_id);
    return st && st->next_is_room ? kvmem_reason::ROOM : kvmem_reason::REFRESH;
}

llama_pos llama_kvmem_cache::prefill_step() const {
    // a quarter of the budget (at most 2048 tokens), whole blocks: a prompt selects about four times per budget
    const uint32_t B = kp.block;
    return (llama_pos) std::max<uint32_t>(B, (std::min<uint32_t>(2048, kp.budget/4)/B)*B);
}

llama_pos llama_kvmem_cache::prefill_pos(llama_seq_id seq_id) const {
    const kvmem_seq * st = find_seq(seq_id);
    return !st || leader || st->phase() != kvmem_phase::PROMPT ? -1 : st->next_prefill;
}
