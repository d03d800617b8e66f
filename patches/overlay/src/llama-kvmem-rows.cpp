// KVMem: what scoring needs, captured after each ubatch (kvmem-llama): block summaries from the ubatch's pre-RoPE
// keys, the query rows of its last tokens, token ids per block; then the write-through of completed blocks.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-graph.h"

#include <algorithm>
#include <cstring>
#include <limits>

static constexpr llama_pos POS_END = std::numeric_limits<llama_pos>::max();

void llama_kvmem_cache::after_ubatch(ggml_backend_sched_t sched, const llm_graph_result * res, const llama_ubatch & ubatch) {
    if (!res) {
        return;
    }
    ggml_backend_sched_synchronize(sched);
    const int64_t t0 = ggml_time_us(); // the ubatch's compute is done: what follows is ours
    if (!leader && scorer->scores()) {
        const bool keys = scorer->summary_size() > 0;
        fetch_captures(sched, res, ubatch.n_tokens, keys, wants_query_rows(ubatch));
        capture.fetch_us += ggml_time_us() - t0;
        if (keys) {
            capture_keys(ubatch);
        }
        if (scorer->lexical() && ubatch.token) {
            capture_tokens(ubatch);
        }
        capture_queries(ubatch);
    }
    const int64_t t_write = ggml_time_us();
    for (uint32_t s = 0; s < ubatch.n_seqs_unq; ++s) {
        write_through(ubatch.seq_id_unq[s], ubatch.embd != nullptr);
    }
    capture.write_us += ggml_time_us() - t_write;
    if (summaries) {
        summaries->flush(); // this ubatch's summaries are on the device
    }
    capture.us += ggml_time_us() - t0;
    capture.ubatches++;
    publish();
}

bool llama_kvmem_cache::wants_query_rows(const llama_ubatch & ubatch) const {
    // inside a prompt only the ubatches near its end can hold the turn's query; a retrieval prefill selects with the
    // newest rows of every ubatch
    if (kp.prefill == LLAMA_KVMEM_PREFILL_RETRIEVAL) {
        return true;
    }
    // a token that wants them is enough (the answer only grows with the position): the newest tokens first. A row
    // is read by selections within the ring's reach of its position; while the history fits the working set until
    // then, those selections are no-ops (the capture of ~400 KB per decoded token on a 27B model is skipped).
    const uint32_t reach = kvmem_kept_query_rows(kp.query_tokens) - 1;
    for (uint32_t i = ubatch.n_tokens; i-- > 0; ) {
        const llama_seq_id s = ubatch.seq_id[i][0];
        const kvmem_seq * st = find_seq(s);
        if (!st || (st->wants_query_rows(ubatch.pos[i], reach) && !fits_through(s, *st, ubatch.pos[i] + (llama_pos) reach))) {
            return true;
        }
    }
    return false;
}

bool llama_kvmem_cache::fits_through(llama_seq_id seq_id, const kvmem_seq & st, llama_pos until) const {
    // by `until` the history has at most until/B + 1 blocks; one block under the share keeps the partial tail
    // (the no-op test of a selection, log_fitting)
    // (an image's block weighs its slots: what it adds over one block per position counts too)
    const uint32_t extra = st.n_slots() - std::min<uint32_t>(st.n_slots(), (uint32_t) st.blocks.size());
    return st.phase() == kvmem_phase::GEN && (uint32_t) (until/kp.block) + 1 + extra < share_blocks(seq_id) &&
        st.all_resident();
}

