// KVMem: KV tiering for the attention KV cache (kvmem-llama): residency. See llama-kvmem.h.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-model.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

#include <algorithm>
#include <unordered_map>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

static uint32_t div_up(uint32_t a, uint32_t b) { return (a + b - 1)/b; }

static constexpr llama_pos POS_END = std::numeric_limits<llama_pos>::max();

// query rows kept beyond the query itself: the template tokens after the last user message, and
// the rows of speculative drafts that may still be rejected (rows are dropped by position only, so a
// rejected draft leaves the same rows as one-token decoding would)
static constexpr uint32_t KVMEM_ROW_SLACK = 256;

// tokens kept for recomputing a turn's query span, beyond --kvmem-query-tokens
static constexpr uint32_t KVMEM_TOKEN_SLACK = 1024;
// hybrid picks: a question token's weight halves every this many tokens before the question's end (measured
// offline on 30 samples each of niah_single_essay/multikey/followup at 7.8K tokens, SmolLM2 tokenizer, 128-token
// query span: the needle block stands out and ranks first in 26, 30, 28 with 16; 11, 10, 17 unweighted)
static constexpr float KVMEM_LEX_HALF = 16.0f;

std::string llama_kvmem_cache::check(const llama_model & model, const llama_cparams & cparams, const llama_kvmem_params & kp) {
    GGML_UNUSED(kp);
    const auto & hp = model.hparams;
    if (!cparams.flash_attn) {
        return "flash attention is off (-fa off); tiering copies per-token V rows and needs -fa on or auto";
    }
    if (!cparams.kv_unified && cparams.n_seq_max > 1) {
        return "parallel sequences need a unified KV cache (--kv-unified)";
    }
    if (model.split_mode() == LLAMA_SPLIT_MODE_TENSOR) {
        // each KV row is split over the devices: block copies move whole rows of one device's buffer
        return "--split-mode tensor splits every KV row across devices: not tiered yet; use --split-mode layer or row";
    }
    uint32_t n_attn = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (!hp.has_kv(il) || hp.is_recr(il)) {
            continue;
        }
        n_attn++;
        if (hp.n_head_kv(il) != hp.n_head_kv(0) || hp.n_head(il) != hp.n_head(0) ||
            hp.n_embd_head_k(il) != hp.n_embd_head_k(0) || hp.n_head_kv(il) == 0) {
            return "layers with different head layouts are not tiered yet";
        }
    }
    if (n_attn == 0) {
        return "the model has no attention layers";
    }
    return "";
}

llama_kvmem_cache * llama_kvmem_cache::from(llama_memory_i * mem) {
    if (!mem) {
        return nullptr;
    }
    if (auto * km = dynamic_cast<llama_kvmem_cache *>(mem)) {
        return km;
    }
    if (auto * hy = dynamic_cast<llama_memory_hybrid *>(mem)) {
        return dynamic_cast<llama_kvmem_cache *>(hy->get_mem_attn());
    }
    return nullptr;
}

// the working set's type for a pool of type t
static ggml_type kvmem_working_type(ggml_type t, const llama_kvmem_params & kp) {
    return kp.gpu_type == LLAMA_KVMEM_GPU_TYPE_F16 && ggml_is_quantized(t) ? GGML_TYPE_F16 : t;
}

llama_kvmem_cache::llama_kvmem_cache(
        const llama_model & model,
        ggml_type type_k,
        ggml_type type_v,
        bool offload,
        uint32_t n_seq_max,
        uint32_t n_ctx_total,
        const llama_kvmem_params & kp_in,
        const layer_filter_cb & filter,
        llama_kvmem_cache * target) :
    llama_kv_cache(model, model.hparams, kvmem_working_type(type_k, kp_in), kvmem_working_type(type_v, kp_in),
            /*v_trans*/ false, offload, /*unified*/ true,
            kp_in.budget + kp_in.gen_reserve*std::max<uint32_t>(1, n_seq_max), n_seq_max, 1, 0, LLAMA_SWA_TYPE_NONE, nullptr, filter, nullptr, nullptr, "kvmem"),
    kp(kp_in), pool_type_k(type_k), pool_type_v(type_v) {
    const auto & hp = model.hparams;
    const uint32_t B = kp.block;

    sink_blocks   = div_up(kp.sink, B);
    recent_blocks = div_up(kp.recent, B);
    budget_blocks = kp.budget / B;
    n_seq_cap     = std::max<uint32_t>(1, n_seq_max);

    n_lt = layers.size();
    il_to_lt.assign(hp.n_layer() + hp.n_layer_nextn + 1, -1);
    for (uint32_t i = 0; i < n_lt; ++i) {
        if (layers[i].il < il_to_lt.size()) {
            il_to_lt[layers[i].il] = i;
        }
        row_k.push_back(layers[i].k->nb[1]);
        row_v.push_back(layers[i].v ? layers[i].v->nb[1] : 0);
        for (const auto & [t, n] : { std::make_pair(pool_type_k, layers[i].k->ne[0]),
                                     std::make_pair(pool_type_v, layers[i].v ? layers[i].v->ne[0] : 0) }) {
            if (n % ggml_blck_size(t) != 0) {
                throw std::runtime_error(format("KV tiering: a KV row of layer %d has %lld values, not a multiple of the "
                            "%s block size %lld; choose another -ctk/-ctv", layers[i].il, (long long) n, ggml_type_name(t),
                            (long long) ggml_blck_size(t)));
            }
        }
        hrow_k.push_back(ggml_row_size(pool_type_k, layers[i].k->ne[0]));
        hrow_v.push_back(layers[i].v ? ggml_row_size(pool_type_v, layers[i].v->ne[0]) : 0);
        block_bytes += (size_t) B*(hrow_k.back() + hrow_v.back());
        ws_block_bytes += (size_t) B*(row_k.back() + row_v.back());
    }

    const uint32_t il0 = n_lt ? layers[0].il : 0;
    n_head    = hp.n_head(il0);
    n_head_kv = hp.n_head_kv(il0);
    head_dim  = hp.n_embd_head_k(il0);
    dims = { n_lt, n_head, n_head_kv, head_dim, B };
    scorer = std::make_unique<kvmem_scorer>(dims, kvmem_scorer::resolve(kp.method));

    init_pool(n_ctx_total);

    const double host_mib = (double) host_slots*block_bytes/1024.0/1024.0;
    if (target) {
        set_leader(target);
        LLAMA_LOG_WARN("kvmem_score: DRAFT follows the target's selection: blocks=%u layers=%u host_mib=%.0f\n",
                host_slots, n_lt, std::ceil(host_mib));
    } else {
        LLAMA_LOG_WARN("kvmem_score: ARMED blocks=%u block_tokens=%u layers=%u kv_heads=%u head_dim=%u budget_blocks=%u host_mib=%.0f method=%s prefill=%s "
                "gpu_type=%s/%s pool_type=%s/%s\n",
                host_slots, B, n_lt, n_head_kv, head_dim, budget_blocks, std::ceil(host_mib),
                kvmem_scorer::method_name(scorer->method()), kp.prefill == LLAMA_KVMEM_PREFILL_RETRIEVAL ? "retrieval" : "window",
                ggml_type_name(this->type_k()), ggml_type_name(this->type_v()), ggml_type_name(pool_type_k), ggml_type_name(pool_type_v));
    }
    LLAMA_LOG_INFO("%s: GPU working set %u cells (budget %u + gen reserve %u x %u sequences), sink %u block(s), recent %u block(s), "
            "query %u tokens, refresh %u\n", __func__, get_size(), kp.budget, kp.gen_reserve, n_seq_cap, sink_blocks, recent_blocks,
            kp.query_tokens, kp.refresh);
}

