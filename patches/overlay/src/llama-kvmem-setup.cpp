// KVMem: setting tiering up (kvmem-llama): the flags' validation, the checks that disable it with a reason, the
// memory factory, the cache's construction, and MTP draft caches that follow their target's selection.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-model.h"
#include "llama-memory-hybrid.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

//
// context setup hooks
//

static llama_kvmem_params kvmem_params_of(const llama_context_params & params) {
    llama_kvmem_params kp;
    kp.budget       = std::max(0, params.kvmem_budget);
    kp.block        = std::max(0, params.kvmem_block);
    kp.sink         = std::max(0, params.kvmem_sink);
    kp.recent       = std::max(0, params.kvmem_recent);
    kp.gen_reserve  = std::max(0, params.kvmem_gen_reserve);
    kp.query_tokens = std::max(0, params.kvmem_query_tokens);
    kp.refresh      = std::max(0, params.kvmem_refresh);
    kp.host_mib     = std::max(0, params.kvmem_host_mib);
    kp.disk_path    = params.kvmem_disk_path ? params.kvmem_disk_path : "";
    kp.disk_mib     = std::max(0, params.kvmem_disk_mib);
    kp.method       = params.kvmem_method;
    kp.prefill      = params.kvmem_prefill;
    kp.gpu_type     = params.kvmem_gpu_type;
    kp.score_on     = params.kvmem_score_on;
    kp.trace        = params.kvmem_trace;
    kp.n_threads    = std::max(1, params.n_threads);
    return kp;
}

// the one place the tiering settings are checked (llama-server and llama-cli ask at argument parsing through
// llama_kvmem_check_params, so a bad value stops them before the model loads); "" when they are valid. The
// budget's minimum applies when tiering is on, the other values are checked either way.
static std::string kvmem_params_error(const llama_kvmem_params & kp) {
    if (kp.block < 16 || kp.block > 4096) {
        return format("--kvmem-block must be in [16, 4096] (got %u)", kp.block);
    }
    if (kp.budget > 0 && kp.budget < kvmem_min_budget(kp)) {
        return format("--kvmem-budget %u is too small: it must hold --kvmem-sink %u + --kvmem-recent %u (rounded up to "
                "blocks of %u), one retrieved block and the partial last block, i.e. at least %u",
                kp.budget, kp.sink, kp.recent, kp.block, kvmem_min_budget(kp));
    }
    if (kp.gen_reserve < 1) {
        return format("--kvmem-gen-reserve must be >= 1 (got %u)", kp.gen_reserve);
    }
    if (kp.query_tokens < 1 || kp.query_tokens > 4096) {
        return format("--kvmem-query-tokens must be in [1, 4096] (got %u)", kp.query_tokens);
    }
    if (kp.method < 0 || kp.method >= LLAMA_KVMEM_METHOD_COUNT) {
        return format("--kvmem-method %d is unknown", kp.method);
    }
    if (kp.prefill != LLAMA_KVMEM_PREFILL_WINDOW && kp.prefill != LLAMA_KVMEM_PREFILL_RETRIEVAL) {
        return format("--kvmem-prefill %d is unknown", kp.prefill);
    }
    if (kp.gpu_type != LLAMA_KVMEM_GPU_TYPE_F16 && kp.gpu_type != LLAMA_KVMEM_GPU_TYPE_SAME) {
        return format("--kvmem-gpu-type %d is unknown", kp.gpu_type);
    }
    if (kp.score_on < LLAMA_KVMEM_SCORE_ON_AUTO || kp.score_on > LLAMA_KVMEM_SCORE_ON_HOST) {
        return format("--kvmem-score-on %d is unknown", kp.score_on);
    }
    if (kp.disk_mib > 0 && kp.disk_path.empty()) {
        return format("--kvmem-disk-mib %u needs --kvmem-disk-path (the directory of the disk tier)", kp.disk_mib);
    }
    return "";
}

const char * llama_kvmem_check_params(const struct llama_context_params * params) {
    static thread_local std::string msg;
    const llama_kvmem_params kp = kvmem_params_of(*params);
    msg = kvmem_params_error(kp);
    return msg.c_str();
}

