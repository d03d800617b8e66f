// KVMem: KV tiering for the attention KV cache (kvmem-llama). See llama-kvmem.h.

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

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>
#include <thread>

// blocks are ranked by the mean of their few best (layer, KV head) scores
static constexpr size_t KVMEM_TOP_HEADS = 4;

static uint32_t div_up(uint32_t a, uint32_t b) { return (a + b - 1)/b; }

// max over n_rows query rows (contiguous, n floats each) of dot(q_r, kb).
// Built for AVX2+FMA too on x86-64 (picked at run time).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
static float kvmem_bound_max(const float * q0, size_t n_rows, const float * kb, size_t n) {
    float best = -INFINITY;
    for (size_t r = 0; r < n_rows; ++r) {
        const float * q = q0 + r*n;
        float acc[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
        size_t d = 0;
        for (; d + 8 <= n; d += 8) {
            for (int j = 0; j < 8; ++j) {
                acc[j] += q[d + j]*kb[d + j];
            }
        }
        float sum = 0.0f;
        for (; d < n; ++d) {
            sum += q[d]*kb[d];
        }
        for (int j = 0; j < 8; ++j) {
            sum += acc[j];
        }
        best = std::max(best, sum);
    }
    return best;
}

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
    ggml_tensor * r = t->type == GGML_TYPE_F32 ? ggml_cont(ctx0, t) : ggml_cast(ctx0, ggml_cont(ctx0, t), GGML_TYPE_F32);
    return r;
}