void llama_kvmem_cache::fetch_captures(ggml_backend_sched_t sched, const llm_graph_result * res, uint32_t n_tokens,
        bool keys, bool queries) {
    // every tiered layer's pre-RoPE K (n_tokens rows) and Q (the ubatch's last rows, when `queries`) in one readback
    // round; a layer whose tensors are missing or of another shape (a graph without the hook) has none
    const size_t per_k = (size_t) dims.n_head_kv*dims.head_dim;
    const size_t per_q = (size_t) dims.n_head*dims.head_dim;
    const uint32_t n_lt = lrows.size();
    std::vector<int64_t> ik(n_lt, -1), iq(n_lt, -1);
    n_cap_q = 0;
    bool q_ok = true; // the first layer's Q sets the row count; without it no query rows are kept
    for (uint32_t lt = 0; lt < n_lt; ++lt) {
        const uint32_t il = lrows[lt].il;
        ggml_tensor * k = keys && il < res->t_kvmem_k.size() ? res->t_kvmem_k[il] : nullptr;
        ggml_tensor * q = queries && il < res->t_kvmem_q.size() ? res->t_kvmem_q[il] : nullptr;
        if (k && (size_t) ggml_nelements(k) == per_k*n_tokens) {
            ik[lt] = (int64_t) readback.add(k);
        }
        // every layer's Q has the first layer's row count, at most the ubatch's
        if (q_ok && q && (size_t) (q->ne[0]*q->ne[1]) == per_q && (uint32_t) q->ne[2] <= n_tokens &&
                (lt == 0 || (uint32_t) q->ne[2] == n_cap_q)) {
            n_cap_q = (uint32_t) q->ne[2];
            iq[lt] = (int64_t) readback.add(q);
        } else if (lt == 0) {
            q_ok = false;
        }
    }
    n_cap_q = q_ok ? n_cap_q : 0;
    readback.fetch(sched);
    cap_k.assign(n_lt, nullptr);
    cap_q.assign(n_lt, nullptr);
    for (uint32_t lt = 0; lt < n_lt; ++lt) {
        cap_k[lt] = ik[lt] >= 0 ? readback.rows(ik[lt]) : nullptr;
        cap_q[lt] = iq[lt] >= 0 ? readback.rows(iq[lt]) : nullptr;
    }
}

void llama_kvmem_cache::capture_keys(const llama_ubatch & ubatch) {
    // the summary of every block this ubatch completed is built from the ubatch's key rows (cap_k: per layer
    // [token][kv head][head_dim]); only the rows of each sequence's two newest blocks are kept (to rebuild a
    // summary after a truncation)
    const uint32_t nt = ubatch.n_tokens;
    const int32_t  B  = kp.block;
    const size_t per_k = (size_t) dims.n_head_kv*dims.head_dim;
    const uint32_t n_lt = lrows.size();
    if (cap_k.empty() || std::any_of(cap_k.begin(), cap_k.end(), [](const float * k) { return k == nullptr; })) {
        if (!warned_no_keys) {
            LLAMA_LOG_WARN("%s: kvmem: a tiered layer's keys were not captured; blocks get no summaries (recency)\n",
                    __func__);
            warned_no_keys = true;
        }
        return;
    }
    // position -> the ubatch's tokens there (one, or an image's many)
    std::map<llama_seq_id, std::map<llama_pos, std::vector<uint32_t>>> in_ubatch;
    for (uint32_t i = 0; i < nt; ++i) {
        in_ubatch[ubatch.seq_id[i][0]][ubatch.pos[i]].push_back(i);
    }
    const size_t per_row = (size_t) n_lt*per_k;
    for (auto & [s, toks] : in_ubatch) {
        kvmem_seq & st = open_seq(s);
        const llama_pos reached = toks.rbegin()->first;
        const llama_pos keep_from = std::max<llama_pos>(0, (reached/B - 1)*B);
        // an image's cells may come in several ubatches: the earlier ones' rows first, then this ubatch's; a token's
        // position decoded again (text) is this ubatch's alone
        const kvmem_key_rows key_row = [&](llama_pos pos, uint32_t lt, uint32_t k) -> const float * {
            const auto kr = st.rows.key.find(pos);
            const uint32_t n_kept = kr == st.rows.key.end() || !ubatch.embd ? 0 : (uint32_t) (kr->second.size()/per_row);
            const auto it = toks.find(pos);
            if (it != toks.end()) {
                return k < n_kept ? kr->second.data() + k*per_row + (size_t) lt*per_k :
                       k - n_kept < it->second.size() ? cap_k[lt] + (size_t) it->second[k - n_kept]*per_k : nullptr;
            }
            return kr == st.rows.key.end() || (k + 1)*per_row > kr->second.size() ? nullptr :
                kr->second.data() + k*per_row + (size_t) lt*per_k;
        };
        // the blocks this ubatch completes, and an image's block that the positions it spans completed meanwhile
        const llama_pos oldest_kept = st.rows.key.empty() ? toks.begin()->first : st.rows.key.begin()->first;
        const int32_t first = std::min(toks.begin()->first, oldest_kept)/B;
        for (int32_t blk = first; blk <= reached/B; ++blk) {
            const auto hb = st.blocks.find(blk);
            const bool known = st.rows.summary.count(blk) || (hb != st.blocks.end() && hb->second.summarized);
            if (blk >= toks.begin()->first/B || !known) {
                build_summary(s, st, blk, reached, key_row);
            }
        }
        st.rows.key.erase(st.rows.key.begin(), st.rows.key.lower_bound(keep_from));
        for (auto it = toks.lower_bound(keep_from); it != toks.end(); ++it) {
            auto & row = st.rows.key[it->first];
            if (!ubatch.embd) {
                row.clear(); // a token's position decoded again
            }
            row.reserve(row.size() + it->second.size()*per_row);
            for (const uint32_t i : it->second) {
                for (uint32_t lt = 0; lt < n_lt; ++lt) {
                    const float * src = cap_k[lt] + (size_t) i*per_k;
                    row.insert(row.end(), src, src + per_k);
                }
            }
        }
    }
}