llama_kvmem_cache::~llama_kvmem_cache() {
    for (auto * f : followers) {
        f->leader = nullptr;
    }
    if (leader) {
        auto & fs = leader->followers;
        fs.erase(std::remove(fs.begin(), fs.end(), this), fs.end());
    }
    copies_wait();
    for (auto * be : copy_backends) {
        ggml_backend_free(be);
    }
    if (host_buf) {
        ggml_backend_buffer_free(host_buf);
    }
}

bool llama_kvmem_context::apply() {
    if (!ubatches.empty() && !km->prepare_ubatch(ubatches[i_cur], sinfos[i_cur])) {
        return false;
    }
    return llama_kv_cache_context::apply();
}

llama_memory_context_ptr llama_kvmem_cache::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);

    uint32_t n_ub = max_ubatch(n_ubatch);
    fit_ubatch(balloc, n_ub);

    balloc.split_reset();
    std::vector<llama_ubatch> ubatches;
    while (true) {
        auto ubatch = balloc.split_simple(n_ub);
        if (ubatch.n_tokens == 0) {
            break;
        }
        ubatches.push_back(std::move(ubatch)); // NOLINT
    }
    if (balloc.get_n_used() < balloc.get_n_tokens() || !host_room_for(ubatches.data(), ubatches.size())) {
        return std::make_unique<llama_kv_cache_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }
    slot_info_vec_t sinfos(ubatches.size());
    return std::make_unique<llama_kvmem_context>(this, std::move(sinfos), std::move(ubatches));
}

void llama_kvmem_cache::fit_ubatch(const llama_batch_allocr & balloc, uint32_t & n_ub) const {
    // parallel prompts that together outgrow the working set get smaller ubatches instead of a batch that fails
    // half-way. room: the free cells plus those evict_one() may take for any ubatch of the batch (idle sequences'
    // blocks, prompts' blocks, a generating sequence's own blocks when it is alone in the batch, otherwise only
    // beyond its share); held: what the batch's sequences add that cannot leave (the rest of a new prompt's sink,
    // the growth of each open block). Only a batch that does not fit whole is split finer, and never below one
    // token of room: prepare_ubatch() then says what holds the cells.
    const llama_batch & batch = balloc.get_batch();
    const uint32_t n_free = get_size() - std::min(get_size(), v_cells[0].get_used());
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
        const bool mine = in_batch.count(s) > 0;
        const bool idle = !mine && !active(st);
        uint32_t resident = 0, movable = 0;
        for (const auto & [b, hb] : st.blocks) {
            if (!hb.resident) {
                continue;
            }
            resident++;
            movable += (uint32_t) b >= sink_blocks && (idle || !protected_block(st, b)) ? 1 : 0;
        }
        if (!idle && st.phase == PHASE_GEN && !(mine && in_batch.size() == 1)) {
            const uint32_t share = share_blocks(s);
            movable = std::min(movable, resident > share ? resident - share : 0);
        }
        room += (uint64_t) movable*B;
    }
    if (room >= (uint64_t) batch.n_tokens) {
        return;
    }
    uint64_t held = 0;
    for (const auto s : in_batch) {
        const uint32_t n = (uint32_t) (v_cells[0].seq_pos_max(s) + 1);
        const uint32_t sink_cells = sink_blocks*B;
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
    const uint32_t per = (sink_blocks + recent_blocks + 2)*kp.block + std::max<uint32_t>(kp.block, kp.gen_reserve);
    return std::max<uint32_t>(1, get_size()/per);
}

uint32_t llama_kvmem_cache::max_ubatch(uint32_t n_ubatch) const {
    const uint32_t size = get_size();
    const uint32_t keep = (sink_blocks + 1)*kp.block;
    return std::max<uint32_t>(1, std::min<uint32_t>(n_ubatch, size > keep ? size - keep : 1));
}

bool llama_kvmem_cache::may_stage(uint32_t n_new) const {
    for (const auto & [s, st] : seqs) {
        for (const auto & [b, hb] : st.blocks) {
            if (!hb.resident) {
                return true;
            }
        }
    }
    return v_cells[0].get_used() + n_new > v_cells[0].size();
}

uint32_t llama_kvmem_cache::n_resident(const seq_state & st) const {
    uint32_t n = 0;
    for (const auto & [b, hb] : st.blocks) {
        n += hb.resident ? 1 : 0;
    }
    return n;
}

uint32_t llama_kvmem_cache::share_blocks(llama_seq_id seq_id) const {
    // parallel sequences share the budget: each active one gets an equal part
    uint32_t n_active = 1;
    for (const auto & [s, st] : seqs) {
        if (s != seq_id && active(st)) {
            n_active++;
        }
    }
    return std::max<uint32_t>(sink_blocks + recent_blocks + 2, budget_blocks/n_active);
}

bool llama_kvmem_cache::protected_block(const seq_state & st, int32_t b) const {
    if ((uint32_t) b < sink_blocks) {
        return true;
    }
    if (st.phase != PHASE_GEN) {
        return false; // a prompt keeps its newest blocks by evicting oldest first
    }
    const int32_t B = kp.block;
    if (st.q0 >= 0 && b >= st.q0/B && b <= (st.q1 - 1)/B) {
        return true; // the question of the turn being answered
    }
    if (st.blocks.empty()) {
        return false;
    }
    return b > st.blocks.rbegin()->first - (int32_t) recent_blocks;
}

void llama_kvmem_cache::evict_block(llama_seq_id seq_id, int32_t b, hblock & hb) {
    // the block's own cells (found through the sequence's position map), not a scan of the whole working set
    std::vector<uint32_t> idx = block_cells(seq_id, b);
    auto & cells = v_cells[0];
    auto & head  = v_heads[0];
    for (const uint32_t i : idx) {
        if (cells.seq_rm(i, seq_id) && i < head) {
            head = i;
        }
    }
    if (journal) {
        journal->evicted.push_back({ { seq_id, b }, std::move(idx) });
    }
    hb.resident = false;
    hb.picked   = false;
}

bool llama_kvmem_cache::evict_one(llama_seq_id for_seq) {
    // ranks, lowest evicted first: (tier, key). Tiers: 0 idle sequences' blocks, 1 own ordinary blocks,
    // 2 own picks, 3 another active sequence's ordinary blocks beyond its share, 4 its picks beyond its share,
    // 5 (last resort, parallel prompts that together outgrow the working set) the blocks of another sequence
    // that is reading a prompt, within its share: its prefill window shrinks instead of the batch failing; its
    // turn re-selects from the host pool. Ordinary blocks go oldest first, picks lowest score first. Protected
    // blocks (sinks; during generation the question and the newest blocks) never go.
    // A follower (MTP draft) keeps the blocks its target has resident until last.
    struct cand { int tier; double key; llama_seq_id s; int32_t b; };
    bool found = false;
    cand best = { INT_MAX, 0.0, -1, -1 };
    for (auto & [s, st] : seqs) {
        const bool own = s == for_seq;
        const bool idle = !active(st);
        bool squeeze = false;
        if (!own && !idle && n_resident(st) <= share_blocks(s)) {
            if (st.phase != PHASE_PROMPT || leader) {
                continue;
            }
            squeeze = true;
        }
        for (auto & [b, hb] : st.blocks) {
            if (!hb.resident || (uint32_t) b < sink_blocks || (!idle && protected_block(st, b))) {
                continue;
            }
            int tier = squeeze ? 5 : idle ? 0 : (own ? 1 : 3) + (hb.picked ? 1 : 0);
            if (leader && resident_in_leader(s, b)) {
                tier += 10;
            }
            const double key = hb.picked && !idle ? (double) hb.score : (double) b;
            const cand c = { tier, key, s, b };
            if (!found || c.tier < best.tier || (c.tier == best.tier && c.key < best.key)) {
                best = c;
                found = true;
            }
        }
    }
    if (!found) {
        return false;
    }
    auto & victim = seqs[best.s];
    if (best.tier == 5 && !victim.squeezed) {
        victim.squeezed = true; // once per prompt: the user learns why that slot's prefill saw less
        LLAMA_LOG_WARN("kvmem: parallel prompts outgrow the working set: seq %d reads its prompt with less than its share "
                "of --kvmem-budget to make room for seq %d (its turn still selects from the whole history; a larger "
                "--kvmem-budget keeps full prefill windows)\n", best.s, for_seq);
    }
    evict_block(best.s, best.b, victim.blocks[best.b]);
    n_evicted++;
    if (kp.trace) {
        LLAMA_LOG_WARN("kvmem_trace: evict seq=%d block=%d tier=%d for_seq=%d\n", best.s, best.b, best.tier, for_seq);
    }
    return true;
}