void llama_kvmem_graph_capture(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_result * res,
        ggml_tensor * q_cur, ggml_tensor * k_cur, int il, uint32_t n_q) {
    if (!res || il < 0) {
        return;
    }
    ggml_tensor * k_pre = kvmem_pre_rope(k_cur);
    ggml_tensor * q_pre = kvmem_pre_rope(q_cur);
    if (ggml_n_dims(k_pre) > 3 || ggml_n_dims(q_pre) > 3 || k_pre->ne[0] != q_pre->ne[0]) {
        return;
    }
    const int64_t n_tokens = q_pre->ne[2];
    const int64_t nq = std::min<int64_t>(std::max<uint32_t>(n_q, 1), n_tokens);

    ggml_tensor * k_out = kvmem_f32_cont(ctx0, k_pre);
    ggml_tensor * q_tail = ggml_view_3d(ctx0, q_pre, q_pre->ne[0], q_pre->ne[1], nq,
            q_pre->nb[1], q_pre->nb[2], (n_tokens - nq)*q_pre->nb[2]);
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
// the tiered cache
//

std::string llama_kvmem_cache::check(const llama_model & model, const llama_cparams & cparams, const llama_kvmem_params & kp) {
    const auto & hp = model.hparams;
    if (!cparams.flash_attn) {
        return "flash attention is off (-fa off); tiering copies per-token V rows and needs -fa on or auto";
    }
    if (!cparams.kv_unified && cparams.n_seq_max > 1) {
        return "parallel sequences need a unified KV cache (--kv-unified)";
    }
    // M-RoPE (qwen35): cells keep all position components (pos + ext), so staged blocks keep them too
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
    if (cparams.n_ctx <= kp.budget) {
        // still tiered (write-through + selection run, nothing is ever evicted): lets us test identity
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
    llama_kv_cache(model, model.hparams, type_k, type_v, /*v_trans*/ false, offload, /*unified*/ true,
            kp_in.budget + kp_in.gen_reserve*std::max<uint32_t>(1, n_seq_max), n_seq_max, 1, 0, LLAMA_SWA_TYPE_NONE, nullptr, filter, nullptr, nullptr, "kvmem"),
    kp(kp_in) {
    const auto & hp = model.hparams;
    const uint32_t B = kp.block;

    sink_blocks   = div_up(kp.sink, B);
    recent_blocks = div_up(kp.recent, B);
    budget_blocks = kp.budget / B;

    n_lt = layers.size();
    il_to_lt.assign(hp.n_layer() + hp.n_layer_nextn + 1, -1);
    for (uint32_t i = 0; i < n_lt; ++i) {
        if (layers[i].il < il_to_lt.size()) {
            il_to_lt[layers[i].il] = i;
        }
        row_k.push_back(layers[i].k->nb[1]);
        row_v.push_back(layers[i].v ? layers[i].v->nb[1] : 0);
        block_bytes += (size_t) B*(row_k.back() + row_v.back());
    }
    // one backend (own stream) per device holding tiered layers: host<->device block copies are
    // issued asynchronously and waited for once per batch of copies
    copy_backend.assign(n_lt, nullptr);
    for (uint32_t i = 0; i < n_lt; ++i) {
        ggml_backend_buffer_t kbuf = layers[i].k->buffer;
        ggml_backend_dev_t dev = kbuf ? ggml_backend_buft_get_device(ggml_backend_buffer_get_type(kbuf)) : nullptr;
        if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU || ggml_backend_buffer_is_host(kbuf)) {
            continue;
        }
        auto it = std::find_if(copy_backends.begin(), copy_backends.end(),
                [dev](ggml_backend_t be) { return ggml_backend_get_device(be) == dev; });
        if (it == copy_backends.end()) {
            ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
            if (!be) {
                continue;
            }
            copy_backends.push_back(be);
            it = copy_backends.end() - 1;
        }
        copy_backend[i] = *it;
    }

    const uint32_t il0 = n_lt ? layers[0].il : 0;
    n_head    = hp.n_head(il0);
    n_head_kv = hp.n_head_kv(il0);
    head_dim  = hp.n_embd_head_k(il0);

    // host pool: the device's host buffer type (pinned on CUDA), plain CPU memory otherwise
    ggml_backend_buffer_type_t buft = nullptr;
    if (n_lt && layers[0].k->buffer) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(layers[0].k->buffer));
        if (dev) {
            buft = ggml_backend_dev_host_buffer_type(dev);
        }
    }
    if (!buft) {
        buft = ggml_backend_cpu_buffer_type();
    }

    if (kp.host_mib > 0) {
        host_slots = (uint32_t) (((size_t) kp.host_mib*1024*1024)/block_bytes);
        if (host_slots == 0) {
            throw std::runtime_error(format("--kvmem-host-mib %u is too small: one block of %u tokens needs %.2f MiB",
                        kp.host_mib, B, block_bytes/1024.0/1024.0));
        }
    } else {
        host_slots = div_up(n_ctx_total, B) + 1;
    }
    host_buf = ggml_backend_buft_alloc_buffer(buft, (size_t) host_slots*block_bytes);
    if (!host_buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the host KV pool (%.1f MiB in %s); lower --kvmem-host-mib or the context",
                    (double) host_slots*block_bytes/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    host_base = (uint8_t *) ggml_backend_buffer_get_base(host_buf);
    free_slots.reserve(host_slots);
    for (uint32_t i = 0; i < host_slots; ++i) {
        free_slots.push_back(host_slots - 1 - i);
    }

    const double host_mib = (double) host_slots*block_bytes/1024.0/1024.0;
    if (target) {
        set_leader(target);
        LLAMA_LOG_WARN("kvmem_score: DRAFT follows the target's selection: blocks=%u layers=%u host_mib=%.0f\n",
                host_slots, n_lt, std::ceil(host_mib));
    } else {
        LLAMA_LOG_WARN("kvmem_score: ARMED blocks=%u block_tokens=%u layers=%u kv_heads=%u head_dim=%u budget_blocks=%u host_mib=%.0f\n",
                host_slots, B, n_lt, n_head_kv, head_dim, budget_blocks, std::ceil(host_mib));
    }
    LLAMA_LOG_INFO("%s: GPU working set %u cells (budget %u + gen reserve %u x %u sequences), sink %u block(s), recent %u block(s), method %s, host pool %s\n",
            __func__, get_size(), kp.budget, kp.gen_reserve, std::max<uint32_t>(1, n_seq_max), sink_blocks, recent_blocks,
            kp.method == LLAMA_KVMEM_METHOD_RECENCY ? "recency" : "retrieval", ggml_backend_buft_name(buft));
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

// a context that places each ubatch only when it is applied, evicting blocks to make room
class llama_kvmem_context : public llama_kv_cache_context {
public:
    // note: the slot infos are sized by the caller (argument evaluation order is unspecified)
    llama_kvmem_context(llama_kvmem_cache * km, slot_info_vec_t sinfos, std::vector<llama_ubatch> ubs) :
        llama_kv_cache_context(km, std::move(sinfos), std::move(ubs)), km(km) {}

    bool apply() override {
        if (!ubatches.empty() && !km->prepare_ubatch(ubatches[i_cur], sinfos[i_cur])) {
            return false;
        }
        return llama_kv_cache_context::apply();
    }

private:
    llama_kvmem_cache * km;
};

llama_memory_context_ptr llama_kvmem_cache::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);

    const uint32_t n_ub = max_ubatch(n_ubatch);

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

void llama_kvmem_cache::copy_block(uint8_t * host, const std::vector<uint32_t> & idx, bool to_device) {
    // host slot layout: per tiered layer the block's K rows, then its V rows; cells idx[t] hold token t.
    // Runs of consecutive cells move in one copy per layer and K/V.
    const uint32_t B = kp.block;
    for (uint32_t lt = 0; lt < n_lt; ++lt) {
        uint8_t * hk = host;
        uint8_t * hv = host + (size_t) B*row_k[lt];
        for (uint32_t t = 0; t < B; ) {
            uint32_t r = 1;
            while (t + r < B && idx[t + r] == idx[t] + r) {
                r++;
            }
            for (const bool is_v : { false, true }) {
                ggml_tensor * tensor = is_v ? layers[lt].v : layers[lt].k;
                const size_t row = is_v ? row_v[lt] : row_k[lt];
                if (!tensor) {
                    continue;
                }
                uint8_t * h = (is_v ? hv : hk) + (size_t) t*row;
                if (to_device) {
                    upload(lt, tensor, h, (size_t) idx[t]*row, (size_t) r*row);
                } else {
                    download(lt, tensor, h, (size_t) idx[t]*row, (size_t) r*row);
                }
            }
            t += r;
        }
        host += (size_t) B*(row_k[lt] + row_v[lt]);
    }
}

void llama_kvmem_cache::upload(uint32_t lt, ggml_tensor * t, const void * src, size_t offset, size_t size) {
    if (copy_backend[lt]) {
        ggml_backend_tensor_set_async(copy_backend[lt], t, src, offset, size);
        copies_pending = true;
    } else {
        ggml_backend_tensor_set(t, src, offset, size);
    }
}

void llama_kvmem_cache::download(uint32_t lt, ggml_tensor * t, void * dst, size_t offset, size_t size) {
    if (copy_backend[lt]) {
        ggml_backend_tensor_get_async(copy_backend[lt], t, dst, offset, size);
        copies_pending = true;
    } else {
        ggml_backend_tensor_get(t, dst, offset, size);
    }
}

void llama_kvmem_cache::copies_wait() {
    if (copies_pending) {
        for (auto * be : copy_backends) {
            ggml_backend_synchronize(be);
        }
        copies_pending = false;
    }
}

bool llama_kvmem_cache::host_room_for(const llama_ubatch * ubatches, size_t n_ubatches) {
    // every block the batch completes is written through to the host pool; when it would not fit, the
    // batch is refused before any work (decode returns 1, as for a full KV cache, so the server frees
    // idle slots of a shared pool and retries)
    std::map<llama_seq_id, llama_pos> pmax;
    for (size_t u = 0; u < n_ubatches; ++u) {
        const llama_ubatch & ub = ubatches[u];
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            const llama_seq_id s = ub.seq_id[i][0];
            const auto it = pmax.find(s);
            pmax[s] = it == pmax.end() ? ub.pos[i] : std::max(it->second, ub.pos[i]);
        }
    }
    uint32_t need = 0;
    for (const auto & [s, p] : pmax) {
        const auto it = seqs.find(s);
        const int32_t next = it == seqs.end() ? 0 : it->second.next_host;
        const int32_t done = (p + 1)/(int32_t) kp.block;
        need += done > next ? done - next : 0;
    }
    if (need <= free_slots.size()) {
        return true;
    }
    set_last_error(format("KV tiering host pool is full (%u blocks of %u tokens, %.1f MiB, %zu free): this request needs %u more; "
            "raise --kvmem-host-mib (or lower the context)", host_slots, kp.block,
            (double) host_slots*block_bytes/1024.0/1024.0, free_slots.size(), need));
    return false;
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

uint32_t llama_kvmem_cache::n_resident_blocks() const {
    uint32_t n = 0;
    for (const auto & [s, st] : seqs) {
        for (const auto & [b, hb] : st.blocks) {
            n += hb.resident ? 1 : 0;
        }
    }
    return n;
}

uint32_t llama_kvmem_cache::n_host_blocks() const {
    return host_slots - (uint32_t) free_slots.size();
}

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
        p1 = std::numeric_limits<llama_pos>::max();
    }
    const int32_t B = kp.block;

    if (seq_id < 0) {
        std::vector<llama_seq_id> ids;
        for (auto & [s, st] : seqs) {
            ids.push_back(s);
        }
        bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1);
        for (auto s : ids) {
            if (p0 == 0 && p1 == std::numeric_limits<llama_pos>::max()) {
                drop_host_blocks(s, 0);
                seqs.erase(s);
            } else {
                drop_host_blocks(s, p0/B);
            }
        }
        return ok;
    }

    auto it = seqs.find(seq_id);
    if (it == seqs.end()) {
        return llama_kv_cache::seq_rm(seq_id, p0, p1);
    }
    auto & st = it->second;

    if (p0 == 0 && p1 == std::numeric_limits<llama_pos>::max()) {
        const bool ok = llama_kv_cache::seq_rm(seq_id, p0, p1);
        drop_host_blocks(seq_id, 0);
        seqs.erase(it);
        return ok;
    }

    if (p1 != std::numeric_limits<llama_pos>::max()) {
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

    // truncation [p0, inf): the last kept position p0-1 must be in the working set, so that the
    // next batch (starting at p0) is consistent with seq_pos_max
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
    // the cut block's box is rebuilt from the kept key rows when the block completes again
    forget_from(st, p0, std::numeric_limits<llama_pos>::max());
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

void llama_kvmem_cache::evict_block(llama_seq_id seq_id, int32_t b, hblock & hb) {
    const int32_t B = kp.block;
    llama_kv_cache::seq_rm(seq_id, b*B, (b + 1)*B);
    hb.resident = false;
    hb.pinned   = false;
}

bool llama_kvmem_cache::evict_one(llama_seq_id prefer_seq) {
    GGML_UNUSED(prefer_seq);
    llama_seq_id best_s = -1;
    int32_t best_b = -1;
    bool best_pinned = true;
    for (auto & [s, st] : seqs) {
        for (auto & [b, hb] : st.blocks) {
            if (!hb.resident || (uint32_t) b < sink_blocks) {
                continue;
            }
            // unpinned before pinned, oldest first (a follower counts the target's resident blocks as pinned)
            const bool pinned = hb.pinned || (leader && resident_in_leader(s, b));
            if (best_b < 0 || (!pinned && best_pinned) || (pinned == best_pinned && b < best_b)) {
                best_s = s;
                best_b = b;
                best_pinned = pinned;
            }
        }
    }
    if (best_b < 0) {
        return false;
    }
    evict_block(best_s, best_b, seqs[best_s].blocks[best_b]);
    n_evicted++;
    if (kp.trace) {
        LLAMA_LOG_INFO("kvmem_trace: evict seq=%d block=%d pinned=%d\n", best_s, best_b, best_pinned ? 1 : 0);
    }
    return true;
}

bool llama_kvmem_cache::prepare_ubatch(const llama_ubatch & ubatch, slot_info & sinfo) {
    copies_wait();

    // the host pool must take every block this ubatch completes (write-through); init_batch checked the
    // whole batch already, this guards contexts whose ubatches were split elsewhere
    if (!host_room_for(&ubatch, 1)) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, get_last_error().c_str());
        return false;
    }

    for (;;) {
        sinfo = find_slot(ubatch, false);
        if (!sinfo.empty()) {
            return true;
        }
        if (!evict_one(ubatch.seq_id[0][0])) {
            const std::string msg = format("KV tiering: no room for a ubatch of %u tokens in the GPU working set of %u cells "
                    "(raise --kvmem-budget or --kvmem-gen-reserve)", ubatch.n_tokens, get_size());
            LLAMA_LOG_ERROR("%s: %s\n", __func__, msg.c_str());
            set_last_error(msg);
            return false;
        }
    }
}

