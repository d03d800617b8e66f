// KVMem: residency (kvmem-llama): shares, protected blocks, the eviction order, and making room for a ubatch in
// the working set. See llama-kvmem.h (invariants 1, 3 and 4) and llama-kvmem-residency.h.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-batch.h"

#include <algorithm>
#include <set>

//
// the rules (pure)
//

const char * kvmem_evict_tier_name(kvmem_evict_tier tier) {
    switch (tier) {
        case kvmem_evict_tier::IDLE_SEQ:                return "idle";
        case kvmem_evict_tier::OWN:                     return "own";
        case kvmem_evict_tier::OWN_PICK:                return "own-pick";
        case kvmem_evict_tier::OTHER_BEYOND_SHARE:      return "other";
        case kvmem_evict_tier::OTHER_PICK_BEYOND_SHARE: return "other-pick";
        case kvmem_evict_tier::PROMPT_SQUEEZE:          return "squeeze";
    }
    return "?";
}

bool kvmem_victim::before(const kvmem_victim & o) const {
    if (leader_resident != o.leader_resident) {
        return !leader_resident;
    }
    if (tier != o.tier) {
        return tier < o.tier;
    }
    return key < o.key;
}

uint32_t kvmem_residency::share_blocks(const kvmem_seqs & seqs, llama_seq_id seq_id) const {
    uint32_t n_active = 1;
    for (const auto & [s, st] : seqs) {
        if (s != seq_id && st.active()) {
            n_active++;
        }
    }
    return std::max<uint32_t>(g.floor_share(), g.budget_blocks/n_active);
}

bool kvmem_residency::protected_block(const kvmem_seq & st, int32_t b) const {
    if ((uint32_t) b < g.sink_blocks) {
        return true;
    }
    if (st.phase() != kvmem_phase::GEN) {
        return false; // a prompt keeps its newest blocks by evicting oldest first
    }
    const int32_t B = g.block;
    if (st.turn.q0 >= 0 && b >= st.turn.q0/B && b <= (st.turn.q1 - 1)/B) {
        return true; // the question of the turn being answered
    }
    return !st.blocks.empty() && b > st.blocks.rbegin()->first - (int32_t) g.recent_blocks;
}

// the order within a tier: a sequence's picks lowest score first (an idle one's by block too), its other blocks
// oldest first (victim() and movable_cells() agree on it)
static double kvmem_evict_key(const kvmem_block & hb, int32_t b, bool idle) {
    return hb.picked && !idle ? (double) hb.score : (double) b;
}

std::optional<kvmem_victim> kvmem_residency::victim(const kvmem_seqs & seqs, llama_seq_id for_seq,
        const leader_query & resident_in_leader) const {
    std::optional<kvmem_victim> best;
    for (const auto & [s, st] : seqs) {
        const bool own  = s == for_seq;
        const bool idle = !st.active();
        bool squeeze = false;
        if (!own && !idle && st.n_resident() <= share_blocks(seqs, s)) {
            if (st.phase() != kvmem_phase::PROMPT || resident_in_leader) {
                continue; // within its share: untouchable, except a prompt of a cache that follows no one
            }
            squeeze = true;
        }
        for (const auto & [b, hb] : st.blocks) {
            if (!hb.resident || (uint32_t) b < g.sink_blocks || (!idle && protected_block(st, b))) {
                continue;
            }
            kvmem_victim c;
            c.seq   = s;
            c.block = b;
            if (squeeze) {
                c.tier = kvmem_evict_tier::PROMPT_SQUEEZE;
            } else if (idle) {
                c.tier = kvmem_evict_tier::IDLE_SEQ;
            } else if (own) {
                c.tier = hb.picked ? kvmem_evict_tier::OWN_PICK : kvmem_evict_tier::OWN;
            } else {
                c.tier = hb.picked ? kvmem_evict_tier::OTHER_PICK_BEYOND_SHARE : kvmem_evict_tier::OTHER_BEYOND_SHARE;
            }
            c.leader_resident = resident_in_leader && resident_in_leader(s, b);
            c.key = kvmem_evict_key(hb, b, idle);
            if (!best || c.before(*best)) {
                best = c;
            }
        }
    }
    return best;
}

uint32_t kvmem_residency::movable_cells(const kvmem_seqs & seqs, llama_seq_id s, bool in_batch, bool alone_in_batch) const {
    // what evictions could take for a ubatch of the batch: idle sequences' blocks, prompts' blocks, a generating
    // sequence's own blocks when it is alone in the batch, otherwise only beyond its share
    const kvmem_seq & st = seqs.at(s);
    const bool idle = !in_batch && !st.active();
    uint32_t resident = 0;
    std::vector<std::pair<std::pair<bool, double>, const kvmem_block *>> movable; // in victim()'s order, see below
    for (const auto & [b, hb] : st.blocks) {
        if (hb.resident) {
            resident += hb.n_slots();
            if ((uint32_t) b >= g.sink_blocks && (idle || !protected_block(st, b))) {
                movable.push_back({ { hb.picked, kvmem_evict_key(hb, b, idle) }, &hb });
            }
        }
    }
    const bool capped = !idle && st.phase() == kvmem_phase::GEN && !(in_batch && alone_in_batch);
    if (capped) {
        // victim() takes its ordinary blocks oldest first, then its picks lowest score first, each while it holds
        // more than its share: an image's block of several slots may be the one that crosses it
        std::stable_sort(movable.begin(), movable.end(),
                [](const auto & a, const auto & b) { return a.first < b.first; });
    }
    const uint32_t share = capped ? share_blocks(seqs, s) : 0;
    uint32_t cells = 0;
    for (const auto & [order, hb] : movable) {
        if (capped && resident <= share) {
            break;
        }
        resident -= hb->n_slots();
        cells    += hb->n_cells(g.block);
    }
    return cells;
}