llama_kv_cache::slot_info llama_kvmem_cache::place(const llama_ubatch & ubatch) const {
    // the lowest free cells, in order: where a token lands depends only on which cells are free, not on how many
    // tokens share its ubatch (upstream's search start depends on the ubatch size). A verification batch of k
    // tokens so takes the cells k one-token decodes would, and attention sums over the same cell order.
    const auto & cells = v_cells[0];
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
    copies_wait();

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
        bool evicted = false;
        for (const auto & [c, s] : order) {
            if ((evicted = evict_one(s))) {
                break;
            }
        }
        if (!evicted) {
            for (const auto & [s, st] : seqs) {
                uint32_t prot = 0;
                for (const auto & [b, hb] : st.blocks) {
                    prot += hb.resident && protected_block(st, b) ? 1 : 0;
                }
                LLAMA_LOG_WARN("kvmem: seq %d phase=%d active=%d resident=%u protected=%u share=%u cells=%d..%d\n", s, (int) st.phase,
                        (int) active(st), n_resident(st), prot, share_blocks(s), v_cells[0].seq_pos_min(s), v_cells[0].seq_pos_max(s));
            }
            LLAMA_LOG_WARN("kvmem: used %u of %u cells\n", v_cells[0].get_used(), get_size());
            const std::string msg = format("KV tiering: no room for a ubatch of %u tokens in the GPU working set of %u cells "
                    "(raise --kvmem-budget or --kvmem-gen-reserve, or use fewer parallel slots)", ubatch.n_tokens, get_size());
            LLAMA_LOG_ERROR("%s: %s\n", __func__, msg.c_str());
            set_last_error(msg);
            return false;
        }
    }
}

//
// the life of a sequence: prompt batches, the turn, generation
//

kvmem_batch_kind llama_kvmem_cache::begin_batch(llama_seq_id seq_id, uint32_t n, uint32_t n_out, bool last_out, llama_pos p0) {
    auto & st = seqs[seq_id];
    st.released = false;
    kvmem_batch_kind kind = KVMEM_BATCH_GEN;
    if (n_out == 0) {
        kind = KVMEM_BATCH_PROMPT;
    } else if (n_out == 1 && last_out && (n >= 2 || st.phase == PHASE_PROMPT)) {
        kind = KVMEM_BATCH_TURN; // a prompt's end, however few tokens its last batch has
    }
    if (kind != KVMEM_BATCH_GEN && st.phase != PHASE_PROMPT && app_marks_prompts && !st.prompt_mark) {
        // the application marks its prompts (llama-server does): an unmarked multi-token batch during
        // generation is not a new prompt but e.g. a draft context catching up with the accepted tokens
        kind = KVMEM_BATCH_GEN;
    }
    if (kind != KVMEM_BATCH_GEN && st.phase != PHASE_PROMPT) {
        end_turn(st);
        st.phase       = PHASE_PROMPT;
        st.squeezed    = false;
        st.prompt_p0   = p0;
        st.prompt_mark = false;
        if (kp.prefill == LLAMA_KVMEM_PREFILL_RETRIEVAL && scorer->scores()) {
            st.next_prefill = p0; // the first prompt batch already selects with the rows the sequence has
        }
    }
    if (kind == KVMEM_BATCH_GEN && st.phase != PHASE_GEN) {
        st.phase = PHASE_GEN; // e.g. generation resumed without a new prompt
    }
    return kind;
}

void llama_kvmem_cache::end_turn(seq_state & st) {
    // picks of a finished turn are ordinary blocks now (evicted oldest first by the next prompt)
    for (auto & [b, hb] : st.blocks) {
        hb.picked = false;
        hb.score  = 0.0f;
    }
    st.events.clear();
    st.next_event   = -1;
    st.next_is_room = false;
    st.next_prefill = -1;
    st.q0 = st.q1 = -1;
    st.turn_q.clear();
    st.turn_q_pos.clear();
    st.turn_tok.clear();
}

void llama_kvmem_cache::remember_tokens(llama_seq_id seq_id, const std::vector<std::pair<std::array<llama_pos, 4>, llama_token>> & toks) {
    auto & st = seqs[seq_id];
    for (const auto & t : toks) {
        while (!st.toks.empty() && st.toks.back().first[0] >= t.first[0]) {
            st.toks.pop_back(); // re-decoded positions (a truncation happened)
        }
        st.toks.push_back(t);
    }
    if (st.toks.empty()) {
        return;
    }
    llama_pos keep = st.toks.back().first[0] - (llama_pos) (kp.query_tokens + KVMEM_TOKEN_SLACK);
    if (!st.snaps.empty()) {
        keep = std::min(keep, st.snaps.front().first);
    }
    while (!st.toks.empty() && st.toks.front().first[0] < keep) {
        st.toks.pop_front();
    }
}

std::vector<std::pair<std::array<llama_pos, 4>, llama_token>> llama_kvmem_cache::tokens_from(llama_seq_id seq_id, llama_pos p0) const {
    std::vector<std::pair<std::array<llama_pos, 4>, llama_token>> out;
    const auto it = seqs.find(seq_id);
    if (it == seqs.end() || it->second.toks.empty() || it->second.toks.front().first[0] > p0) {
        return out;
    }
    llama_pos expect = p0;
    for (const auto & t : it->second.toks) {
        if (t.first[0] < p0) {
            continue;
        }
        if (t.first[0] != expect) {
            return {}; // a gap: not recomputable
        }
        out.push_back(t);
        expect++;
    }
    return out;
}

void llama_kvmem_cache::push_snapshot(llama_seq_id seq_id, llama_pos pos, std::vector<uint8_t> && data) {
    auto & snaps = seqs[seq_id].snaps;
    while (!snaps.empty() && snaps.back().first >= pos) {
        snaps.pop_back();
    }
    snaps.emplace_back(pos, std::move(data));
    while (snaps.size() > 2) { // the batch the query span starts in is one of the last two prompt batches
        snaps.pop_front();
    }
}

const std::vector<uint8_t> * llama_kvmem_cache::snapshot_at(llama_seq_id seq_id, llama_pos pos, llama_pos * at) const {
    const auto it = seqs.find(seq_id);
    if (it == seqs.end()) {
        return nullptr;
    }
    for (auto s = it->second.snaps.rbegin(); s != it->second.snaps.rend(); ++s) {
        if (s->first <= pos) {
            *at = s->first;
            return &s->second;
        }
    }
    return nullptr;
}

void llama_kvmem_cache::set_query_span(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    auto & st = seqs[seq_id];
    app_marks_prompts = true;
    st.prompt_mark = st.phase != PHASE_PROMPT; // a call inside a prompt (its next batch) marks nothing new
    st.hint_p0 = p0 >= 0 && p1 > p0 ? p0 : -1;
    st.hint_p1 = p0 >= 0 && p1 > p0 ? p1 : -1;
}