void llama_kvmem_cache::write_through(llama_seq_id seq_id) {
    const int32_t B = kp.block;
    auto & cells = v_cells[0];
    const llama_pos pmax = cells.seq_pos_max(seq_id);
    if (pmax < 0) {
        return;
    }
    auto & st = seqs[seq_id];
    const int32_t done = (pmax + 1)/B;
    const auto & sp = cells.seq_pos_get(seq_id);

    std::vector<uint32_t> idx;
    for (int32_t b = st.next_host; b < done; ++b) {
        if (st.blocks.count(b)) {
            continue;
        }
        idx.clear();
        for (auto it = sp.lower_bound({ b*B, 0 }); it != sp.end() && it->first < (b + 1)*B; ++it) {
            idx.push_back(it->second);
        }
        if ((int32_t) idx.size() != B) {
            continue; // not a whole block in the working set (e.g. after a restore): stays GPU-only
        }
        if (free_slots.empty()) {
            if (!host_full_logged) {
                LLAMA_LOG_ERROR("%s: kvmem host pool is full; raise --kvmem-host-mib\n", __func__);
                host_full_logged = true;
            }
            break;
        }
        hblock hb;
        hb.slot = free_slots.back();
        free_slots.pop_back();
        hb.resident = true;
        hb.ext.resize(B);
        for (int32_t t = 0; t < B; ++t) {
            hb.ext[t] = cells.ext_get(idx[t]);
        }
        copy_block(slot_ptr(hb.slot), idx, /*to_device*/ false);
        st.blocks.emplace(b, std::move(hb));
    }
    copies_wait();
    st.next_host = std::max(st.next_host, done);
}

