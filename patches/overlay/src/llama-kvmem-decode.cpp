// KVMem: hooks into llama_context and the graph, setup, hybrid memory and the C API (kvmem-llama).
// See llama-kvmem.h for the residency rules these hooks drive.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-model.h"
#include "llama-context.h"
#include "llama-io.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <stdexcept>

static uint32_t div_up(uint32_t a, uint32_t b) { return (a + b - 1)/b; }

//
// graph hook
//

// walk back from the tensor handed to the attention builder to the input of its RoPE op
static ggml_tensor * kvmem_pre_rope(ggml_tensor * t) {
    ggml_tensor * cur = t;
    for (int i = 0; i < 6 && cur; ++i) {
        if (cur->op == GGML_OP_ROPE) {
            return cur->src[0];
        }
        if (cur->op == GGML_OP_SCALE || cur->op == GGML_OP_CONT || cur->op == GGML_OP_RESHAPE ||
            cur->op == GGML_OP_VIEW  || cur->op == GGML_OP_CPY) {
            cur = cur->src[0];
            continue;
        }
        break;
    }
    return t; // no RoPE found (e.g. NoPE layers): the tensor itself is position-free
}

static ggml_tensor * kvmem_f32_cont(ggml_context * ctx0, ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 ? ggml_cont(ctx0, t) : ggml_cast(ctx0, ggml_cont(ctx0, t), GGML_TYPE_F32);
}

void llama_kvmem_graph_capture(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_result * res,
        ggml_tensor * q_cur, ggml_tensor * k_cur, int il, const llama_kvmem_params & kp) {
    if (!res || il < 0 || kp.leader || kvmem_scorer::resolve(kp.method) == LLAMA_KVMEM_METHOD_RECENCY) {
        return; // followers and recency select without keys or queries
    }
    const kvmem_scorer probe({ 1, 1, 1, 1, kp.block }, kp.method);
    ggml_tensor * k_src = probe.post_rope() ? k_cur : kvmem_pre_rope(k_cur);
    ggml_tensor * q_src = probe.post_rope() ? q_cur : kvmem_pre_rope(q_cur);
    if (ggml_n_dims(k_src) > 3 || ggml_n_dims(q_src) > 3 || k_src->ne[0] != q_src->ne[0]) {
        return;
    }
    // the query of a turn is the end of its last user message: the rows of each ubatch's last tokens
    // (query_tokens, plus slack for the chat template's closing tokens) are enough to cover it
    const int64_t n_tokens = q_src->ne[2];
    const int64_t nq = std::min<int64_t>((int64_t) kp.query_tokens + 64, n_tokens);

    ggml_tensor * k_out = kvmem_f32_cont(ctx0, k_src);
    ggml_tensor * q_tail = ggml_view_3d(ctx0, q_src, q_src->ne[0], q_src->ne[1], nq,
            q_src->nb[1], q_src->nb[2], (n_tokens - nq)*q_src->nb[2]);
    ggml_tensor * q_out = kvmem_f32_cont(ctx0, q_tail);

    ggml_format_name(k_out, "kvmem_k-%d", il);
    ggml_format_name(q_out, "kvmem_q-%d", il);
    ggml_set_output(k_out);
    ggml_set_output(q_out);
    ggml_build_forward_expand(gf, k_out);
    ggml_build_forward_expand(gf, q_out);

    if ((int) res->t_kvmem_k.size() <= il) {
        res->t_kvmem_k.resize(il + 1, nullptr);
        res->t_kvmem_q.resize(il + 1, nullptr);
    }
    res->t_kvmem_k[il] = k_out;
    res->t_kvmem_q[il] = q_out;
}

//
// setup hooks
//