//
// the cache: evicting and placing
//

const kvmem_seq * llama_kvmem_cache::find_seq(llama_seq_id seq_id) const {
    const auto it = seqs.find(seq_id);
    return it == seqs.end() ? nullptr : &it->second;
}

kvmem_seq * llama_kvmem_cache::find_seq(llama_seq_id seq_id) {
    const auto it = seqs.find(seq_id);
    return it == seqs.end() ? nullptr : &it->second;
}

kvmem_block * llama_kvmem_cache::find_block(llama_seq_id seq_id, int32_t b) {
    kvmem_seq * st = find_seq(seq_id);
    if (!st) {
        return nullptr;
    }
    const auto it = st->blocks.find(b);
    return it == st->blocks.end() ? nullptr : &it->second;
}

size_t llama_kvmem_cache::ws_block_bytes() const {
    size_t n = 0;
    for (const auto & l : lrows) {
        n += (size_t) kp.block*(l.row_k + l.row_v);
    }
    return n;
}

void llama_kvmem_cache::evict_block(llama_seq_id seq_id, int32_t b, kvmem_block & hb, kvmem_journal * journal) {
    GGML_ASSERT(hb.resident && "only a resident block is evicted");
    // the block's own cells (found through the sequence's position map), not a scan of the whole working set
    std::vector<uint32_t> idx = block_cells(seq_id, b);
    auto & cells = kvmem_cells();
    for (const uint32_t i : idx) {
        if (cells.seq_rm(i, seq_id)) {
            kvmem_lower_head(i);
        }
    }
    if (journal) {
        journal->evicted.push_back({ { seq_id, b }, std::move(idx) });
    }
    hb.resident = false;
    hb.picked   = false;
}

bool llama_kvmem_cache::evict_one(llama_seq_id for_seq, kvmem_journal * journal) {
    kvmem_residency::leader_query in_leader = nullptr;
    if (leader) {
        in_leader = [this](llama_seq_id s, int32_t b) { return resident_in_leader(s, b); };
    }
    const std::optional<kvmem_victim> v = rules.victim(seqs, for_seq, in_leader);
    if (!v) {
        return false;
    }
    kvmem_seq & victim = seqs.at(v->seq);
    GGML_ASSERT((!victim.active() || !rules.protected_block(victim, v->block)) && "invariant 1: protected blocks stay");
    if (v->tier == kvmem_evict_tier::PROMPT_SQUEEZE && !victim.squeezed) {
        victim.squeezed = true; // once per prompt: the user learns why that slot's prefill saw less
        LLAMA_LOG_WARN("kvmem: parallel prompts outgrow the working set: seq %d reads its prompt with less than its share "
                "of --kvmem-budget to make room for seq %d (its turn still selects from the whole history; a larger "
                "--kvmem-budget keeps full prefill windows)\n", v->seq, for_seq);
    }
    evict_block(v->seq, v->block, victim.blocks.at(v->block), journal);
    totals.n_evicted++;
    if (kp.trace) {
        LLAMA_LOG_WARN("kvmem_trace: evict seq=%d block=%d tier=%s for_seq=%d\n", v->seq, v->block,
                kvmem_evict_tier_name(v->tier), for_seq);
    }
    return true;
}

llama_kv_cache::slot_info llama_kvmem_cache::place(const llama_ubatch & ubatch) const {
    // the lowest free cells, in order: where a token lands depends only on which cells are free, not on how many
    // tokens share its ubatch (upstream's search start depends on the ubatch size). A verification batch of k
    // tokens so takes the cells k one-token decodes would, and attention sums over the same cell order.
    const auto & cells = kvmem_cells();
    slot_info res = { 0, 0, { }, { } };
    res.resize(1);
    res.strm[0] = 0;
    res.idxs[0].reserve(ubatch.n_tokens);
    for (uint32_t i = 0; i < cells.size() && res.idxs[0].size() < ubatch.n_tokens; ++i) {
        if (cells.is_empty(i)) {
            res.idxs[0].push_back(i);
        }
    }
    if (res.idxs[0].size() < ubatch.n_tokens) {
        return { };
    }
    return res;
}