void llama_kvmem_cache::release_seq(llama_seq_id seq_id) {
    const auto it = seqs.find(seq_id);
    if (it != seqs.end()) {
        it->second.released = true; // its blocks stay (a later prompt may reuse them) but others may take the cells
        publish();
    }
}

void llama_kvmem_cache::turn_query_span(llama_seq_id seq_id, llama_pos end, llama_pos & p0, llama_pos & p1) const {
    const auto it = seqs.find(seq_id);
    p0 = p1 = end;
    if (it == seqs.end() || end <= 0) {
        return;
    }
    const auto & st = it->second;
    const llama_pos n_q = (llama_pos) kp.query_tokens;
    if (st.hint_p0 >= 0 && st.hint_p0 < end) {
        // from the last user message to the prompt's end (a tool result after it included), its last
        // query_tokens tokens: a short question after a long history is only the question
        p1 = end;
        p0 = std::max(st.hint_p0, end - n_q);
    } else {
        p1 = end;
        p0 = std::max<llama_pos>(0, end - n_q);
    }
}

llama_pos llama_kvmem_cache::event_pos(llama_seq_id seq_id) const {
    const auto it = seqs.find(seq_id);
    return it == seqs.end() || leader || it->second.phase != PHASE_GEN ? -1 : it->second.next_event;
}

const char * llama_kvmem_cache::event_reason(llama_seq_id seq_id) const {
    const auto it = seqs.find(seq_id);
    return it != seqs.end() && it->second.next_is_room ? "room" : "refresh";
}

llama_pos llama_kvmem_cache::prefill_step() const {
    // a quarter of the budget (at most 2048 tokens), whole blocks: a prompt selects about four times per budget
    const uint32_t B = kp.block;
    return (llama_pos) std::max<uint32_t>(B, (std::min<uint32_t>(2048, kp.budget/4)/B)*B);
}

llama_pos llama_kvmem_cache::prefill_pos(llama_seq_id seq_id) const {
    const auto it = seqs.find(seq_id);
    return it == seqs.end() || leader || it->second.phase != PHASE_PROMPT ? -1 : it->second.next_prefill;
}

//
// selection
//

void llama_kvmem_cache::query_rows(const seq_state & st, std::vector<float> & rows, uint32_t & n_rows) const {
    const size_t per = dims.query_row();
    rows.clear();
    n_rows = 0;
    auto add = [&](const std::vector<float> & r) {
        rows.insert(rows.end(), r.begin(), r.end());
        n_rows++;
    };
    if (st.phase == PHASE_PROMPT && st.q0 < 0) {
        // inside a prompt (retrieval prefill): the newest rows of the prompt so far
        const uint32_t want = std::min<uint32_t>(kp.query_tokens, 64);
        auto it = st.qrow.rbegin();
        std::vector<const std::vector<float> *> picked;
        for (; it != st.qrow.rend() && picked.size() < want; ++it) {
            picked.push_back(&it->second);
        }
        for (auto p = picked.rbegin(); p != picked.rend(); ++p) {
            add(**p);
        }
        return;
    }
    // the question (the turn's rows), then during generation the newest generated tokens' rows
    rows = st.turn_q;
    n_rows = (uint32_t) (st.turn_q.size()/std::max<size_t>(per, 1));
    if (st.phase == PHASE_GEN && st.turn_pos >= 0) {
        const uint32_t want = std::max<uint32_t>(1, kp.query_tokens/2);
        std::vector<const std::vector<float> *> picked;
        for (auto it = st.qrow.rbegin(); it != st.qrow.rend() && it->first >= st.turn_pos && picked.size() < want; ++it) {
            picked.push_back(&it->second);
        }
        for (auto p = picked.rbegin(); p != picked.rend(); ++p) {
            add(**p);
        }
    }
}

std::vector<std::pair<float, int32_t>> llama_kvmem_cache::lexical_rank(const seq_state & st, const std::set<int32_t> & exclude) const {
    std::unordered_map<llama_token, uint32_t> qidx; // the question's distinct tokens, each with its largest weight
    std::vector<float> qw;
    for (const auto & [t, w] : st.turn_tok) {
        const auto it = qidx.emplace(t, (uint32_t) qidx.size());
        if (it.second) {
            qw.push_back(w);
        } else {
            qw[it.first->second] = std::max(qw[it.first->second], w);
        }
    }
    const size_t nq = qidx.size();
    std::vector<uint32_t> df(nq, 0);
    std::vector<std::pair<int32_t, std::vector<uint16_t>>> tf; // candidate blocks' term counts
    uint32_t n_docs = 0;
    std::vector<uint16_t> cnt(nq);
    for (const auto & [b, toks] : st.btok) {
        if (!st.blocks.count(b)) {
            continue; // the open block, or a block not on the host
        }
        n_docs++;
        std::fill(cnt.begin(), cnt.end(), 0);
        for (const auto t : toks) {
            const auto it = t >= 0 ? qidx.find(t) : qidx.end();
            if (it != qidx.end() && cnt[it->second] < UINT16_MAX) {
                cnt[it->second]++;
            }
        }
        for (size_t j = 0; j < nq; ++j) {
            df[j] += cnt[j] > 0 ? 1 : 0;
        }
        if (!exclude.count(b)) {
            tf.push_back({ b, cnt });
        }
    }
    std::vector<std::pair<float, int32_t>> out;
    if (tf.size() < 2) {
        return out;
    }
    const float k1 = 1.2f;
    std::vector<float> idf(nq);
    for (size_t j = 0; j < nq; ++j) {
        idf[j] = qw[j]*std::log(1.0f + (n_docs - df[j] + 0.5f)/(df[j] + 0.5f));
    }
    // a block is a lexical candidate only if it holds a rare word (in at most a tenth of the blocks) from near the
    // question's end: common words alone rank blocks by noise
    const uint32_t rare_df = std::max<uint32_t>(1, n_docs/10);
    double sum = 0.0, sum2 = 0.0;
    std::vector<char> rare;
    for (const auto & [b, c] : tf) {
        float sc = 0.0f;
        bool has_rare = false;
        for (size_t j = 0; j < nq; ++j) {
            sc += c[j] ? idf[j]*c[j]*(k1 + 1.0f)/(c[j] + k1) : 0.0f;
            has_rare = has_rare || (c[j] > 0 && df[j] <= rare_df && qw[j] >= 0.25f);
        }
        out.push_back({ sc, b });
        rare.push_back(has_rare);
        sum += sc;
        sum2 += (double) sc*sc;
    }
    for (size_t i = 0; i < out.size(); ++i) {
        out[i].first = rare[i] ? out[i].first : -1.0f;
    }
    const double mean = sum/out.size();
    const double sd = std::sqrt(std::max(0.0, sum2/out.size() - mean*mean));
    const float bar = (float) (mean + 2.0*sd);
    out.erase(std::remove_if(out.begin(), out.end(), [&](const auto & e) { return e.first <= bar || e.first <= 0.0f; }), out.end());
    std::stable_sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    return out;
}