void llama_kvmem_configure(llama_cparams & cparams, const llama_context_params & params) {
    llama_kvmem_params kp;
    kp.budget       = std::max(0, params.kvmem_budget);
    kp.block        = params.kvmem_block > 0 ? params.kvmem_block : 128;
    kp.sink         = std::max(0, params.kvmem_sink);
    kp.recent       = std::max(0, params.kvmem_recent);
    kp.gen_reserve  = std::max(0, params.kvmem_gen_reserve);
    kp.query_tokens = params.kvmem_query_tokens > 0 ? params.kvmem_query_tokens : kp.query_tokens;
    kp.refresh      = std::max(0, params.kvmem_refresh);
    kp.host_mib     = std::max(0, params.kvmem_host_mib);
    kp.method       = params.kvmem_method;
    kp.prefill      = params.kvmem_prefill;
    kp.gpu_type     = params.kvmem_gpu_type;
    kp.trace        = params.kvmem_trace;

    if (params.ctx_type == LLAMA_CONTEXT_TYPE_MTP) {
        // an MTP draft context is tiered only as a follower of a tiered target context
        kp.leader = params.ctx_other ? llama_kvmem_cache::from(llama_get_memory(params.ctx_other)) : nullptr;
        if (!kp.leader) {
            kp.budget = 0;
        }
    } else if (params.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT) {
        kp.budget = 0;
    }
    if (kp.budget > 0) {
        const uint32_t B = kp.block;
        const uint32_t need = (div_up(kp.sink, B) + div_up(kp.recent, B) + 2)*B;
        if (kp.budget < need) {
            throw std::runtime_error(format("--kvmem-budget %u is too small: it must hold the sink (%u) + recent (%u) tokens "
                        "rounded up to blocks of %u, plus one retrieved block and the partial tail: at least %u",
                        kp.budget, kp.sink, kp.recent, B, need));
        }
        if (kp.gen_reserve < 1) {
            throw std::runtime_error("--kvmem-gen-reserve must be at least 1");
        }
        if (kp.method < 0 || kp.method >= LLAMA_KVMEM_METHOD_COUNT) {
            throw std::runtime_error(format("--kvmem-method %d is unknown", kp.method));
        }
        if (kp.prefill != LLAMA_KVMEM_PREFILL_WINDOW && kp.prefill != LLAMA_KVMEM_PREFILL_RETRIEVAL) {
            throw std::runtime_error(format("--kvmem-prefill %d is unknown", kp.prefill));
        }
        if (kp.gpu_type != LLAMA_KVMEM_GPU_TYPE_F16 && kp.gpu_type != LLAMA_KVMEM_GPU_TYPE_SAME) {
            throw std::runtime_error(format("--kvmem-gpu-type %d is unknown", kp.gpu_type));
        }
    }
    cparams.kvmem = kp;
}

void llama_kvmem_check(const llama_model & model, llama_cparams & cparams) {
    if (cparams.kvmem.budget == 0) {
        return;
    }
    const std::string reason = llama_kvmem_cache::check(model, cparams, cparams.kvmem);
    if (!reason.empty()) {
        LLAMA_LOG_WARN("kvmem_score: DISABLED (%s)\n", reason.c_str());
        cparams.kvmem.budget = 0;
    }
}

void llama_kvmem_check_memory(llama_memory_i * mem, llama_cparams & cparams) {
    if (cparams.kvmem.budget > 0 && !llama_kvmem_cache::from(mem)) {
        LLAMA_LOG_WARN("kvmem_score: DISABLED (%s)\n", "the model's memory has no plain attention KV cache to tier (sliding-window and purely recurrent models are not tiered)");
        cparams.kvmem.budget = 0;
    }
}

llama_memory_i * llama_kvmem_create_memory(const llama_model & model, const llama_memory_params & params,
        const llama_cparams & cparams, const llama_memory_i::layer_filter_cb & filter) {
    if (cparams.kvmem.budget == 0) {
        return nullptr;
    }
    llama_kvmem_cache * target = nullptr;
    if (params.ctx_type == LLAMA_CONTEXT_TYPE_MTP) {
        target = cparams.kvmem.leader;
        if (!target) {
            return nullptr;
        }
    } else if (params.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT) {
        return nullptr;
    }
    return new llama_kvmem_cache(model, params.type_k, params.type_v, cparams.offload_kqv,
            cparams.n_seq_max, cparams.n_ctx, cparams.kvmem, filter, target);
}

//
// hybrid models
//