void llama_kvmem_cache::capture_tokens(const llama_ubatch & ubatch) {
    const int32_t B = kp.block;
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        auto & toks = open_seq(ubatch.seq_id[i][0]).rows.tokens[ubatch.pos[i]/B];
        if (toks.empty()) {
            toks.assign(B, -1);
        }
        toks[ubatch.pos[i] % B] = ubatch.token ? ubatch.token[i] : -1; // embeddings (an image) have no token id
    }
}

void llama_kvmem_cache::capture_queries(const llama_ubatch & ubatch) {
    // query rows: the last n_cap_q tokens of this ubatch, kept by position ([layer][head][head_dim] each), in the
    // graph scorer's rings (the position noted here) or here
    const uint32_t nt = ubatch.n_tokens;
    const size_t per_q = (size_t) dims.n_head*dims.head_dim;
    if (lrows.empty() || n_cap_q == 0 || !cap_q[0]) {
        return;
    }
    std::set<llama_seq_id> touched;
    capture.q_rows += n_cap_q;
    for (uint32_t j = 0; j < n_cap_q; ++j) {
        const uint32_t i = nt - n_cap_q + j;
        const llama_seq_id s = ubatch.seq_id[i][0];
        std::vector<float> kept;
        float * row = query_store ? query_store->ring_row((uint32_t) s, ubatch.pos[i]) : nullptr;
        if (!row) {
            kept.assign((size_t) lrows.size()*per_q, 0.0f);
            row = kept.data();
        }
        for (uint32_t lt = 0; lt < lrows.size(); ++lt) {
            if (cap_q[lt]) {
                std::memcpy(row + lt*per_q, cap_q[lt] + j*per_q, per_q*sizeof(float));
            } else {
                std::fill(row + lt*per_q, row + (lt + 1)*per_q, 0.0f);
            }
        }
        open_seq(s).rows.query[ubatch.pos[i]] = std::move(kept);
        touched.insert(s);
    }
    for (const auto s : touched) {
        auto & q = open_seq(s).rows.query;
        const llama_pos keep = q.rbegin()->first - (llama_pos) (kvmem_kept_query_rows(kp.query_tokens) - 1);
        q.erase(q.begin(), q.lower_bound(keep));
    }
}

void llama_kvmem_cache::build_summary(llama_seq_id seq_id, kvmem_seq & st, int32_t b, llama_pos reached,
        const kvmem_key_rows & key_row) {
    // a block is summarized when the sequence has reached its last position; rows missing at its start are those of
    // a block cut by a truncation deep in the history, whose old summary fills in for the tokens that did not change
    const int32_t B = kp.block;
    if (reached < (b + 1)*B - 1) {
        return; // not complete (yet)
    }
    const std::vector<uint32_t> cells = block_cells(seq_id, b);
    const bool regular = one_cell_per_position(b, cells);
    // the rows are read where they were captured (a 27B model's block is 8 MB of them: no copy)
    std::vector<const float *> rows;
    bool complete = true;
    if (regular || cells.empty()) {
        rows.assign((size_t) B*dims.n_lt, nullptr);
        for (int32_t t = 0; t < B; ++t) {
            if (!key_row(b*B + t, 0, 0)) {
                complete = false;
                continue;
            }
            for (uint32_t lt = 0; lt < dims.n_lt; ++lt) {
                rows[(size_t) t*dims.n_lt + lt] = key_row(b*B + t, lt, 0);
            }
        }
    } else {
        // an image's block: every cell's row, position by position (no truncation keeps part of it)
        for (int32_t t = 0; t < B; ++t) {
            for (uint32_t k = 0; key_row(b*B + t, 0, k); ++k) {
                for (uint32_t lt = 0; lt < dims.n_lt; ++lt) {
                    rows.push_back(key_row(b*B + t, lt, k));
                }
            }
        }
        if (rows.size() != cells.size()*dims.n_lt) {
            return; // rows missing (a restored state): no summary rather than a wrong one
        }
    }
    const auto stale = st.rows.stale.find(b);
    if (!complete && (stale == st.rows.stale.end() || !regular)) {
        return; // rows missing for another reason (a restored state): no summary rather than a wrong one
    }
    auto & out = st.rows.summary[b];
    out.resize(scorer->summary_size());
    const bool use_old = !complete && stale->second.first.size() == out.size();
    scorer->summarize(rows, out.data(), use_old ? stale->second.first.data() : nullptr, use_old ? stale->second.second : 0);
    if (stale != st.rows.stale.end()) {
        st.rows.stale.erase(stale);
    }
    const auto hb = st.blocks.find(b);
    if (hb != st.blocks.end()) {
        store_summary(st, b, hb->second); // already in the host pool: its slot's summary changes with it
    }
}