bool llama_kvmem_cache::stage_in(llama_seq_id seq_id, int32_t b, hblock & hb) {
    const int32_t B = kp.block;
    auto & cells = v_cells[0];

    // prefer B contiguous free cells (one copy per layer for K and for V), searched from where the
    // last stage-in ended so that a selection staging many blocks scans the cells about once
    std::vector<uint32_t> idx;
    idx.reserve(B);
    const uint32_t n_cells = cells.size();
    uint32_t run = 0;
    for (uint32_t k = 0; k < n_cells && run < (uint32_t) B; ++k) {
        const uint32_t i = (stage_hint + k) % n_cells;
        run = cells.is_empty(i) ? (i == 0 ? 1 : run + 1) : 0; // runs do not wrap around
        if (run == (uint32_t) B) {
            for (uint32_t j = 0; j < (uint32_t) B; ++j) {
                idx.push_back(i + 1 - B + j);
            }
        }
    }
    if (idx.empty()) {
        for (uint32_t i = 0; i < n_cells && (int32_t) idx.size() < B; ++i) {
            if (cells.is_empty(i)) {
                idx.push_back(i);
            }
        }
    }
    if ((int32_t) idx.size() < B) {
        return false;
    }
    stage_hint = (idx.back() + 1) % n_cells;

    copy_block(slot_ptr(hb.slot), idx, /*to_device*/ true);
    for (int32_t t = 0; t < B; ++t) {
        cells.pos_set(idx[t], b*B + t);
        cells.ext_set(idx[t], hb.ext[t]);
        cells.seq_add(idx[t], seq_id);
    }
    hb.resident = true;
    return true;
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

    std::vector<float> buf;

    // pre-RoPE keys of the ubatch ([layer][token][kv head][head_dim], a scratch reused across ubatches):
    // the box (element-wise min/max) of every block this ubatch completed is built from them, and only the
    // rows of each sequence's two newest blocks are kept (to rebuild a box after a truncation)
    if (!leader) {
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
                build_box(st, blk, key_row);
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

    // query rows: the last tokens of this ubatch
    if (kp.method == LLAMA_KVMEM_METHOD_RETRIEVAL && n_lt > 0 && !leader) {
        const uint32_t il0 = layers[0].il;
        ggml_tensor * t0 = il0 < res->t_kvmem_q.size() ? res->t_kvmem_q[il0] : nullptr;
        if (t0 && (size_t) (t0->ne[0]*t0->ne[1]) == per_q) {
            const uint32_t nq = t0->ne[2];
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
            for (uint32_t j = 0; j < nq && nq <= nt; ++j) {
                const uint32_t i = nt - nq + j;
                auto & q = seqs[ubatch.seq_id[i][0]].q;
                q.emplace_back(ubatch.pos[i], std::move(rows[j]));
                while (q.size() > std::max<uint32_t>(kp.query_tokens, 1)) {
                    q.pop_front();
                }
            }
        }
    }

    // write-through of the blocks this ubatch completed
    for (uint32_t s = 0; s < ubatch.n_seqs_unq; ++s) {
        write_through(ubatch.seq_id_unq[s]);
    }
    publish();
}

bool llama_kvmem_cache::select(llama_seq_id seq_id) {
    auto it = seqs.find(seq_id);
    if (it == seqs.end() || it->second.blocks.empty()) {
        return false;
    }
    const int64_t t_start = ggml_time_us();
    auto & st = it->second;
    const uint32_t group = n_head/n_head_kv;

    const int32_t n_blocks = st.blocks.rbegin()->first + 1;
    // one block of the budget is kept for the partial tail
    // parallel sequences share the budget: each active one (holding resident blocks) gets an equal part
    uint32_t n_active = 1;
    for (const auto & [s2, st2] : seqs) {
        if (s2 == seq_id) {
            continue;
        }
        for (const auto & [b, hb] : st2.blocks) {
            if (hb.resident) {
                n_active++;
                break;
            }
        }
    }
    const uint32_t share = std::max<uint32_t>(sink_blocks + recent_blocks + 2, budget_blocks/n_active);
    const uint32_t avail = std::min(budget_blocks, share) - 1;

    std::set<int32_t> target;
    uint32_t n_sink = 0, n_recent = 0, n_scored = 0;
    for (auto & [b, hb] : st.blocks) {
        if ((uint32_t) b < sink_blocks && target.size() < avail) {
            target.insert(b);
            n_sink++;
        }
    }
    for (auto bit = st.blocks.rbegin(); bit != st.blocks.rend() && n_recent < recent_blocks && target.size() < avail; ++bit) {
        if (target.insert(bit->first).second) {
            n_recent++;
        }
    }

    std::vector<std::pair<float, int32_t>> ranked;
    uint32_t query_tokens = 0;
    if (kp.method == LLAMA_KVMEM_METHOD_RETRIEVAL && !st.q.empty()) {
        // Quest-style upper bound: per block/layer/KV head the element-wise min and max of the pre-RoPE keys
        // bound q.k for any key of the block by sum_d max(q_d*kmin_d, q_d*kmax_d). Each query token and query
        // head of the group is scored on its own (unit-normalized) and the max is kept, so one sharp query
        // token is enough; heads differ in scale, so scores are z-normalized per (layer, head) across the
        // candidates, and the block's score is the mean of its top few heads: retrieval is carried by few heads.
        // q.k <= sum_d max(q_d*kmin_d, q_d*kmax_d) = [q+ | q-] . [kmax | kmin]: one dot product of 2*head_dim
        // per (query row, query head, block, layer, KV head). Work is split by (layer, KV head): a thread
        // builds that pair's query set ([rows x group][2*head_dim], a few hundred KB that stays in cache)
        // and streams every candidate's box row past it, so each box is read once and the queries never
        // leave the core's cache (query-major order re-read the whole query set per block: memory-bound).
        query_tokens = st.q.size();
        const size_t hd2 = 2*(size_t) head_dim;
        const size_t per_q = (size_t) n_head*head_dim;
        std::vector<const float *> qrows;
        for (const auto & row : st.q) {
            qrows.push_back(row.second.data());
        }
        const size_t n_lh = (size_t) n_lt*n_head_kv;
        std::vector<int32_t> cand;
        std::vector<const float *> cand_kb;
        for (auto & [b, hb] : st.blocks) {
            const auto kit = st.kbox.find(b);
            if (target.count(b) || kit == st.kbox.end()) {
                continue;
            }
            cand.push_back(b);
            cand_kb.push_back(kit->second.data());
        }
        std::vector<float> cs(cand.size()*n_lh); // [cand][n_lh]
        auto score_pair = [&](size_t p, std::vector<float> & qs) {
            const uint32_t lt = p / n_head_kv, hk = p % n_head_kv;
            const size_t n_rows = qrows.size()*group;
            qs.resize(n_rows*hd2);
            for (size_t r = 0; r < qrows.size(); ++r) {
                for (uint32_t g = 0; g < group; ++g) {
                    const float * q = qrows[r] + lt*per_q + ((size_t) hk*group + g)*head_dim;
                    double n2 = 0.0;
                    for (uint32_t d = 0; d < head_dim; ++d) {
                        n2 += (double) q[d]*q[d];
                    }
                    const float inv = n2 > 0.0 ? (float) (1.0/std::sqrt(n2)) : 0.0f;
                    float * out = qs.data() + (r*group + g)*hd2;
                    for (uint32_t d = 0; d < head_dim; ++d) {
                        out[d]            = std::max(q[d]*inv, 0.0f);
                        out[head_dim + d] = std::min(q[d]*inv, 0.0f);
                    }
                }
            }
            for (size_t c = 0; c < cand.size(); ++c) {
                cs[c*n_lh + p] = kvmem_bound_max(qs.data(), n_rows, cand_kb[c] + p*hd2, hd2);
            }
        };
        const double work = (double) cand.size()*n_lh*query_tokens*group*hd2;
        const size_t n_threads = std::max<size_t>(1, std::min<size_t>({ (size_t) std::thread::hardware_concurrency(), 16,
                    (size_t) (work/16e6) + 1, n_lh }));
        auto worker = [&](size_t t) {
            std::vector<float> qs;
            for (size_t p = t; p < n_lh; p += n_threads) {
                score_pair(p, qs);
            }
        };
        if (n_threads <= 1) {
            worker(0);
        } else {
            std::vector<std::thread> pool;
            for (size_t t = 1; t < n_threads; ++t) {
                pool.emplace_back(worker, t);
            }
            worker(0);
            for (auto & th : pool) {
                th.join();
            }
        }
        const size_t nc = cand.size();
        std::vector<float> zs(nc*n_lh, 0.0f);
        for (size_t j = 0; j < n_lh && nc > 1; ++j) {
            double m = 0.0, v = 0.0;
            for (size_t c = 0; c < nc; ++c) {
                m += cs[c*n_lh + j];
            }
            m /= nc;
            for (size_t c = 0; c < nc; ++c) {
                const double x = cs[c*n_lh + j] - m;
                v += x*x;
            }
            const double sd = std::sqrt(v/nc) + 1e-6;
            for (size_t c = 0; c < nc; ++c) {
                zs[c*n_lh + j] = (float) ((cs[c*n_lh + j] - m)/sd);
            }
        }
        const size_t top = std::max<size_t>(1, std::min<size_t>(KVMEM_TOP_HEADS, n_lh));
        for (size_t c = 0; c < nc; ++c) {
            float * zc = zs.data() + c*n_lh;
            std::partial_sort(zc, zc + top, zc + n_lh, std::greater<float>());
            double sc = 0.0;
            for (size_t j = 0; j < top; ++j) {
                sc += zc[j];
            }
            ranked.push_back({ (float) (sc/(double) top), cand[c] });
        }
        std::sort(ranked.begin(), ranked.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    } else {
        // recency: extend the recent window
        for (auto bit = st.blocks.rbegin(); bit != st.blocks.rend(); ++bit) {
            if (!target.count(bit->first)) {
                ranked.push_back({ 0.0f, bit->first });
            }
        }
    }
    std::set<int32_t> picked;
    for (auto & [score, b] : ranked) {
        if (target.size() >= avail) {
            break;
        }
        target.insert(b);
        picked.insert(b);
        if (kp.method == LLAMA_KVMEM_METHOD_RETRIEVAL) {
            n_scored++;
        }
        if (kp.trace) {
            LLAMA_LOG_INFO("kvmem_trace: pick seq=%d block=%d score=%.4f\n", seq_id, b, score);
        }
    }

    // plan as a diff: resident blocks in the target stay, others leave, missing ones come in
    const int64_t t_stage = ggml_time_us();
    uint32_t staged_in = 0, staged_out = 0, reused = 0;
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
        hb.pinned = picked.count(b) > 0;
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
        hb.pinned = picked.count(b) > 0;
        staged_in++;
    }

    copies_wait();
    const double stage_ms = (ggml_time_us() - t_stage)/1000.0;

    for (auto * f : followers) {
        f->follow_leader();
    }

    const double ms = (ggml_time_us() - t_start)/1000.0;
    st.refresh_at = kp.refresh > 0 ? v_cells[0].seq_pos_max(seq_id) + 1 + (llama_pos) kp.refresh : -1;
    st.n_select++;
    st.last_ms = ms;
    n_selections++;
    n_staged_in  += staged_in;
    n_staged_out += staged_out;
    last_select_ms = ms;

    LLAMA_LOG_WARN("kvmem_score: SELECT seq=%d n_blocks=%d budget_blocks=%u share=%u sink=%u recent=%u scored=%u staged_in=%u staged_out=%u reused=%u query_tokens=%u ms=%.3f stage_ms=%.3f stage_mib=%.1f\n",
            seq_id, n_blocks, budget_blocks, avail + 1, n_sink, n_recent, n_scored, staged_in, staged_out, reused, query_tokens, ms,
            stage_ms, (double) staged_in*block_bytes/1024.0/1024.0);
    publish();

    return staged_in > 0;
}

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
                target_resident += hb.resident && b <= st.blocks.rbegin()->first ? 1 : 0;
            }
            n_staged_in  += staged_in;
            n_staged_out += staged_out;
            LLAMA_LOG_WARN("kvmem_score: FOLLOW seq=%d n_blocks=%zu staged_in=%u staged_out=%u resident=%u target_resident=%u common=%u\n",
                    s, st.blocks.size(), staged_in, staged_out, resident, target_resident, common);
        }
    }
    publish();
}