// llama_memory_hybrid whose attention part is a llama_kvmem_cache: the graph still sees a
// llama_memory_hybrid_context; only the batch split and the lazy attention placement differ
class llama_kvmem_hybrid : public llama_memory_hybrid {
public:
    llama_kvmem_hybrid(const llama_model & model, llama_kvmem_cache * attn, llama_memory_recurrent * recr) :
        llama_memory_hybrid(model, attn, recr), km(attn) {
        km->recr = recr;
    }

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override {
        auto * recr = get_mem_recr();
        uint32_t n_ub = km->max_ubatch(n_ubatch);
        km->fit_ubatch(balloc, n_ub);
        balloc.split_reset();
        std::vector<llama_ubatch> ubatches;
        while (true) {
            // same split as upstream's hybrid memory (unified KV): the trailing 1 + n_rs_seq tokens of each
            // sequence stay in one ubatch so that recurrent rollback snapshots remain valid
            llama_ubatch ubatch = embd_all ? balloc.split_seq(n_ub)
                : balloc.split_equal(n_ub, false, recr->n_rs_seq > 0 ? recr->n_rs_seq + 1 : 0);
            if (ubatch.n_tokens == 0) {
                break;
            }
            ubatches.push_back(std::move(ubatch)); // NOLINT
        }
        if (balloc.get_n_used() < balloc.get_n_tokens() || !km->host_room_for(ubatches.data(), ubatches.size()) || !recr->prepare(ubatches)) {
            return std::make_unique<llama_memory_hybrid_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
        llama_kv_cache::slot_info_vec_t sinfos(ubatches.size());
        llama_memory_context_ptr ctx_attn = std::make_unique<llama_kvmem_context>(km, std::move(sinfos), ubatches);
        return std::make_unique<llama_memory_hybrid_context>(this, std::move(ctx_attn), std::move(ubatches));
    }

private:
    llama_kvmem_cache * km;
};

llama_memory_i * llama_kvmem_create_hybrid(const llama_model & model, const llama_memory_params & params,
        const llama_cparams & cparams, const llama_memory_i::layer_filter_cb & filter_attn,
        const llama_memory_i::layer_filter_cb & filter_recr) {
    if (cparams.kvmem.budget == 0 || params.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT || model.hparams.swa_type != LLAMA_SWA_TYPE_NONE) {
        return nullptr;
    }
    const auto & hp = model.hparams;
    const llama_memory_i::layer_filter_cb attn = filter_attn ? filter_attn : [&hp](int32_t il) { return !hp.is_recr(il); };
    const llama_memory_i::layer_filter_cb recr = filter_recr ? filter_recr : [&hp](int32_t il) { return hp.is_recr(il); };
    auto * km = new llama_kvmem_cache(model, params.type_k, params.type_v, cparams.offload_kqv,
            cparams.n_seq_max, cparams.n_ctx, cparams.kvmem, attn);
    auto * rs = new llama_memory_recurrent(model, GGML_TYPE_F32, GGML_TYPE_F32, cparams.offload_kqv,
            std::max((uint32_t) 1, cparams.n_seq_max), cparams.n_seq_max, cparams.n_rs_seq, recr);
    return new llama_kvmem_hybrid(model, km, rs);
}

// recurrent state snapshots in host memory (one sequence, via the state I/O of the recurrent memory)
class kvmem_state_writer : public llama_io_write_i {
public:
    std::vector<uint8_t> buf;

    void write(const void * src, size_t size) override {
        const auto * p = (const uint8_t *) src;
        buf.insert(buf.end(), p, p + size);
    }
    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        const size_t o = buf.size();
        buf.resize(o + size);
        ggml_backend_tensor_get(tensor, buf.data() + o, offset, size);
    }
    size_t n_bytes() override { return buf.size(); }
};

class kvmem_state_reader : public llama_io_read_i {
public:
    explicit kvmem_state_reader(const std::vector<uint8_t> & buf) : buf(buf) {}

    void read(void * dst, size_t size) override {
        take(size);
        std::memcpy(dst, buf.data() + pos - size, size);
    }
    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        take(size);
        ggml_backend_tensor_set(tensor, buf.data() + pos - size, offset, size);
    }
    size_t n_bytes() override { return pos; }

private:
    void take(size_t size) {
        if (pos + size > buf.size()) {
            throw std::runtime_error("kvmem: recurrent state snapshot is truncated");
        }
        pos += size;
    }
    const std::vector<uint8_t> & buf;
    size_t pos = 0;
};

//
// llama_context: the decode hook
//

// the outputs of a caller's batch decoded in several passes (segments split at selections, recomputed
// tails), kept per batch token: a later pass replaces an earlier one's rows for the same token
struct kvmem_assembled_outputs {
    std::vector<std::vector<float>> logits, embd, nextn;
    bool any = false;

    explicit kvmem_assembled_outputs(size_t n) : logits(n), embd(n), nextn(n) {}
};