bool llama_kvmem_cache::prepare_ubatch(const llama_ubatch & ubatch, slot_info & sinfo) {
    copier.wait();

    // the host pool must take every block this ubatch completes (write-through); init_batch checked the
    // whole batch already, this guards contexts whose ubatches were split elsewhere
    if (!host_room_for(&ubatch, 1)) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, get_last_error().c_str());
        return false;
    }

    // the room is made on behalf of the ubatch's sequences, the one with the most tokens first (a mixed
    // batch holds one generated token of a slot next to a long prompt chunk of another)
    std::map<llama_seq_id, uint32_t> count;
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        count[ubatch.seq_id[i][0]]++;
    }
    std::vector<std::pair<uint32_t, llama_seq_id>> order;
    for (const auto & [s, c] : count) {
        order.push_back({ c, s });
    }
    std::sort(order.begin(), order.end(), std::greater<>());
    for (;;) {
        sinfo = place(ubatch);
        if (!sinfo.empty()) {
            return true;
        }
        const bool evicted = std::any_of(order.begin(), order.end(), [&](const auto & o) { return evict_one(o.second, nullptr); });
        if (!evicted) {
            log_no_room(ubatch.n_tokens);
            return false;
        }
    }
}

void llama_kvmem_cache::log_no_room(uint32_t n_tokens) {
    for (const auto & [s, st] : seqs) {
        uint32_t prot = 0;
        for (const auto & [b, hb] : st.blocks) {
            prot += hb.resident && rules.protected_block(st, b) ? 1 : 0;
        }
        LLAMA_LOG_WARN("kvmem: seq %d phase=%d active=%d resident=%u protected=%u share=%u cells=%d..%d\n", s, (int) st.phase(),
                (int) st.active(), st.n_resident(), prot, share_blocks(s), kvmem_cells().seq_pos_min(s), kvmem_cells().seq_pos_max(s));
    }
    LLAMA_LOG_WARN("kvmem: used %u of %u cells\n", kvmem_cells().get_used(), get_size());
    const std::string msg = format("KV tiering: no room for a ubatch of %u tokens in the GPU working set of %u cells "
            "(raise --kvmem-budget or --kvmem-gen-reserve, or use fewer parallel slots)", n_tokens, get_size());
    LLAMA_LOG_ERROR("%s: %s\n", __func__, msg.c_str());
    set_last_error(msg);
}

void llama_kvmem_cache::fit_ubatch(const llama_batch_allocr & balloc, uint32_t & n_ub) const {
    // parallel prompts that together outgrow the working set get smaller ubatches instead of a batch that fails
    // half-way. room: the free cells plus what evictions may take for any ubatch of the batch; held: what the
    // batch's sequences add that cannot leave (the rest of a new prompt's sink, the growth of each open block).
    // Only a batch that does not fit whole is split finer, and never below one token of room: prepare_ubatch()
    // then says what holds the cells.
    const llama_batch & batch = balloc.get_batch();
    const uint32_t n_free = get_size() - std::min(get_size(), kvmem_cells().get_used());
    if (n_free >= (uint32_t) batch.n_tokens) {
        return; // the common case (every generation step): no need to look at the blocks
    }
    std::set<llama_seq_id> in_batch;
    for (int32_t i = 0; i < batch.n_tokens; ++i) {
        in_batch.insert(batch.seq_id ? batch.seq_id[i][0] : 0);
    }
    const uint32_t B = kp.block;
    uint64_t room = n_free;
    for (const auto & [s, st] : seqs) {
        room += rules.movable_cells(seqs, s, in_batch.count(s) > 0, in_batch.size() == 1);
    }
    if (room >= (uint64_t) batch.n_tokens) {
        return;
    }
    uint64_t held = 0;
    for (const auto s : in_batch) {
        const uint32_t n = (uint32_t) (kvmem_cells().seq_pos_max(s) + 1);
        const uint32_t sink_cells = geom.sink_blocks*B;
        held += n < sink_cells ? sink_cells - n + (B - 1) : (B - 1) - n % B;
    }
    if (room <= held) {
        return;
    }
    const uint32_t fit = (uint32_t) std::min<uint64_t>(room - held, n_ub);
    if (fit < n_ub && kp.trace) {
        LLAMA_LOG_WARN("kvmem_trace: ubatch %u -> %u (room %llu, held %llu)\n", n_ub, fit,
                (unsigned long long) room, (unsigned long long) held);
    }
    n_ub = fit;
}

uint32_t llama_kvmem_cache::max_active() const {
    const uint32_t per = geom.floor_share()*kp.block + std::max<uint32_t>(kp.block, kp.gen_reserve);
    return std::max<uint32_t>(1, get_size()/per);
}

uint32_t llama_kvmem_cache::max_ubatch(uint32_t n_ubatch) const {
    const uint32_t size = get_size();
    const uint32_t keep = (geom.sink_blocks + 1)*kp.block;
    return std::max<uint32_t>(1, std::min<uint32_t>(n_ubatch, size > keep ? size - keep : 1));
}

bool llama_kvmem_cache::may_stage(uint32_t n_new) const {
    for (const auto & [s, st] : seqs) {
        if (!st.all_resident()) {
            return true;
        }
    }
    return kvmem_cells().get_used() + n_new > kvmem_cells().size();
}