llama_pos llama_kvmem_cache::refresh_pos(llama_seq_id seq_id) const {
    const auto it = seqs.find(seq_id);
    return it == seqs.end() || leader ? -1 : it->second.refresh_at;
}

void llama_kvmem_cache::forget_from(seq_state & st, llama_pos p0, llama_pos p1) {
    const int32_t B = kp.block;
    st.krow.erase(st.krow.lower_bound(p0), st.krow.lower_bound(p1));
    const int32_t b1 = p1 == std::numeric_limits<llama_pos>::max() ? std::numeric_limits<int32_t>::max() : (p1 - 1)/B + 1;
    st.kbox.erase(st.kbox.lower_bound(p0/B), st.kbox.lower_bound(b1));
    for (auto it = st.q.begin(); it != st.q.end(); ) {
        it = it->first >= p0 && it->first < p1 ? st.q.erase(it) : it + 1;
    }
}

void llama_kvmem_cache::build_box(seq_state & st, int32_t b,
        const std::function<const float * (llama_pos, uint32_t)> & key_row) {
    const int32_t B = kp.block;
    for (llama_pos pos = b*B; pos < (b + 1)*B; ++pos) {
        if (!key_row(pos, 0)) {
            return; // not complete (yet)
        }
    }
    // layout [layer][kv head][max | min][head_dim]: one contiguous row per (layer, head)
    auto & kb = st.kbox[b];
    kb.resize((size_t) n_lt*n_head_kv*2*head_dim);
    for (size_t o = 0; o < kb.size(); o += 2*head_dim) {
        std::fill(kb.begin() + o,            kb.begin() + o + head_dim,   -INFINITY);
        std::fill(kb.begin() + o + head_dim, kb.begin() + o + 2*head_dim, INFINITY);
    }
    for (llama_pos pos = b*B; pos < (b + 1)*B; ++pos) {
        for (uint32_t lt = 0; lt < n_lt; ++lt) {
            const float * src = key_row(pos, lt);
            for (uint32_t hk = 0; hk < n_head_kv; ++hk) {
                float * kmx = kb.data() + ((size_t) lt*n_head_kv + hk)*2*head_dim;
                float * kmn = kmx + head_dim;
                const float * sh = src + (size_t) hk*head_dim;
                for (uint32_t d = 0; d < head_dim; ++d) {
                    kmx[d] = std::max(kmx[d], sh[d]);
                    kmn[d] = std::min(kmn[d], sh[d]);
                }
            }
        }
    }
}

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
    kp.query_tokens = params.kvmem_query_tokens > 0 ? params.kvmem_query_tokens : 32;
    kp.refresh      = std::max(0, params.kvmem_refresh);
    kp.host_mib     = std::max(0, params.kvmem_host_mib);
    kp.method       = params.kvmem_method == LLAMA_KVMEM_METHOD_RECENCY ? LLAMA_KVMEM_METHOD_RECENCY : LLAMA_KVMEM_METHOD_RETRIEVAL;
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
        const uint32_t n_ub = km->max_ubatch(n_ubatch);
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
// llama_context: turn hook
//