std::set<int32_t> llama_kvmem_cache::plan_target(llama_seq_id seq_id, seq_state & st, const char * reason,
        std::map<int32_t, float> & picks, uint32_t & n_sink, uint32_t & n_question, uint32_t & n_recent, uint32_t & n_rows,
        uint32_t & n_lex) {
    const int32_t B = kp.block;
    const uint32_t share = std::min(budget_blocks, share_blocks(seq_id));
    const uint32_t avail = share - 1; // one block of the share is the partial tail
    std::set<int32_t> target;
    n_sink = n_question = n_recent = n_rows = n_lex = 0;

    for (auto & [b, hb] : st.blocks) {
        if ((uint32_t) b < sink_blocks && target.size() < avail) {
            target.insert(b);
            n_sink++;
        }
    }
    // the question (the last user message) stays: newest blocks of it first
    if (st.q0 >= 0) {
        for (int32_t b = (st.q1 - 1)/B; b >= st.q0/B && target.size() < avail; --b) {
            if (st.blocks.count(b) && target.insert(b).second) {
                n_question++;
            }
        }
    }
    // the newest blocks (those the question already covers count: the window does not grow past them)
    for (auto bit = st.blocks.rbegin(); bit != st.blocks.rend() && n_recent < recent_blocks && target.size() < avail; ++bit) {
        target.insert(bit->first);
        n_recent++;
    }

    std::vector<std::pair<float, int32_t>> ranked;
    if (scorer->scores()) {
        std::vector<float> q;
        query_rows(st, q, n_rows);
        if (n_rows > 0) {
            std::vector<const float *> sums;
            std::vector<char> cand;
            std::vector<int32_t> ids;
            for (auto & [b, hb] : st.blocks) {
                const auto sit = st.summ.find(b);
                ids.push_back(b);
                sums.push_back(sit == st.summ.end() ? nullptr : sit->second.data());
                cand.push_back(!target.count(b) && sit != st.summ.end());
            }
            std::vector<float> scores;
            scorer->score(sums, cand, q.data(), n_rows, scores);
            for (size_t i = 0; i < ids.size(); ++i) {
                if (cand[i]) {
                    ranked.push_back({ scores[i], ids[i] });
                }
            }
            std::stable_sort(ranked.begin(), ranked.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
        }
    }
    if (ranked.empty()) {
        // recency (or nothing to score with yet): extend the recent window
        for (auto bit = st.blocks.rbegin(); bit != st.blocks.rend(); ++bit) {
            if (!target.count(bit->first)) {
                ranked.push_back({ 0.0f, bit->first });
            }
        }
    }
    // hybrid: every other pick is the next block that shares the question's rare words (attention first), so a
    // fact the question names is kept even where the model's attention from the question points elsewhere
    std::vector<std::pair<float, int32_t>> lex;
    if (scorer->lexical() && n_rows > 0 && !st.turn_tok.empty()) {
        lex = lexical_rank(st, target);
    }
    // inside a prompt (retrieval prefill) the picks take at most half: the newest blocks are the other half
    const size_t cap = std::strcmp(reason, "prefill") == 0 ? target.size() + (avail - std::min<size_t>(avail, target.size()))/2 : avail;
    std::map<int32_t, float> att;
    for (const auto & [score, b] : ranked) {
        att[b] = score;
    }
    size_t ia = 0, il = 0, n_order = 0;
    bool lex_turn = false;
    while (target.size() < cap && (ia < ranked.size() || il < lex.size())) {
        const bool from_lex = il < lex.size() && (lex_turn || ia >= ranked.size());
        const int32_t b = from_lex ? lex[il++].second : ranked[ia++].second;
        if (target.count(b)) {
            continue;
        }
        lex_turn = !from_lex;
        target.insert(b);
        n_lex += from_lex ? 1 : 0;
        if (scorer->scores() && n_rows > 0) {
            // picks leave lowest first under pressure: attention score, or for hybrid the merged order
            const float prio = scorer->lexical() ? (float) (ranked.size() + lex.size() - n_order++) : att[b];
            picks[b] = prio;
            if (kp.trace) {
                LLAMA_LOG_WARN("kvmem_trace: pick seq=%d block=%d score=%.4f lexical=%d\n", seq_id, b, att.count(b) ? att[b] : 0.0f,
                        (int) from_lex);
            }
        }
    }
    return target;
}

void llama_kvmem_cache::apply_target(llama_seq_id seq_id, seq_state & st, const std::set<int32_t> & target,
        uint32_t & staged_in, uint32_t & staged_out, uint32_t & reused) {
    // plan as a diff: resident blocks in the target stay, others leave, missing ones come in
    staged_in = staged_out = reused = 0;
    for (auto & [b, hb] : st.blocks) {
        if (hb.resident && !target.count(b)) {
            evict_block(seq_id, b, hb);
            staged_out++;
        }
    }
    for (auto & [b, hb] : st.blocks) {
        if (!target.count(b)) {
            continue;
        }
        if (hb.resident) {
            reused++;
            continue;
        }
        bool ok = stage_in(seq_id, b, hb);
        while (!ok && evict_one(seq_id)) {
            ok = stage_in(seq_id, b, hb);
        }
        if (!ok) {
            LLAMA_LOG_WARN("%s: kvmem: no free cells to stage in block %d of seq %d\n", __func__, b, seq_id);
            break;
        }
        staged_in++;
    }
}

bool llama_kvmem_cache::select(llama_seq_id seq_id, const char * reason) {
    auto it = seqs.find(seq_id);
    if (it == seqs.end()) {
        return false;
    }
    auto & st = it->second;
    const bool is_turn = std::strcmp(reason, "turn") == 0;
    const bool is_prefill = std::strcmp(reason, "prefill") == 0;
    const llama_pos pos = v_cells[0].seq_pos_max(seq_id) + 1;
    const size_t per_q = dims.query_row();

    if (is_turn) {
        // the question: the span of the last user message (its end), whose query rows form the turn's query
        turn_query_span(seq_id, pos, st.q0, st.q1);
        st.turn_q.clear();
        st.turn_q_pos.clear();
        for (auto r = st.qrow.lower_bound(st.q0); r != st.qrow.end() && r->first < st.q1; ++r) {
            if (r->second.size() == per_q) {
                st.turn_q.insert(st.turn_q.end(), r->second.begin(), r->second.end());
                st.turn_q_pos.push_back(r->first);
            }
        }
        st.turn_tok.clear();
        for (llama_pos qp = std::max<llama_pos>(0, st.q0); qp < st.q1; ++qp) {
            const auto bt = st.btok.find(qp/kp.block);
            if (bt != st.btok.end() && bt->second[qp % kp.block] >= 0) {
                // half the weight every KVMEM_LEX_HALF tokens before the end of the question
                const float w = std::pow(0.5f, (float) (st.q1 - 1 - qp)/KVMEM_LEX_HALF);
                st.turn_tok.push_back({ bt->second[qp % kp.block], w });
            }
        }
        st.turn_pos = pos;
        st.phase    = PHASE_GEN;
        st.hint_p0  = st.hint_p1 = -1; // a hint is for one prompt
        st.events.clear();
    }
    if (st.blocks.empty()) {
        if (is_turn) {
            schedule_event(seq_id, st, pos);
        }
        return false;
    }
    const int64_t t_start = ggml_time_us();

    gen_event ev;
    const bool undoable = !is_turn && !is_prefill;
    if (undoable) {
        ev.pos = pos;
        ev.room = std::strcmp(reason, "room") == 0;
        ev.stage_hint = stage_hint;
        for (const auto & [b, hb] : st.blocks) {
            if (hb.picked) {
                ev.picks_before[b] = hb.score;
            }
        }
        journal = &ev;
    }

    std::map<int32_t, float> picks;
    uint32_t n_sink = 0, n_question = 0, n_recent = 0, n_rows = 0, n_lex = 0;
    const std::set<int32_t> target = plan_target(seq_id, st, reason, picks, n_sink, n_question, n_recent, n_rows, n_lex);

    const int64_t t_stage = ggml_time_us();
    uint32_t staged_in = 0, staged_out = 0, reused = 0;
    apply_target(seq_id, st, target, staged_in, staged_out, reused);
    journal = nullptr;
    for (auto & [b, hb] : st.blocks) {
        const auto p = picks.find(b);
        hb.picked = p != picks.end() && hb.resident;
        hb.score  = hb.picked ? p->second : 0.0f;
    }
    copies_wait();
    const double stage_ms = (ggml_time_us() - t_stage)/1000.0;

    for (auto * f : followers) {
        f->follow_leader();
    }

    if (undoable) {
        st.events.push_back(std::move(ev));
    }
    if (is_prefill) {
        st.next_prefill = pos + prefill_step();
    } else {
        schedule_event(seq_id, st, pos);
    }

    const double ms = (ggml_time_us() - t_start)/1000.0;
    st.n_select++;
    st.last_ms = ms;
    n_selections++;
    n_staged_in  += staged_in;
    n_staged_out += staged_out;
    last_select_ms = ms;

    const int32_t n_blocks = st.blocks.rbegin()->first + 1;
    LLAMA_LOG_WARN("kvmem_score: SELECT seq=%d n_blocks=%d budget_blocks=%u share=%u sink=%u recent=%u scored=%zu staged_in=%u "
            "staged_out=%u reused=%u query_tokens=%u ms=%.3f stage_ms=%.3f stage_mib=%.1f reason=%s pos=%d question=%u method=%s lexical=%u\n",
            seq_id, n_blocks, budget_blocks, std::min(budget_blocks, share_blocks(seq_id)), n_sink, n_recent, picks.size(), staged_in,
            staged_out, reused, n_rows, ms, stage_ms, (double) staged_in*ws_block_bytes/1024.0/1024.0, reason, pos, n_question,
            kvmem_scorer::method_name(scorer->method()), n_lex);
    if (kp.trace) {
        trace_resident(seq_id, st, pos, reason);
    }
    publish();

    return staged_in > 0;
}

void llama_kvmem_cache::schedule_event(llama_seq_id seq_id, seq_state & st, llama_pos pos) {
    // the next re-selection during generation: every --kvmem-refresh tokens, or earlier when the
    // sequence's cells (its share of the budget + the reserve) would run out. A position, not a
    // count of decodes: speculative batches are split there (see llama-kvmem-decode.cpp)
    const int32_t B = kp.block;
    const uint32_t share = std::min(budget_blocks, share_blocks(seq_id));
    const int64_t allowance = (int64_t) share*B + kp.gen_reserve;
    const int64_t used = (int64_t) n_resident(st)*B + pos % B;
    const int64_t room = std::max<int64_t>(1, allowance - used); // the cells left before the sequence's part is full
    const int64_t every = kp.refresh > 0 ? (int64_t) kp.refresh : std::numeric_limits<int32_t>::max();
    st.next_is_room = room < every;
    st.next_event = (llama_pos) std::min<int64_t>(pos + std::min(every, room), POS_END - 1);
}

void llama_kvmem_cache::undo_events(llama_seq_id seq_id, seq_state & st, llama_pos p0) {
    // a truncation below a re-selection's position (a rejected speculative draft): one-token decoding
    // would not have re-selected yet, so the working set goes back to what it was before, cell for cell
    bool undone = false;
    while (!st.events.empty() && st.events.back().pos >= p0) {
        gen_event ev = std::move(st.events.back());
        st.events.pop_back();
        uint32_t back_in = 0, back_out = 0;
        for (auto it = ev.staged.rbegin(); it != ev.staged.rend(); ++it) {
            auto & blocks = seqs[it->first].blocks;
            const auto bit = blocks.find(it->second);
            if (bit != blocks.end() && bit->second.resident) {
                evict_block(it->first, it->second, bit->second);
                back_out++;
            }
        }
        for (auto it = ev.evicted.rbegin(); it != ev.evicted.rend(); ++it) {
            const auto [s, b] = it->first;
            auto & blocks = seqs[s].blocks;
            const auto bit = blocks.find(b);
            if (bit == blocks.end() || bit->second.resident) {
                continue; // dropped by the truncation itself, or already back
            }
            if (!stage_in_at(s, b, bit->second, it->second) && !stage_in(s, b, bit->second)) {
                LLAMA_LOG_WARN("%s: kvmem: could not put block %d of seq %d back\n", __func__, b, s);
                continue;
            }
            back_in++;
        }
        for (auto & [b, hb] : st.blocks) {
            const auto p = ev.picks_before.find(b);
            hb.picked = p != ev.picks_before.end() && hb.resident;
            hb.score  = hb.picked ? p->second : 0.0f;
        }
        stage_hint      = ev.stage_hint;
        st.next_event   = ev.pos;
        st.next_is_room = ev.room;
        n_staged_in  += back_in;
        n_staged_out += back_out;
        undone = true;
        if (kp.trace) {
            LLAMA_LOG_WARN("kvmem_trace: undo seq=%d pos=%d staged_in=%u staged_out=%u\n", seq_id, ev.pos, back_in, back_out);
        }
    }
    if (undone) {
        copies_wait();
        for (auto * f : followers) {
            f->follow_leader();
        }
    }
}

void llama_kvmem_cache::trace_resident(llama_seq_id seq_id, const seq_state & st, llama_pos pos, const char * reason) const {
    std::string ranges;
    int32_t start = -1, prev = -1;
    auto flush = [&]() {
        if (start < 0) {
            return;
        }
        if (!ranges.empty()) {
            ranges += ",";
        }
        ranges += start == prev ? std::to_string(start) : std::to_string(start) + "-" + std::to_string(prev);
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
    LLAMA_LOG_WARN("kvmem_trace: resident seq=%d pos=%d reason=%s layers=%u blocks=%s\n", seq_id, pos, reason, n_lt, ranges.c_str());
}

//
// memory operations
//

void llama_kvmem_cache::drop_host_blocks(llama_seq_id seq_id, int32_t b0) {
    auto it = seqs.find(seq_id);
    if (it == seqs.end()) {
        return;
    }
    auto & st = it->second;
    for (auto bit = st.blocks.lower_bound(b0); bit != st.blocks.end(); ) {
        free_slots.push_back(bit->second.slot);
        bit = st.blocks.erase(bit);
    }
    st.next_host = std::min(st.next_host, b0);
}

void llama_kvmem_cache::clear(bool data) {
    llama_kv_cache::clear(data);
    for (auto & [s, st] : seqs) {
        for (auto & [b, hb] : st.blocks) {
            free_slots.push_back(hb.slot);
        }
    }
    seqs.clear();
    publish();
}

bool llama_kvmem_cache::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    const bool ok = seq_rm_impl(seq_id, p0, p1);
    publish();
    return ok;
}

bool llama_kvmem_cache::seq_rm_impl(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (p0 < 0) {
        p0 = 0;
    }
    if (p1 < 0) {
        p1 = POS_END;
    }
    const int32_t B = kp.block;

    if (seq_id < 0) {
        std::vector<llama_seq_id> ids;
        for (auto & [s, st] : seqs) {
            ids.push_back(s);
        }
        bool ok = true;
        for (auto s : ids) {
            ok = seq_rm_impl(s, p0, p1) && ok;
        }
        return llama_kv_cache::seq_rm(seq_id, p0, p1) && ok;
    }

    auto it = seqs.find(seq_id);
    if (it == seqs.end()) {
        return llama_kv_cache::seq_rm(seq_id, p0, p1);
    }
    auto & st = it->second;

    if (p0 == 0 && p1 == POS_END) {
        const bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1);
        drop_host_blocks(seq_id, 0);
        seqs.erase(it);
        return ok;
    }

    if (p1 != POS_END) {
        // a hole in the middle (not produced by the server with shifting off): drop the touched host blocks
        const bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1);
        forget_from(st, p0, p1);
        for (int32_t b = p0/B; b <= (p1 - 1)/B; ++b) {
            auto bit = st.blocks.find(b);
            if (bit != st.blocks.end()) {
                free_slots.push_back(bit->second.slot);
                st.blocks.erase(bit);
            }
        }
        return ok;
    }

    // truncation [p0, inf): re-selections at or after p0 are undone (a rejected draft), then the last kept
    // position p0-1 must be in the working set, so that the next batch (starting at p0) is consistent
    // with seq_pos_max
    if (!in_redecode) {
        undo_events(seq_id, st, p0);
        if (st.turn_pos >= 0 && p0 < st.turn_pos) {
            st.turn_pos = -1; // the prompt itself is cut: what follows is a new prompt
            st.phase = PHASE_IDLE;
        }
    }
    if (p0 > 0) {
        const int32_t bl = (p0 - 1)/B;
        auto bit = st.blocks.find(bl);
        if (bit != st.blocks.end() && !bit->second.resident) {
            bool staged = stage_in(seq_id, bl, bit->second);
            while (!staged && evict_one(seq_id)) {
                staged = stage_in(seq_id, bl, bit->second);
            }
            copies_wait();
            if (!staged) {
                LLAMA_LOG_WARN("%s: kvmem: could not bring back block %d of seq %d\n", __func__, bl, seq_id);
            }
        }
    }
    const bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1);
    drop_host_blocks(seq_id, p0/B);
    if (in_redecode) {
        // a turn's query span is recomputed: the same tokens come back, summaries are rebuilt where they can be
        forget_from(st, p0, POS_END, /*keep_summaries*/ true);
        return ok;
    }
    // the cut block's summary is rebuilt from the kept key rows when the block completes again
    forget_from(st, p0, POS_END);
    while (!st.toks.empty() && st.toks.back().first[0] >= p0) {
        st.toks.pop_back();
    }
    while (!st.snaps.empty() && st.snaps.back().first > p0) {
        st.snaps.pop_back();
    }
    return ok;
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