void llama_kvmem_configure(llama_cparams & cparams, const llama_context_params & params) {
    llama_kvmem_params kp = kvmem_params_of(params);
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
        const std::string err = kvmem_params_error(kp);
        if (!err.empty()) {
            throw std::runtime_error(err);
        }
    }
    cparams.kvmem = kp;
}

static void kvmem_disable(llama_cparams & cparams, const std::string & reason) {
    LLAMA_LOG_WARN("kvmem_score: DISABLED (%s)\n", reason.c_str());
    cparams.kvmem.budget = 0;
}

void llama_kvmem_check(const llama_model & model, llama_cparams & cparams) {
    if (cparams.kvmem.budget == 0) {
        return;
    }
    const std::string reason = llama_kvmem_cache::check(model, cparams);
    if (!reason.empty()) {
        kvmem_disable(cparams, reason);
    }
}

void llama_kvmem_check_memory(llama_memory_i * mem, llama_cparams & cparams) {
    if (cparams.kvmem.budget > 0 && !llama_kvmem_cache::from(mem)) {
        kvmem_disable(cparams, "the model's memory has no plain attention KV cache to tier (sliding-window and purely "
                "recurrent models are not tiered)");
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
// the cache
//

std::string llama_kvmem_cache::check(const llama_model & model, const llama_cparams & cparams) {
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
    return n_attn == 0 ? "the model has no attention layers" : "";
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

static kvmem_geometry kvmem_geometry_of(const llama_kvmem_params & kp) {
    return { kp.block, kvmem_div_up(kp.sink, kp.block), kvmem_div_up(kp.recent, kp.block), kp.budget/kp.block };
}

// per tiered layer: its tensors and the bytes of a token row in the working set and in the pool
static kvmem_layer_rows kvmem_layer_rows_of(uint32_t il, ggml_tensor * k, ggml_tensor * v, ggml_type pool_k, ggml_type pool_v) {
    for (const auto & [t, n] : { std::make_pair(pool_k, k->ne[0]), std::make_pair(pool_v, v ? v->ne[0] : 0) }) {
        if (n % ggml_blck_size(t) != 0) {
            throw std::runtime_error(format("KV tiering: a KV row of layer %u has %lld values, not a multiple of the "
                        "%s block size %lld; choose another -ctk/-ctv", il, (long long) n, ggml_type_name(t),
                        (long long) ggml_blck_size(t)));
        }
    }
    kvmem_layer_rows l;
    l.il = il;
    l.k = k;
    l.v = v;
    l.row_k  = k->nb[1];
    l.row_v  = v ? v->nb[1] : 0;
    l.hrow_k = ggml_row_size(pool_k, k->ne[0]);
    l.hrow_v = v ? ggml_row_size(pool_v, v->ne[0]) : 0;
    l.pool_k = pool_k;
    l.pool_v = pool_v;
    return l;
}

// a saved state's KV belongs to these weights: a hash (FNV-1a) of every tensor's name and first bytes, so that a
// fine-tune of the same shape is told apart without reading the whole file (~1 ms per 100 tensors, on any backend)
static uint64_t kvmem_weights_fingerprint(const llama_model & model) {
    static constexpr size_t KVMEM_FINGERPRINT_BYTES = 256;
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](const uint8_t * p, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            h = (h ^ p[i])*1099511628211ull;
        }
    };
    std::vector<uint8_t> head(KVMEM_FINGERPRINT_BYTES);
    for (const auto & [name, t] : model.tensors_by_name) {
        mix((const uint8_t *) name.data(), name.size());
        if (!t || !t->buffer || !t->data || ggml_nbytes(t) == 0) {
            continue; // a tensor the loader skipped has no data
        }
        // host memory is read in place; a GPU's through its backend; a CPU buffer of another layout (repacked
        // weights), which cannot be read back, counts by name only
        const size_t n = std::min(head.size(), ggml_nbytes(t));
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
        const bool gpu = dev && (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU ||
                ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_IGPU);
        if (ggml_backend_buffer_is_host(t->buffer)) {
            mix((const uint8_t *) t->data, n);
        } else if (gpu) {
            ggml_backend_tensor_get(t, head.data(), 0, n);
            mix(head.data(), n);
        }
    }
    return h;
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
            kp_in.budget + kp_in.gen_reserve*std::max<uint32_t>(1, n_seq_max), n_seq_max, 1, 0, LLAMA_SWA_TYPE_NONE,
            nullptr, filter, nullptr, nullptr, "kvmem"),
    kp(kp_in), geom(kvmem_geometry_of(kp_in)), rules(geom), n_seq_cap(std::max<uint32_t>(1, n_seq_max)) {
    const auto & hp = model.hparams;
    GGML_ASSERT(kp.block > 0 && kp.budget >= kvmem_min_budget(kp));
    model_id = format("%s, %llu parameters, weights %016llx", model.desc().c_str(),
            (unsigned long long) model.n_elements(), (unsigned long long) kvmem_weights_fingerprint(model));

    for (const auto & l : kvmem_layers()) {
        lrows.push_back(kvmem_layer_rows_of(l.il, l.k, l.v, type_k, type_v));
    }
    const uint32_t il0 = lrows.empty() ? 0 : lrows[0].il;
    dims = { (uint32_t) lrows.size(), hp.n_head(il0), hp.n_head_kv(il0), hp.n_embd_head_k(il0), kp.block };
    scorer = std::make_unique<kvmem_scorer>(dims, kvmem_scorer::resolve(kp.method), kp.n_threads);

    init_pool(n_ctx_total);
    if (target) {
        leader = target;
        target->followers.push_back(this);
    }
    init_summaries();
    init_disk();

    if (target) {
        LLAMA_LOG_WARN("kvmem_score: DRAFT follows the target's selection: blocks=%u layers=%zu host_mib=%.0f\n",
                pool.capacity(), lrows.size(), std::ceil(pool.mib(pool.capacity())));
    } else {
        LLAMA_LOG_WARN("kvmem_score: ARMED blocks=%u block_tokens=%u layers=%zu kv_heads=%u head_dim=%u budget_blocks=%u "
                "host_mib=%.0f method=%s prefill=%s gpu_type=%s/%s pool_type=%s/%s summaries_mib=%.0f score_mib=%.0f "
                "score_on=%s\n",
                pool.capacity(), kp.block, lrows.size(), dims.n_head_kv, dims.head_dim, geom.budget_blocks,
                std::ceil(pool.mib(pool.capacity())), kvmem_scorer::method_name(scorer->method()),
                kp.prefill == LLAMA_KVMEM_PREFILL_RETRIEVAL ? "retrieval" : "window",
                ggml_type_name(this->type_k()), ggml_type_name(this->type_v()), ggml_type_name(type_k), ggml_type_name(type_v),
                summaries ? std::ceil(summaries->bytes()/1024.0/1024.0) : 0.0,
                graph_scorer ? std::ceil((graph_scorer->compute_bytes() + query_store->device_bytes())/1024.0/1024.0) : 0.0,
                score_backend ? ggml_backend_name(score_backend) : "host");
    }
    LLAMA_LOG_INFO("%s: GPU working set %u cells (budget %u + gen reserve %u x %u sequences), sink %u block(s), recent %u block(s), "
            "query %u tokens, refresh %u\n", __func__, get_size(), kp.budget, kp.gen_reserve, n_seq_cap, geom.sink_blocks,
            geom.recent_blocks, kp.query_tokens, kp.refresh);
}

void llama_kvmem_cache::init_summaries() {
    const int32_t m = scorer->method();
    if (leader || (m != LLAMA_KVMEM_METHOD_MASS && m != LLAMA_KVMEM_METHOD_HYBRID)) {
        return; // followers select nothing; the other methods are host-side ablations
    }
    // auto: on a device next to the working set; with the working set in host memory the host scorer is the faster
    // one (a ggml graph of many small nodes pays a thread barrier per node), but `device` runs the graph there too
    score_backend = kp.score_on == LLAMA_KVMEM_SCORE_ON_HOST ? nullptr : copier.device_backend();
    if (!score_backend && kp.score_on == LLAMA_KVMEM_SCORE_ON_DEVICE) {
        own_score_backend = kvmem_cpu_backend((int) kp.n_threads);
        GGML_ASSERT(own_score_backend && "kvmem: no CPU backend to score on");
        score_backend = own_score_backend;
    }
    if (!score_backend) {
        LLAMA_LOG_INFO("%s: block summaries in host RAM, scored on the CPU\n", __func__);
        return;
    }
    summaries = std::make_unique<kvmem_summary_store>();
    summaries->init(score_backend, dims,
            (uint32_t) (scorer->summary_size()/dims.key_row()), pool.capacity());
    query_store = std::make_unique<kvmem_query_store>();
    const uint32_t n_newest = std::max(kvmem_newest_query_rows(kp.query_tokens), kvmem_prompt_query_rows(kp.query_tokens));
    query_store->init(score_backend, dims, n_seq_cap, kvmem_kept_query_rows(kp.query_tokens), kp.query_tokens, n_newest);
    graph_scorer = std::make_unique<kvmem_graph_scorer>(score_backend, *summaries);
    graph_scorer->reserve({ query_store->largest() }); // a re-selection's question and newest rows
    ggml_backend_dev_t score_dev = ggml_backend_get_device(score_backend);
    if (score_dev && ggml_backend_dev_type(score_dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        graph_scorer->warm_up({ query_store->largest() }); // a GPU's first run is slow; the CPU's is not
    }
    LLAMA_LOG_INFO("%s: block summaries %.1f MiB and query rows %.1f MiB on %s (%.1f MiB of host memory), scoring there "
            "(compute buffer %.1f MiB)\n", __func__, summaries->bytes()/1024.0/1024.0, query_store->device_bytes()/1024.0/1024.0,
            ggml_backend_name(score_backend), query_store->host_bytes()/1024.0/1024.0, graph_scorer->compute_bytes()/1024.0/1024.0);
}

llama_kvmem_cache::~llama_kvmem_cache() {
    for (auto * f : followers) {
        f->leader = nullptr;
    }
    if (leader) {
        auto & fs = leader->followers;
        fs.erase(std::remove(fs.begin(), fs.end(), this), fs.end());
    }
    copier.wait();
    graph_scorer.reset();
    query_store.reset();
    summaries.reset();
    if (own_score_backend) {
        ggml_backend_free(own_score_backend);
    }
}

//
// MTP draft caches follow the target
//

bool llama_kvmem_cache::resident_in_leader(llama_seq_id seq_id, int32_t b) const {
    const kvmem_seq * st = leader->find_seq(seq_id);
    if (!st) {
        return false;
    }
    const auto it = st->blocks.find(b);
    return it != st->blocks.end() && it->second.resident;
}

void llama_kvmem_cache::follow_leader() {
    if (!leader) {
        return;
    }
    for (auto & [s, st] : seqs) {
        uint32_t staged_in = 0, staged_out = 0, resident = 0, common = 0;
        for (auto & [b, hb] : st.blocks) {
            if (hb.resident && !resident_in_leader(s, b)) {
                evict_block(s, b, hb, nullptr);
                staged_out++;
            }
        }
        for (auto & [b, hb] : st.blocks) {
            if (!hb.resident && resident_in_leader(s, b)) {
                if (!stage_in(s, b, hb, nullptr)) {
                    break; // the partial tail / generated tokens fill the rest; the next sync retries
                }
                staged_in++;
            }
            resident += hb.resident ? 1 : 0;
            common   += hb.resident && resident_in_leader(s, b) ? 1 : 0;
        }
        copier.wait();
        if (staged_in + staged_out > 0) {
            uint32_t target_resident = 0;
            if (const kvmem_seq * lst = leader->find_seq(s)) {
                for (const auto & [b, hb] : lst->blocks) {
                    target_resident += hb.resident && !st.blocks.empty() && b <= st.blocks.rbegin()->first ? 1 : 0;
                }
            }
            totals.n_staged_in  += staged_in;
            totals.n_staged_out += staged_out;
            LLAMA_LOG_WARN("kvmem_score: FOLLOW seq=%d n_blocks=%zu staged_in=%u staged_out=%u resident=%u target_resident=%u common=%u\n",
                    s, st.blocks.size(), staged_in, staged_out, resident, target_resident, common);
        }
    }
    publish();
}