void llama_kvmem_cache::store_summary(kvmem_seq & st, int32_t b, kvmem_block & hb) {
    const auto host = st.rows.summary.find(b);
    if (!summaries || host == st.rows.summary.end()) {
        return; // the host scorer reads them here
    }
    GGML_ASSERT(!hb.on_disk && "a summary goes into the slot of a block in the pool");
    summaries->put(hb.slot, host->second.data());
    hb.summarized = true;
    st.rows.summary.erase(host);
}

std::vector<float> llama_kvmem_cache::block_summary(const kvmem_seq & st, int32_t b) const {
    const auto host = st.rows.summary.find(b);
    if (host != st.rows.summary.end()) {
        return host->second;
    }
    const auto hb = st.blocks.find(b);
    if (summaries && hb != st.blocks.end() && hb->second.summarized && hb->second.on_disk) {
        // the summary alone, from the block's first record
        std::vector<uint8_t *> skip(hb->second.n_slots(), nullptr);
        std::vector<float> summary;
        std::string err;
        if (!read_records(hb->second, skip, summary, err)) {
            // the block is then ranked without a summary; reading its bytes back says what failed
            LLAMA_LOG_WARN("%s: kvmem: reading block %d's summary from the disk tier under %s failed: %s\n", __func__,
                    b, disk.path().c_str(), err.c_str());
            return {};
        }
        return summary;
    }
    if (summaries && hb != st.blocks.end() && hb->second.summarized) {
        return summaries->get(hb->second.slot);
    }
    return {};
}

void llama_kvmem_cache::forget_from(kvmem_seq & st, llama_pos p0, llama_pos p1, bool keep_summaries) {
    const int32_t B = kp.block;
    auto & btok = st.rows.tokens;
    for (auto it = btok.lower_bound(p0/B); it != btok.end() && (p1 == POS_END || it->first*B < p1); ) {
        for (llama_pos p = std::max(p0, it->first*B); p < std::min<llama_pos>(p1, (it->first + 1)*B); ++p) {
            it->second[p - it->first*B] = -1;
        }
        it = it->first*B >= p0 && p1 == POS_END ? btok.erase(it) : std::next(it);
    }
    st.rows.key.erase(st.rows.key.lower_bound(p0), st.rows.key.lower_bound(p1));
    st.rows.query.erase(st.rows.query.lower_bound(p0), st.rows.query.lower_bound(p1));
    if (p1 == POS_END && st.embd_end > p0) {
        st.embd_end = p0; // the image went with the cut (or its positions did)
    }
    // the block the cut falls in keeps its old summary aside, if its first tokens' rows are gone
    const int32_t b0 = p0/B;
    if (p1 == POS_END && p0 % B != 0 && st.rows.key.find(b0*B) == st.rows.key.end()) {
        std::vector<float> old = block_summary(st, b0);
        if (!old.empty()) {
            st.rows.stale[b0] = { std::move(old), (uint32_t) (p0 - b0*B) };
        }
    }
    if (keep_summaries) {
        return;
    }
    st.rows.stale.erase(st.rows.stale.upper_bound(b0), st.rows.stale.end());
    const int32_t b1 = p1 == POS_END ? std::numeric_limits<int32_t>::max() : (p1 - 1)/B + 1;
    st.rows.summary.erase(st.rows.summary.lower_bound(p0/B), st.rows.summary.lower_bound(b1));
}