void llama_kvmem_cache::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    // a restored state is only the working set that was saved; host blocks of the sequence are forgotten
    if (seq_id < 0) {
        for (auto & [s, st] : seqs) {
            drop_host_blocks(s, 0);
        }
        seqs.clear();
    } else {
        drop_host_blocks(seq_id, 0);
        seqs.erase(seq_id);
    }
    llama_kv_cache::state_read(io, seq_id, flags);
    publish();
}

void llama_kvmem_cache::forget_from(seq_state & st, llama_pos p0, llama_pos p1, bool keep_summaries) {
    const int32_t B = kp.block;
    for (auto it = st.btok.lower_bound(p0/B); it != st.btok.end() && (p1 == POS_END || it->first*B < p1); ) {
        for (llama_pos p = std::max(p0, it->first*B); p < std::min<llama_pos>(p1, (it->first + 1)*B); ++p) {
            it->second[p - it->first*B] = -1;
        }
        it = it->first*B >= p0 && p1 == POS_END ? st.btok.erase(it) : std::next(it);
    }
    st.krow.erase(st.krow.lower_bound(p0), st.krow.lower_bound(p1));
    st.qrow.erase(st.qrow.lower_bound(p0), st.qrow.lower_bound(p1));
    if (keep_summaries) {
        return;
    }
    // the block the cut falls in keeps its old summary aside, if its first tokens' rows are gone
    const int32_t b0 = p0/B;
    const auto sit = st.summ.find(b0);
    if (p1 == POS_END && p0 % B != 0 && sit != st.summ.end() && st.krow.find(b0*B) == st.krow.end()) {
        st.stale[b0] = { sit->second, (uint32_t) (p0 - b0*B) };
    }
    st.stale.erase(st.stale.upper_bound(b0), st.stale.end());
    const int32_t b1 = p1 == POS_END ? std::numeric_limits<int32_t>::max() : (p1 - 1)/B + 1;
    st.summ.erase(st.summ.lower_bound(p0/B), st.summ.lower_bound(b1));
}