// the outputs of a decode of the last n_tail tokens of a batch of n, mapped back to the caller's indices
static void kvmem_map_tail_outputs(std::vector<int32_t> & output_ids, size_t n, size_t n_tail) {
    std::vector<int32_t> ids(output_ids.begin(), output_ids.end());
    std::fill(output_ids.begin(), output_ids.end(), -1);
    for (size_t j = 0; j < n_tail && j < ids.size(); ++j) {
        if (n - n_tail + j < output_ids.size()) {
            output_ids[n - n_tail + j] = ids[j];
        }
    }
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

    // a turn = several new tokens of one sequence of which only the last is an output (a prompt's end);
    // speculative verification batches (every token an output) are not turns
    const size_t n = batch.tokens.size();
    bool turn = n >= 2 && batch.tokens.back().output && batch.tokens.back().seq_ids.size() == 1;
    const llama_seq_id s = turn ? *batch.tokens.back().seq_ids.begin() : -1;
    for (size_t i = 0; turn && i < n; ++i) {
        const auto & tok = batch.tokens[i];
        turn = tok.seq_ids.size() == 1 && *tok.seq_ids.begin() == s && !tok.has_embd && (!tok.output || i + 1 == n);
    }
    if (!turn) {
        // decode-time refresh at an exact position: a single-sequence batch that crosses it is split there,
        // so every token sees the working set it would see when decoded one at a time (speculative
        // verification batches then give the same greedy output as plain decoding)
        llama_seq_id s1 = n > 0 && batch.tokens[0].seq_ids.size() == 1 ? *batch.tokens[0].seq_ids.begin() : -1;
        for (size_t i = 0; s1 >= 0 && i < n; ++i) {
            if (batch.tokens[i].seq_ids.size() != 1 || *batch.tokens[i].seq_ids.begin() != s1) {
                s1 = -1;
            }
        }
        const llama_pos r = s1 >= 0 && sampling.samplers.empty() ? km->refresh_pos(s1) : -1;
        if (r < 0) {
            return kvmem_decode_multi(batch);
        }
        size_t j = 0;
        while (j < n && batch.tokens[j].pos[0] < r) {
            j++;
        }
        if (j == 0) {
            km->select(s1);
        } else if (j < n) {
            return kvmem_decode_split(batch, j, s1);
        }
        return decode_impl(batch);
    }

    // the turn's last query_tokens form the query; after a selection they are recomputed so that they
    // (and the logits) see the retrieved blocks
    const size_t n_tail = std::min<size_t>(n, std::max<uint32_t>(km->params().query_tokens, 1));
    const size_t n_head = n - n_tail;
    llama_batch_ext tail = batch;
    tail.tokens.erase(tail.tokens.begin(), tail.tokens.begin() + n_head);

    // draft-mtp reads one target hidden-state row per batch token (unmasked nextn rows): keep the
    // head's rows across the tail's recompute and put the batch back together at the end
    const bool nextn_rows = cparams.embeddings_nextn && !cparams.embeddings_nextn_masked;
    const size_t n_embd_nextn = model.hparams.n_embd_out();
    std::vector<float> nextn_head;
    auto save_head_rows = [&]() {
        float * rows = nextn_rows ? get_embeddings_nextn() : nullptr;
        if (rows && n_head > 0) {
            nextn_head.assign(rows, rows + n_head*n_embd_nextn);
        }
    };
    auto place_tail_rows = [&]() {
        float * rows = nextn_rows ? get_embeddings_nextn() : nullptr;
        if (rows && !nextn_head.empty()) {
            std::memmove(rows + n_head*n_embd_nextn, rows, n_tail*n_embd_nextn*sizeof(float));
            std::memcpy(rows, nextn_head.data(), nextn_head.size()*sizeof(float));
        }
    };

    // hybrid models: the recurrent state cannot be rolled back by seq_rm, so the turn is decoded as
    // head + tail with a snapshot of the sequence's recurrent state in between (only when a selection
    // could stage anything in: otherwise the batch is decoded as is, like upstream)
    std::vector<uint8_t> snapshot;
    if (km->recr && km->may_stage(n)) {
        if (n_head > 0) {
            llama_batch_ext head = batch;
            head.tokens.resize(n_head);
            const int ret = decode_impl(head);
            if (ret != 0) {
                return ret;
            }
            save_head_rows();
        }
        kvmem_state_writer w;
        km->recr->state_write(w, s);
        snapshot = std::move(w.buf);
        const int ret = decode_impl(tail);
        if (ret != 0) {
            return ret;
        }
        kvmem_map_tail_outputs(output_ids, n, n_tail);
        if (!km->select(s)) {
            place_tail_rows();
            return 0;
        }
        kvmem_state_reader r(snapshot);
        km->recr->state_read(r, s);
        km->in_redecode = true;
        km->seq_rm(s, tail.tokens.front().pos[0], -1);
    } else {
        const int ret = decode_impl(batch);
        if (ret != 0) {
            return ret;
        }
        if (!km->select(s)) {
            return 0;
        }
        save_head_rows();
        km->in_redecode = true;
        memory->seq_rm(s, tail.tokens.front().pos[0], -1);
    }
    const int ret2 = decode_impl(tail);
    km->in_redecode = false;
    if (ret2 != 0) {
        return ret2;
    }
    kvmem_map_tail_outputs(output_ids, n, n_tail);
    place_tail_rows();
    return 0;
}