void llama_context::kvmem_collect_outputs(const std::vector<int64_t> & index, kvmem_assembled_outputs & acc) {
    // index[j]: the caller's batch index of the pass's token j (-1: a token of an earlier batch)
    llama_kvmem_outputs o;
    kvmem_take_outputs(index.size(), o);
    const size_t n_vocab = model.vocab.n_tokens();
    const size_t n_embd_out = model.hparams.n_embd_out();
    for (size_t j = 0; j < index.size(); ++j) {
        const int64_t i = index[j];
        if (i < 0) {
            continue;
        }
        if (j < o.ids.size() && o.ids[j] >= 0) {
            const size_t r = o.ids[j];
            if (!o.logits.empty()) {
                acc.logits[i].assign(o.logits.begin() + r*n_vocab, o.logits.begin() + (r + 1)*n_vocab);
            }
            if (!o.embd.empty()) {
                acc.embd[i].assign(o.embd.begin() + r*n_embd_out, o.embd.begin() + (r + 1)*n_embd_out);
            }
        }
        if (!o.nextn.empty()) {
            acc.nextn[i].assign(o.nextn.begin() + j*n_embd_out, o.nextn.begin() + (j + 1)*n_embd_out);
        }
    }
    acc.any = true;
}

bool llama_context::kvmem_restore_outputs(const llama_batch_ext & batch, const kvmem_assembled_outputs & acc) {
    llama_kvmem_outputs o;
    o.ids.assign(batch.tokens.size(), -1);
    for (size_t i = 0; i < batch.tokens.size(); ++i) {
        if (!batch.tokens[i].output || (acc.logits[i].empty() && acc.embd[i].empty())) {
            continue;
        }
        o.ids[i] = o.n_out++;
        o.logits.insert(o.logits.end(), acc.logits[i].begin(), acc.logits[i].end());
        o.embd.insert(o.embd.end(), acc.embd[i].begin(), acc.embd[i].end());
    }
    bool nextn = true;
    for (const auto & row : acc.nextn) {
        nextn = nextn && !row.empty();
    }
    if (nextn) {
        for (const auto & row : acc.nextn) {
            o.nextn.insert(o.nextn.end(), row.begin(), row.end());
        }
    }
    return kvmem_put_outputs(o);
}