//
// after a ubatch: summaries, query rows, write-through
//

void llama_kvmem_cache::build_summary(seq_state & st, int32_t b,
        const std::function<const float * (llama_pos, uint32_t)> & key_row) {
    // key_row(pos, lt): the layer lt part of the key row of position pos (nullptr when not captured). A block is
    // summarized when its last token has been computed; rows missing at its start are those of a block cut by a
    // truncation deep in the history, whose old summary fills in for the tokens that did not change
    const int32_t B = kp.block;
    const size_t per = (size_t) n_head_kv*head_dim;
    if (!key_row((b + 1)*B - 1, 0)) {
        return; // not complete (yet)
    }
    const auto stale = st.stale.find(b);
    std::vector<float> rows((size_t) B*dims.key_row());
    std::vector<char> known(B, 1);
    for (int32_t t = 0; t < B; ++t) {
        if (!key_row(b*B + t, 0)) {
            known[t] = 0;
            continue;
        }
        for (uint32_t lt = 0; lt < n_lt; ++lt) {
            std::memcpy(rows.data() + ((size_t) t*n_lt + lt)*per, key_row(b*B + t, lt), per*sizeof(float));
        }
    }
    const bool complete = std::all_of(known.begin(), known.end(), [](char k) { return k != 0; });
    if (!complete && stale == st.stale.end()) {
        return; // rows missing for another reason (a restored state): no summary rather than a wrong one
    }
    auto & out = st.summ[b];
    out.resize(scorer->summary_size());
    const bool use_old = !complete && stale->second.first.size() == out.size();
    scorer->summarize([&](uint32_t t) { return known[t] ? rows.data() + (size_t) t*dims.key_row() : nullptr; }, out.data(),
            use_old ? stale->second.first.data() : nullptr, use_old ? stale->second.second : 0);
    if (stale != st.stale.end()) {
        st.stale.erase(stale);
    }
}