int llama_context::kvmem_decode_multi(const llama_batch_ext & batch) {
    // several sequences in one batch (parallel slots): each sequence whose prompt ends here (>= 2 tokens,
    // only its last one an output) is a turn; after the batch each turn is selected, the tails of those
    // that staged blocks in are recomputed together, and their outputs replace the first pass's rows
    auto * km = llama_kvmem_cache::from(memory.get());
    const size_t n = batch.tokens.size();
    struct seq_info { size_t count = 0; bool ok = true; };
    std::map<llama_seq_id, seq_info> info;
    for (size_t i = 0; i < n; ++i) {
        const auto & tok = batch.tokens[i];
        for (const auto s : tok.seq_ids) {
            auto & x = info[s];
            x.count++;
            x.ok = x.ok && tok.seq_ids.size() == 1 && !tok.has_embd;
        }
    }
    std::map<llama_seq_id, size_t> last_idx;
    for (size_t i = 0; i < n; ++i) {
        for (const auto s : batch.tokens[i].seq_ids) {
            last_idx[s] = i;
        }
    }
    for (size_t i = 0; i < n; ++i) {
        const auto & tok = batch.tokens[i];
        if (tok.seq_ids.size() == 1 && tok.output && last_idx[*tok.seq_ids.begin()] != i) {
            info[*tok.seq_ids.begin()].ok = false; // outputs inside the sequence: generation or verification
        }
    }
    std::vector<llama_seq_id> turns;
    for (auto & [s, x] : info) {
        if (x.ok && x.count >= 2 && batch.tokens[last_idx[s]].output) {
            turns.push_back(s);
        }
    }

    const int ret = decode_impl(batch);
    if (ret != 0) {
        return ret;
    }
    kvmem_refresh(batch, turns);
    if (turns.empty()) {
        return 0;
    }
    std::set<llama_seq_id> staged;
    for (const auto s : turns) {
        if (km->select(s)) {
            staged.insert(s);
        }
    }
    // the recurrent state of hybrid models cannot be rolled back here, and backend samplers keep their
    // own per-output state: those batches keep the first pass (the selection applies from the next token)
    if (staged.empty() || km->recr || !sampling.samplers.empty()) {
        return 0;
    }

    llama_kvmem_outputs first;
    kvmem_take_outputs(n, first);

    // tails of the staged sequences, in batch order
    std::map<llama_seq_id, size_t> left;
    for (const auto s : staged) {
        left[s] = std::min<size_t>(info[s].count, std::max<uint32_t>(km->params().query_tokens, 1));
    }
    std::map<llama_seq_id, size_t> seen;
    std::vector<size_t> tail_idx;
    llama_batch_ext tail = batch;
    tail.tokens.clear();
    for (size_t i = 0; i < n; ++i) {
        const auto & tok = batch.tokens[i];
        if (tok.seq_ids.size() != 1 || !staged.count(*tok.seq_ids.begin())) {
            continue;
        }
        const llama_seq_id s = *tok.seq_ids.begin();
        if (++seen[s] > info[s].count - left[s]) {
            tail_idx.push_back(i);
            tail.tokens.push_back(tok);
        }
    }
    km->in_redecode = true;
    for (const auto s : staged) {
        for (size_t j = 0; j < tail_idx.size(); ++j) {
            if (*batch.tokens[tail_idx[j]].seq_ids.begin() == s) {
                memory->seq_rm(s, batch.tokens[tail_idx[j]].pos[0], -1);
                break;
            }
        }
    }
    const int ret2 = decode_impl(tail);
    km->in_redecode = false;
    if (ret2 != 0) {
        return ret2;
    }

    // merge: the recomputed rows replace the first pass's rows of the same batch tokens
    llama_kvmem_outputs redo;
    kvmem_take_outputs(tail_idx.size(), redo);
    const size_t n_vocab = model.vocab.n_tokens();
    const size_t n_embd_out = model.hparams.n_embd_out();
    for (size_t j = 0; j < tail_idx.size(); ++j) {
        const size_t i = tail_idx[j];
        if (!first.nextn.empty() && !redo.nextn.empty()) {
            std::memcpy(first.nextn.data() + i*n_embd_out, redo.nextn.data() + j*n_embd_out, n_embd_out*sizeof(float));
        }
        if (!batch.tokens[i].output || first.ids[i] < 0 || redo.ids[j] < 0) {
            continue;
        }
        const size_t r1 = first.ids[i], r2 = redo.ids[j];
        if (!first.logits.empty()) {
            std::memcpy(first.logits.data() + r1*n_vocab, redo.logits.data() + r2*n_vocab, n_vocab*sizeof(float));
        }
        if (!first.embd.empty()) {
            std::memcpy(first.embd.data() + r1*n_embd_out, redo.embd.data() + r2*n_embd_out, n_embd_out*sizeof(float));
        }
    }
    return kvmem_put_outputs(first) ? 0 : -2;
}