int llama_context::decode(const llama_batch_ext & batch) {
    auto * km = llama_kvmem_cache::from(memory.get());
    if (!km || km->in_redecode) {
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

    const size_t n = batch.tokens.size();
    if (n == 0) {
        return decode_impl(batch);
    }

    // what the batch is for each of its sequences
    struct part_t {
        uint32_t n = 0, n_out = 0;
        size_t first = SIZE_MAX, last = 0;
        llama_pos p0 = std::numeric_limits<llama_pos>::max();
        kvmem_batch_kind kind = KVMEM_BATCH_GEN;
    };
    std::map<llama_seq_id, part_t> parts;
    for (size_t i = 0; i < n; ++i) {
        const auto & tok = batch.tokens[i];
        if (tok.has_embd) {
            const std::string msg = "KV tiering does not support embedding (image/audio) input yet; "
                "run multimodal models without --kvmem-budget";
            LLAMA_LOG_ERROR("%s: %s\n", __func__, msg.c_str());
            km->set_last_error(msg);
            return -1;
        }
        if (tok.seq_ids.size() != 1) {
            return decode_impl(batch); // tokens shared by several sequences: no turn bookkeeping
        }
        auto & p = parts[*tok.seq_ids.begin()];
        p.n++;
        p.n_out += tok.output ? 1 : 0;
        p.first = std::min(p.first, i);
        p.last = i;
        p.p0 = std::min(p.p0, tok.pos[0]);
    }
    for (auto & [s, p] : parts) {
        p.kind = km->begin_batch(s, p.n, p.n_out, batch.tokens[p.last].output, p.p0);
        if (p.kind != KVMEM_BATCH_GEN) {
            std::vector<std::pair<std::array<llama_pos, 4>, llama_token>> toks;
            for (const auto & tok : batch.tokens) {
                if (*tok.seq_ids.begin() == s) {
                    toks.push_back({ { tok.pos[0], tok.pos[1], tok.pos[2], tok.pos[3] }, tok.id });
                }
            }
            km->remember_tokens(s, toks);
        }
    }

    // backend samplers keep their own per-output state: such batches are decoded in one pass (a turn's first
    // token then does not see the blocks its selection staged in; the next token does)
    const bool one_pass = !sampling.samplers.empty();
    const bool hybrid = km->recr != nullptr && km->may_stage((uint32_t) n);

    // hybrid models: the recurrent state of each prompt sequence before this batch, so that the turn's query
    // span can be recomputed after the selection
    if (hybrid && !one_pass) {
        for (const auto & [s, p] : parts) {
            if (p.kind != KVMEM_BATCH_GEN) {
                kvmem_state_writer w;
                km->recr->state_write(w, s);
                km->push_snapshot(s, p.p0, std::move(w.buf));
            }
        }
    }

    // where the batch must be cut (single-sequence batches): at the exact positions of re-selections during
    // generation (refresh, room) and inside prompts (retrieval prefill), and for hybrid models at the turn's
    // query span (a recurrent snapshot there avoids recomputing the whole batch)
    struct cut_t { size_t at; const char * what; };
    std::vector<cut_t> cuts;
    llama_seq_id s1 = parts.size() == 1 ? parts.begin()->first : -1;
    if (s1 >= 0 && !one_pass) {
        const part_t & p = parts.begin()->second;
        llama_pos next = p.kind == KVMEM_BATCH_GEN ? km->event_pos(s1) : km->prefill_pos(s1);
        const char * reason = p.kind == KVMEM_BATCH_GEN ? km->event_reason(s1) : "prefill";
        llama_pos q0 = -1, q1 = -1;
        if (hybrid && p.kind == KVMEM_BATCH_TURN) {
            km->turn_query_span(s1, batch.tokens[p.last].pos[0] + 1, q0, q1); // the prompt ends with this batch
        }
        for (size_t i = 0; i < n; ++i) {
            const llama_pos pos = batch.tokens[i].pos[0];
            if (next >= 0 && pos >= next) {
                cuts.push_back({ i, reason });
                next = p.kind == KVMEM_BATCH_GEN ? -1 : pos + km->prefill_step(); // generation: later events below
            }
            if (q0 > p.p0 && pos == q0) {
                cuts.push_back({ i, "snapshot" });
            }
        }
    }
    // multi-sequence batches (parallel slots): the query rows of a ubatch are those of its last tokens, so a
    // prompt that ends in the middle of a batch (another slot's tokens follow) is decoded as a segment of its
    // own; otherwise its turn would be scored without its question
    if (s1 < 0 && !one_pass && km->may_stage((uint32_t) n)) {
        for (const auto & [s, p] : parts) {
            if (p.kind != KVMEM_BATCH_TURN) {
                continue;
            }
            bool contiguous = true;
            for (size_t i = p.first; i <= p.last && contiguous; ++i) {
                contiguous = *batch.tokens[i].seq_ids.begin() == s;
            }
            if (contiguous && p.first > 0) {
                cuts.push_back({ p.first, "query" });
            }
            if (p.last + 1 < n) {
                cuts.push_back({ p.last + 1, "query" });
            }
        }
        std::sort(cuts.begin(), cuts.end(), [](const cut_t & a, const cut_t & b) { return a.at < b.at; });
    }

    kvmem_assembled_outputs acc(n);
    size_t start = 0;
    auto run_segment = [&](size_t end) -> int {
        if (end <= start) {
            return 0;
        }
        llama_batch_ext seg = batch;
        if (start > 0 || end < n) {
            seg.tokens.assign(batch.tokens.begin() + start, batch.tokens.begin() + end);
        }
        const int ret = decode_impl(seg);
        if (ret == 0 && (start > 0 || end < n || !cuts.empty())) {
            std::vector<int64_t> index(end - start);
            for (size_t j = 0; j < index.size(); ++j) {
                index[j] = (int64_t) (start + j);
            }
            kvmem_collect_outputs(index, acc);
        }
        start = end;
        return ret;
    };
    for (const auto & c : cuts) {
        const int ret = run_segment(c.at);
        if (ret != 0) {
            return ret;
        }
        if (std::strcmp(c.what, "query") == 0) {
            continue; // a segment boundary only
        }
        if (std::strcmp(c.what, "snapshot") == 0) {
            kvmem_state_writer w;
            km->recr->state_write(w, s1);
            km->push_snapshot(s1, batch.tokens[c.at].pos[0], std::move(w.buf));
        } else {
            km->select(s1, c.what);
        }
    }
    // generation: a batch that crosses a second re-selection is cut there too
    while (s1 >= 0 && !one_pass && parts.begin()->second.kind == KVMEM_BATCH_GEN) {
        const llama_pos next = km->event_pos(s1);
        size_t j = start;
        while (j < n && (next < 0 || batch.tokens[j].pos[0] < next)) {
            j++;
        }
        if (j >= n || next < 0) {
            break;
        }
        if (j == start) {
            km->select(s1, km->event_reason(s1));
            continue;
        }
        const int ret = run_segment(j);
        if (ret != 0) {
            return ret;
        }
        km->select(s1, km->event_reason(s1));
    }
    {
        const int ret = run_segment(n);
        if (ret != 0) {
            return ret;
        }
    }

    // multi-sequence batches: re-selections of the sequences whose next position reached theirs (not exact:
    // parallel slots are not speculative)
    for (const auto & [s, p] : parts) {
        if (s1 < 0 && p.kind == KVMEM_BATCH_GEN) {
            const llama_pos r = km->event_pos(s);
            if (r >= 0 && batch.tokens[p.last].pos[0] + 1 >= r) {
                km->select(s, km->event_reason(s));
            }
        }
    }

    // turns: select, then recompute the query span so that it (and the first token's logits) see the picks
    std::vector<llama_seq_id> redo;
    std::map<llama_seq_id, llama_pos> redo_from;
    for (const auto & [s, p] : parts) {
        if (p.kind != KVMEM_BATCH_TURN) {
            continue;
        }
        if (!km->select(s, "turn") || one_pass) {
            continue;
        }
        llama_pos q0 = -1, q1 = -1;
        km->turn_query_span(s, batch.tokens[p.last].pos[0] + 1, q0, q1);
        llama_pos from = q0;
        if (km->recr) {
            llama_pos at = -1;
            if (!km->snapshot_at(s, from, &at)) {
                continue; // no recurrent state to recompute from: the selection applies from the next token
            }
            from = at;
        }
        if (km->tokens_from(s, from).empty()) {
            continue;
        }
        redo.push_back(s);
        redo_from[s] = from;
    }
    if (!redo.empty()) {
        if (!acc.any) {
            std::vector<int64_t> index(n);
            for (size_t j = 0; j < n; ++j) {
                index[j] = (int64_t) j;
            }
            kvmem_collect_outputs(index, acc);
        }
        llama_batch_ext tail = batch;
        tail.tokens.clear();
        std::vector<int64_t> index;
        for (const auto s : redo) {
            const llama_pos from = redo_from[s];
            const auto toks = km->tokens_from(s, from);
            if (km->recr) {
                llama_pos at = -1;
                const auto * snap = km->snapshot_at(s, from, &at);
                kvmem_state_reader r(*snap);
                km->recr->state_read(r, s);
            }
            km->in_redecode = true;
            km->seq_rm(s, from, -1); // the attention cache only: the recurrent state was put back above
            km->in_redecode = false;
            const size_t last = parts[s].last;
            for (size_t k = 0; k < toks.size(); ++k) {
                llama_batch_ext::token t = batch.tokens[last];
                t.id = toks[k].second;
                for (size_t c = 0; c < t.pos.size(); ++c) {
                    t.pos[c] = toks[k].first[c];
                }
                t.output = k + 1 == toks.size();
                tail.tokens.push_back(t);
                // the caller's batch index of this token, if it is one of this batch's tokens
                int64_t idx = -1;
                for (size_t i = 0; i < n; ++i) {
                    if (*batch.tokens[i].seq_ids.begin() == s && batch.tokens[i].pos[0] == toks[k].first[0]) {
                        idx = (int64_t) i;
                        break;
                    }
                }
                index.push_back(idx);
            }
        }
        if (km->params().trace) {
            for (const auto s : redo) {
                LLAMA_LOG_WARN("kvmem_trace: recompute seq=%d from=%d\n", s, redo_from[s]);
            }
        }
        km->in_redecode = true;
        const int ret = decode_impl(tail);
        km->in_redecode = false;
        if (ret != 0) {
            return ret;
        }
        kvmem_collect_outputs(index, acc);
    }
    if (acc.any) {
        return kvmem_restore_outputs(batch, acc) ? 0 : -2;
    }
    return 0;
}

void llama_context::kvmem_take_outputs(size_t n_tok, llama_kvmem_outputs & o) {
    output_reorder();
    const size_t n_vocab = model.vocab.n_tokens();
    const size_t n_embd_out = model.hparams.n_embd_out();
    o.ids.assign(output_ids.begin(), output_ids.begin() + std::min(n_tok, output_ids.size()));
    o.n_out = 0;
    for (const auto id : o.ids) {
        o.n_out = std::max(o.n_out, id + 1);
    }
    o.logits.clear();
    o.embd.clear();
    o.nextn.clear();
    if (logits.data) {
        o.logits.assign(logits.data, logits.data + (size_t) o.n_out*n_vocab);
    }
    if (embd.data && embd.size > 0) {
        o.embd.assign(embd.data, embd.data + (size_t) o.n_out*n_embd_out);
    }
    // draft-mtp reads one unmasked next-n row per batch token
    if (cparams.embeddings_nextn && !cparams.embeddings_nextn_masked && embd_nextn.data) {
        o.nextn.assign(embd_nextn.data, embd_nextn.data + n_tok*n_embd_out);
    }
}

bool llama_context::kvmem_put_outputs(const llama_kvmem_outputs & o) {
    if (output_reserve(o.n_out) < (uint32_t) o.n_out) { // lays the views out for these outputs again
        return false;
    }
    if (logits.data && !o.logits.empty()) {
        std::memcpy(logits.data, o.logits.data(), o.logits.size()*sizeof(float));
    }
    if (embd.data && !o.embd.empty()) {
        std::memcpy(embd.data, o.embd.data(), o.embd.size()*sizeof(float));
    }
    if (embd_nextn.data && !o.nextn.empty()) {
        std::memcpy(embd_nextn.data, o.nextn.data(), o.nextn.size()*sizeof(float));
    }
    std::fill(output_ids.begin(), output_ids.end(), -1);
    std::copy(o.ids.begin(), o.ids.end(), output_ids.begin());
    n_outputs = o.n_out;
    return true;
}

void llama_context::kvmem_after_ubatch(const llm_graph_result * res, const llama_ubatch & ubatch) {
    auto * km = llama_kvmem_cache::from(memory.get());
    if (km) {
        km->after_ubatch(sched.get(), res, ubatch);
    }
}

//
// C API
//

int32_t llama_kvmem_get_stats(const struct llama_context * ctx, struct llama_kvmem_stats * out) {
    if (!ctx || !out) {
        return -1;
    }
    std::memset(out, 0, sizeof(*out));
    auto * km = llama_kvmem_cache::from(llama_get_memory(ctx));
    if (!km) {
        return 1; // tiering off
    }
    km->get_stats(out);
    return 0;
}

int32_t llama_kvmem_get_seq_stats(const struct llama_context * ctx, llama_seq_id seq_id, struct llama_kvmem_stats * out) {
    if (!ctx || !out) {
        return -1;
    }
    std::memset(out, 0, sizeof(*out));
    auto * km = llama_kvmem_cache::from(llama_get_memory(ctx));
    if (!km) {
        return 1;
    }
    km->get_seq_stats(seq_id, out);
    return 0;
}

const char * llama_kvmem_last_error(const struct llama_context * ctx) {
    // thread-local copy so the pointer stays valid for the caller
    static thread_local std::string msg;
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    msg = km ? km->get_last_error() : std::string();
    return msg.c_str();
}

int32_t llama_kvmem_set_query_span(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    if (!km) {
        return 1;
    }
    km->set_query_span(seq_id, p0, p1);
    return 0;
}

int32_t llama_kvmem_seq_release(struct llama_context * ctx, llama_seq_id seq_id) {
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    if (!km) {
        return 1;
    }
    km->release_seq(seq_id);
    return 0;
}

int32_t llama_kvmem_max_active(const struct llama_context * ctx) {
    auto * km = ctx ? llama_kvmem_cache::from(llama_get_memory(ctx)) : nullptr;
    return km ? (int32_t) km->max_active() : 0;
}

const char * llama_kvmem_method_name(int32_t method) {
    return kvmem_scorer::method_name(method);
}

int32_t llama_kvmem_method_from_name(const char * name) {
    return name ? kvmem_scorer::method_from_name(name) : -1;
}