void llama_kvmem_cache::after_ubatch(ggml_backend_sched_t sched, const llm_graph_result * res, const llama_ubatch & ubatch) {
    if (!res) {
        return;
    }
    ggml_backend_sched_synchronize(sched);

    const uint32_t nt = ubatch.n_tokens;
    const int32_t  B  = kp.block;
    const size_t per_k = (size_t) n_head_kv*head_dim;
    const size_t per_q = (size_t) n_head*head_dim;
    const bool want = !leader && scorer->scores();

    // key rows of the ubatch ([layer][token][kv head][head_dim], a scratch reused across ubatches): the summary
    // of every block this ubatch completed is built from them, and only the rows of each sequence's two
    // newest blocks are kept (to rebuild a summary after a truncation)
    if (want && scorer->summary_size() > 0) {
        kscratch.resize((size_t) n_lt*nt*per_k);
        for (uint32_t lt = 0; lt < n_lt; ++lt) {
            const uint32_t il = layers[lt].il;
            ggml_tensor * t = il < res->t_kvmem_k.size() ? res->t_kvmem_k[il] : nullptr;
            if (t && (size_t) ggml_nelements(t) == per_k*nt) {
                ggml_backend_tensor_get(t, kscratch.data() + (size_t) lt*nt*per_k, 0, ggml_nbytes(t));
            }
        }
        std::map<llama_seq_id, std::map<llama_pos, uint32_t>> in_ubatch; // position -> token of this ubatch
        for (uint32_t i = 0; i < nt; ++i) {
            in_ubatch[ubatch.seq_id[i][0]][ubatch.pos[i]] = i;
        }
        for (auto & [s, toks] : in_ubatch) {
            auto & st = seqs[s];
            const llama_pos keep_from = std::max<llama_pos>(0, (toks.rbegin()->first/B - 1)*B);
            auto key_row = [&](llama_pos pos, uint32_t lt) -> const float * {
                const auto it = toks.find(pos);
                if (it != toks.end()) {
                    return kscratch.data() + ((size_t) lt*nt + it->second)*per_k;
                }
                const auto kr = st.krow.find(pos);
                return kr == st.krow.end() ? nullptr : kr->second.data() + (size_t) lt*per_k;
            };
            for (int32_t blk = toks.begin()->first/B; blk <= toks.rbegin()->first/B; ++blk) {
                build_summary(st, blk, key_row);
            }
            st.krow.erase(st.krow.begin(), st.krow.lower_bound(keep_from));
            for (auto it = toks.lower_bound(keep_from); it != toks.end(); ++it) {
                auto & row = st.krow[it->first];
                row.clear();
                row.reserve((size_t) n_lt*per_k);
                for (uint32_t lt = 0; lt < n_lt; ++lt) {
                    const float * src = kscratch.data() + ((size_t) lt*nt + it->second)*per_k;
                    row.insert(row.end(), src, src + per_k);
                }
            }
        }
    }

    // token ids by block (hybrid scoring)
    if (want && scorer->lexical() && ubatch.token) {
        for (uint32_t i = 0; i < nt; ++i) {
            auto & toks = seqs[ubatch.seq_id[i][0]].btok[ubatch.pos[i]/B];
            if (toks.empty()) {
                toks.assign(B, -1);
            }
            toks[ubatch.pos[i] % B] = ubatch.token[i];
        }
    }

    // query rows: the last tokens of this ubatch, kept by position
    if (want && n_lt > 0) {
        const uint32_t il0 = layers[0].il;
        ggml_tensor * t0 = il0 < res->t_kvmem_q.size() ? res->t_kvmem_q[il0] : nullptr;
        if (t0 && (size_t) (t0->ne[0]*t0->ne[1]) == per_q && (uint32_t) t0->ne[2] <= nt) {
            const uint32_t nq = t0->ne[2];
            std::vector<float> buf;
            std::vector<std::vector<float>> rows(nq, std::vector<float>((size_t) n_lt*per_q, 0.0f));
            for (uint32_t lt = 0; lt < n_lt; ++lt) {
                const uint32_t il = layers[lt].il;
                ggml_tensor * t = il < res->t_kvmem_q.size() ? res->t_kvmem_q[il] : nullptr;
                if (!t || (size_t) ggml_nelements(t) != per_q*nq) {
                    continue;
                }
                buf.resize(ggml_nelements(t));
                ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
                for (uint32_t j = 0; j < nq; ++j) {
                    std::memcpy(rows[j].data() + lt*per_q, buf.data() + j*per_q, per_q*sizeof(float));
                }
            }
            std::set<llama_seq_id> touched;
            for (uint32_t j = 0; j < nq; ++j) {
                const uint32_t i = nt - nq + j;
                auto & st = seqs[ubatch.seq_id[i][0]];
                st.qrow[ubatch.pos[i]] = std::move(rows[j]);
                touched.insert(ubatch.seq_id[i][0]);
            }
            for (const auto s : touched) {
                auto & q = seqs[s].qrow;
                const llama_pos keep = q.rbegin()->first - (llama_pos) (kp.query_tokens + KVMEM_ROW_SLACK);
                q.erase(q.begin(), q.lower_bound(keep));
            }
        }
    }

    // write-through of the blocks this ubatch completed
    for (uint32_t s = 0; s < ubatch.n_seqs_unq; ++s) {
        write_through(ubatch.seq_id_unq[s]);
    }
    publish();
}

//
// MTP draft caches follow the target
//

void llama_kvmem_cache::set_leader(llama_kvmem_cache * target) {
    leader = target;
    target->followers.push_back(this);
}

bool llama_kvmem_cache::resident_in_leader(llama_seq_id seq_id, int32_t b) const {
    const auto it = leader->seqs.find(seq_id);
    if (it == leader->seqs.end()) {
        return false;
    }
    const auto bit = it->second.blocks.find(b);
    return bit != it->second.blocks.end() && bit->second.resident;
}

void llama_kvmem_cache::follow_leader() {
    if (!leader) {
        return;
    }
    for (auto & [s, st] : seqs) {
        uint32_t staged_in = 0, staged_out = 0, resident = 0, common = 0;
        for (auto & [b, hb] : st.blocks) {
            if (hb.resident && !resident_in_leader(s, b)) {
                evict_block(s, b, hb);
                staged_out++;
            }
        }
        for (auto & [b, hb] : st.blocks) {
            if (!hb.resident && resident_in_leader(s, b)) {
                if (!stage_in(s, b, hb)) {
                    break; // the partial tail / generated tokens fill the rest; the next sync retries
                }
                staged_in++;
            }
            resident += hb.resident ? 1 : 0;
            common   += hb.resident && resident_in_leader(s, b) ? 1 : 0;
        }
        copies_wait();
        if (staged_in + staged_out > 0) {
            uint32_t target_resident = 0;
            const auto it = leader->seqs.find(s);
            for (const auto & [b, hb] : it == leader->seqs.end() ? std::map<int32_t, hblock>() : it->second.blocks) {
                target_resident += hb.resident && !st.blocks.empty() && b <= st.blocks.rbegin()->first ? 1 : 0;
            }
            n_staged_in  += staged_in;
            n_staged_out += staged_out;
            LLAMA_LOG_WARN("kvmem_score: FOLLOW seq=%d n_blocks=%zu staged_in=%u staged_out=%u resident=%u target_resident=%u common=%u\n",
                    s, st.blocks.size(), staged_in, staged_out, resident, target_resident, common);
        }
    }
    publish();
}

//
// stats
//

void llama_kvmem_cache::publish() {
    snap_t total;
    std::map<llama_seq_id, snap_t> per;
    for (const auto & [s, st] : seqs) {
        snap_t & x = per[s];
        for (const auto & [b, hb] : st.blocks) {
            x.n_blocks_gpu  += hb.resident ? 1 : 0;
            x.n_blocks_host += 1;
        }
        x.n_select = st.n_select;
        x.last_ms  = st.last_ms;
        total.n_blocks_gpu  += x.n_blocks_gpu;
    }
    total.n_blocks_host = n_host_blocks();
    total.n_select = n_selections;
    total.last_ms  = last_select_ms;
    std::lock_guard<std::mutex> lock(snap_mutex);
    snap_total = total;
    snap_seq.swap(per);
}

void llama_kvmem_cache::get_stats(llama_kvmem_stats * out) const {
    std::lock_guard<std::mutex> lock(snap_mutex);
    out->enabled             = 1;
    out->budget              = kp.budget;
    out->block_tokens        = kp.block;
    out->n_blocks_gpu        = snap_total.n_blocks_gpu;
    out->n_blocks_host       = snap_total.n_blocks_host;
    out->host_bytes          = (int64_t) snap_total.n_blocks_host*block_bytes;
    out->host_capacity_bytes = (int64_t) host_slots*block_bytes;
    out->n_selections        = snap_total.n_select;
    out->n_staged_in         = n_staged_in;
    out->n_staged_out        = n_staged_out;
    out->n_evicted           = n_evicted;
    out->last_select_ms      = snap_total.last_ms;
}

bool llama_kvmem_cache::get_seq_stats(llama_seq_id seq_id, llama_kvmem_stats * out) const {
    get_stats(out);
    std::lock_guard<std::mutex> lock(snap_mutex);
    const auto it = snap_seq.find(seq_id);
    const snap_t x = it == snap_seq.end() ? snap_t() : it->second;
    out->n_blocks_gpu   = x.n_blocks_gpu;
    out->n_blocks_host  = x.n_blocks_host;
    out->host_bytes     = (int64_t) x.n_blocks_host*block_bytes;
    out->n_selections   = x.n_select;
    out->last_select_ms = x.last_ms;
    return true;
}

std::string llama_kvmem_cache::get_last_error() const {
    std::lock_guard<std::mutex> lock(snap_mutex);
    return last_error;
}

void llama_kvmem_cache::set_last_error(const std::string & msg) {
    std::lock_guard<std::mutex> lock(snap_mutex);
    last_error = msg;
}