void llama_context::kvmem_refresh(const llama_batch_ext & batch, const std::vector<llama_seq_id> & turns) {
    // decode-time refresh of sequences in a multi-sequence batch: re-select those whose next token is at
    // or past their refresh position (single-sequence batches are split exactly at it, see decode())
    auto * km = llama_kvmem_cache::from(memory.get());
    std::map<llama_seq_id, llama_pos> next_pos;
    for (const auto & tok : batch.tokens) {
        if (tok.seq_ids.size() == 1) {
            auto & p = next_pos[*tok.seq_ids.begin()];
            p = std::max(p, tok.pos[0] + 1);
        }
    }
    for (const auto & [s, p] : next_pos) {
        const llama_pos r = km->refresh_pos(s);
        if (r >= 0 && p >= r && std::find(turns.begin(), turns.end(), s) == turns.end()) {
            km->select(s);
        }
    }
}

int llama_context::kvmem_decode_split(const llama_batch_ext & batch, size_t j, llama_seq_id s) {
    // tokens [0, j) see the current working set, the sequence is re-selected, tokens [j, n) see the new
    // one; the outputs of both decodes are put back together in the caller's order
    auto * km = llama_kvmem_cache::from(memory.get());
    const size_t n = batch.tokens.size();
    llama_batch_ext head = batch;
    head.tokens.resize(j);
    int ret = decode_impl(head);
    if (ret != 0) {
        return ret;
    }
    llama_kvmem_outputs a;
    kvmem_take_outputs(j, a);
    km->select(s);
    llama_batch_ext rest = batch;
    rest.tokens.erase(rest.tokens.begin(), rest.tokens.begin() + j);
    ret = decode_impl(rest);
    if (ret != 0) {
        return ret;
    }
    llama_kvmem_outputs b;
    kvmem_take_outputs(n - j, b);
    for (const auto id : b.ids) {
        a.ids.push_back(id >= 0 ? a.n_out + id : -1);
    }
    a.n_out += b.n_out;
    a.logits.insert(a.logits.end(), b.logits.begin(), b.logits.end());
    a.embd.insert(a.embd.end(), b.embd.begin(), b.embd.end());
    a.nextn.insert(a.nextn.end(), b.nextn.begin(), b.nextn.end()); // both or neither: same context settings
    return kvmem_put_outputs(a) ? 0 : -2;
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
