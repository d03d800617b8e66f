// KVMem: the host KV pool and the copies between it and the GPU working set (kvmem-llama). See llama-kvmem-pool.h.

#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-kvmem-stager.h"

#include <algorithm>
#include <functional>
#include <stdexcept>

//
// the host pool
//

kvmem_host_pool::~kvmem_host_pool() {
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
}

void kvmem_host_pool::init(ggml_backend_buffer_type_t buft, size_t block_bytes, uint32_t slots) {
    GGML_ASSERT(buf == nullptr && block_bytes > 0 && slots > 0);
    buf = ggml_backend_buft_alloc_buffer(buft, (size_t) slots*block_bytes);
    if (!buf) {
        throw std::runtime_error(format("kvmem: failed to allocate the host KV pool (%.1f MiB in %s); lower "
                    "--kvmem-host-mib or the context", (double) slots*block_bytes/1024.0/1024.0, ggml_backend_buft_name(buft)));
    }
    base = (uint8_t *) ggml_backend_buffer_get_base(buf);
    slot_bytes = block_bytes;
    n_slots = slots;
    free_slots.reserve(slots);
    for (uint32_t i = 0; i < slots; ++i) {
        free_slots.push_back(slots - 1 - i); // the lowest slot is taken first
    }
    in_use.assign(slots, 0);
}

bool kvmem_host_pool::take(uint32_t & slot) {
    if (free_slots.empty()) {
        return false;
    }
    slot = free_slots.back();
    free_slots.pop_back();
    GGML_ASSERT(!in_use[slot]);
    in_use[slot] = 1;
    return true;
}

void kvmem_host_pool::give(uint32_t slot) {
    GGML_ASSERT(slot < n_slots && in_use[slot] && "a host slot is given back once");
    in_use[slot] = 0;
    free_slots.push_back(slot);
}

uint8_t * kvmem_host_pool::slot_ptr(uint32_t slot) const {
    GGML_ASSERT(slot < n_slots);
    return base + (size_t) slot*slot_bytes;
}

const char * kvmem_host_pool::buffer_name() const {
    return buf ? ggml_backend_buffer_name(buf) : "none";
}

//
// copies
//

ggml_backend_t kvmem_cpu_backend(int n_threads) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_t be = cpu ? ggml_backend_dev_init(cpu, nullptr) : nullptr;
    // the CPU backend is a loadable module: its thread setter is found through the registry
    auto * set_threads = be ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(cpu), "ggml_backend_set_n_threads") : nullptr;
    if (set_threads) {
        set_threads(be, n_threads);
    }
    return be;
}

// staging memory on the working set's backend: two halves of 4 blocks of a 27B model's 16 attention layers in f16.
// More buys little: the stager alone moved 41.9 / 43.3 / 44.0 GB/s with 64 / 128 / 256 MiB on the H200, plain copies
// 54.2 (tests/bench-kvmem-stager.cpp, docs/bench/2026-12-03-bf16-scoring); the planner counts this size
static constexpr size_t KVMEM_STAGING_BYTES = (size_t) 64 << 20;

kvmem_copier::kvmem_copier() = default;

kvmem_copier::~kvmem_copier() {
    wait();
    stager.reset();
    for (auto * be : backends) {
        ggml_backend_free(be);
    }
    if (own_cpu) {
        ggml_backend_free(own_cpu);
    }
}

void kvmem_copier::init(const std::vector<kvmem_layer_rows> & layers_in, uint32_t block_in) {
    layers = layers_in;
    block  = block_in;
    // one backend (own stream) per device holding tiered layers: host<->device block copies are issued
    // asynchronously and waited for once per batch of copies
    layer_be.assign(layers.size(), nullptr);
    for (size_t i = 0; i < layers.size(); ++i) {
        ggml_backend_buffer_t kbuf = layers[i].k->buffer;
        ggml_backend_dev_t dev = kbuf ? ggml_backend_buft_get_device(ggml_backend_buffer_get_type(kbuf)) : nullptr;
        if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU || ggml_backend_buffer_is_host(kbuf)) {
            continue;
        }
        auto it = std::find_if(backends.begin(), backends.end(),
                [dev](ggml_backend_t be) { return ggml_backend_get_device(be) == dev; });
        if (it == backends.end()) {
            ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
            if (!be) {
                continue;
            }
            backends.push_back(be);
            it = backends.end() - 1;
        }
        layer_be[i] = *it;
    }
    init_stager();
}

void kvmem_copier::init_stager() {
    if (layers.empty() || std::adjacent_find(layer_be.begin(), layer_be.end(), std::not_equal_to<>()) != layer_be.end()) {
        return; // layers over several devices, or some in host memory
    }
    ggml_backend_t be = layer_be[0];
    if (!be) {
        if (!converts(false) && !converts(true)) {
            return; // host memory of the same type: plain copies
        }
        own_cpu = kvmem_cpu_backend(1); // get_rows and set_rows run on one thread: more would wait at barriers
        if (!own_cpu) {
            return;
        }
        be = own_cpu;
    }
    stager = std::make_unique<kvmem_stager>();
    stager->init(be, layers, block, KVMEM_STAGING_BYTES);
}

std::string kvmem_copier::path() const {
    if (!stager) {
        return "per run of cells";
    }
    return format("staged on %s (%u blocks, %.0f MiB%s)", ggml_backend_name(layer_be[0] ? layer_be[0] : own_cpu),
            stager->capacity(), stager->staging_bytes()/1024.0/1024.0, stager->overlaps() ? ", copies on their own stream" : "");
}

bool kvmem_copier::converts(bool is_v) const {
    return !layers.empty() && (is_v ? layers[0].pool_v != layers[0].v->type : layers[0].pool_k != layers[0].k->type);
}

size_t kvmem_copier::conv_bytes() const {
    size_t n = 0;
    for (const auto & l : layers) {
        n += (size_t) block*((converts(false) ? l.row_k : 0) + (l.v && converts(true) ? l.row_v : 0));
    }
    return n;
}

void kvmem_copier::convert_rows(ggml_type from, const void * src, ggml_type to, void * dst, size_t n_rows, int64_t n_per_row) {
    // through f32 (the pool is quantized, the working set f16, or the reverse)
    conv_f32.resize((size_t) n_rows*n_per_row);
    ggml_get_type_traits(from)->to_float(src, conv_f32.data(), (int64_t) n_rows*n_per_row);
    ggml_quantize_chunk(to, conv_f32.data(), dst, 0, (int64_t) n_rows, n_per_row, nullptr);
}

void kvmem_copier::upload(uint32_t lt, ggml_tensor * t, const void * src, size_t offset, size_t size) {
    if (layer_be[lt]) {
        ggml_backend_tensor_set_async(layer_be[lt], t, src, offset, size);
        pending = true;
    } else {
        ggml_backend_tensor_set(t, src, offset, size);
    }
}

void kvmem_copier::download(uint32_t lt, ggml_tensor * t, void * dst, size_t offset, size_t size) {
    if (layer_be[lt]) {
        ggml_backend_tensor_get_async(layer_be[lt], t, dst, offset, size);
        pending = true;
    } else {
        ggml_backend_tensor_get(t, dst, offset, size);
    }
}

void kvmem_copier::copy_runs(uint32_t lt, ggml_tensor * t, uint8_t * rows, size_t row, const std::vector<uint32_t> & idx,
        bool to_dev) {
    GGML_ASSERT(idx.size() == block);
    for (uint32_t tok = 0; tok < block; ) {
        uint32_t r = 1;
        while (tok + r < block && idx[tok + r] == idx[tok] + r) {
            r++;
        }
        uint8_t * h = rows + (size_t) tok*row;
        if (to_dev) {
            upload(lt, t, h, (size_t) idx[tok]*row, (size_t) r*row);
        } else {
            download(lt, t, h, (size_t) idx[tok]*row, (size_t) r*row);
        }
        tok += r;
    }
}

void kvmem_copier::to_device(const uint8_t * host, const std::vector<uint32_t> & idx) {
    if (stager) {
        stager->to_device(host, idx);
        return;
    }
    // converted rows go through a buffer of the working set's type that lives until wait()
    uint8_t * ws = nullptr;
    if (converts(false) || converts(true)) {
        if (conv_pending > ((size_t) 256 << 20)) {
            wait(); // bound the host memory held by uploads in flight
        }
        conv_bufs.emplace_back(conv_bytes());
        ws = conv_bufs.back().data();
        conv_pending += conv_bufs.back().size();
    }
    const uint8_t * slot = host;
    for (uint32_t lt = 0; lt < layers.size(); ++lt) {
        const auto & l = layers[lt];
        const uint8_t * hv = slot + (size_t) block*l.hrow_k;
        for (const bool is_v : { false, true }) {
            ggml_tensor * t = is_v ? l.v : l.k;
            if (!t) {
                continue;
            }
            const size_t row = is_v ? l.row_v : l.row_k;
            uint8_t * rows = const_cast<uint8_t *>(is_v ? hv : slot); // uploads only read it
            if (converts(is_v)) {
                convert_rows(is_v ? l.pool_v : l.pool_k, rows, t->type, ws, block, t->ne[0]);
                rows = ws;
                ws += (size_t) block*row;
            }
            copy_runs(lt, t, rows, row, idx, /*to_dev*/ true);
        }
        slot += (size_t) block*(l.hrow_k + l.hrow_v);
    }
}

void kvmem_copier::to_host(uint8_t * host, const std::vector<uint32_t> & idx) {
    if (stager) {
        stager->to_host(host, idx);
        return;
    }
    // downloads of converted rows land in a buffer of the working set's type, converted into the slot after them
    std::vector<uint8_t> down(conv_bytes());
    struct convert_back { uint8_t * rows; uint8_t * dst; ggml_type from, to; int64_t n_per_row; };
    std::vector<convert_back> back;
    uint8_t * ws = down.data();
    uint8_t * slot = host;
    for (uint32_t lt = 0; lt < layers.size(); ++lt) {
        const auto & l = layers[lt];
        uint8_t * hv = slot + (size_t) block*l.hrow_k;
        for (const bool is_v : { false, true }) {
            ggml_tensor * t = is_v ? l.v : l.k;
            if (!t) {
                continue;
            }
            const size_t row = is_v ? l.row_v : l.row_k;
            uint8_t * rows = is_v ? hv : slot;
            if (converts(is_v)) {
                back.push_back({ ws, rows, t->type, is_v ? l.pool_v : l.pool_k, t->ne[0] });
                rows = ws;
                ws += (size_t) block*row;
            }
            copy_runs(lt, t, rows, row, idx, /*to_dev*/ false);
        }
        slot += (size_t) block*(l.hrow_k + l.hrow_v);
    }
    if (!back.empty()) {
        wait();
        for (const auto & c : back) {
            convert_rows(c.from, c.rows, c.to, c.dst, block, c.n_per_row);
        }
    }
}

void kvmem_copier::wait() {
    if (stager) {
        stager->flush();
    }
    if (pending) {
        for (auto * be : backends) {
            ggml_backend_synchronize(be);
        }
        pending = false;
    }
    conv_bufs.clear();
    conv_pending = 0;
}

//
// the cache's side: slots of its sequences' blocks, write-through and stage-in
//

void llama_kvmem_cache::init_pool(uint32_t n_ctx_total) {
    size_t block_bytes = 0;
    for (const auto & l : lrows) {
        block_bytes += (size_t) kp.block*(l.hrow_k + l.hrow_v);
    }
    copier.init(lrows, kp.block);

    // the device's host buffer type (pinned on CUDA), plain CPU memory otherwise
    ggml_backend_buffer_type_t buft = nullptr;
    if (!lrows.empty() && lrows[0].k->buffer) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(lrows[0].k->buffer));
        buft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    }
    if (!buft) {
        buft = ggml_backend_cpu_buffer_type();
    }
    uint32_t slots = kvmem_div_up(n_ctx_total, kp.block) + 1;
    if (kp.host_mib > 0) {
        slots = (uint32_t) (((size_t) kp.host_mib*1024*1024)/block_bytes);
        if (slots == 0) {
            throw std::runtime_error(format("--kvmem-host-mib %u is too small: one block of %u tokens needs %.2f MiB",
                        kp.host_mib, kp.block, block_bytes/1024.0/1024.0));
        }
    }
    pool.init(buft, block_bytes, slots);
    LLAMA_LOG_INFO("%s: host KV pool %u blocks (%.1f MiB) in %s; block copies %s\n", __func__, slots, pool.mib(slots),
            ggml_backend_buft_name(buft), copier.path().c_str());
}

bool llama_kvmem_cache::host_room_for(const llama_ubatch * ubatches, size_t n_ubatches, bool whole_batch) {
    // every block the batch completes is written through to the host pool, and its sequences' blocks on the disk
    // tier come back; when that would not fit (after moving other sequences' blocks to disk), the batch is refused
    // before any work (decode returns 1, as for a full KV cache, so the server frees idle slots of a shared pool
    // and retries)
    const int32_t B = kp.block;
    std::map<llama_seq_id, llama_pos> pmax;
    std::map<std::pair<llama_seq_id, int32_t>, uint32_t> added; // the batch's cells per block of each sequence
    for (size_t u = 0; u < n_ubatches; ++u) {
        const llama_ubatch & ub = ubatches[u];
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            const llama_seq_id s = ub.seq_id[i][0];
            const auto it = pmax.find(s);
            pmax[s] = it == pmax.end() ? ub.pos[i] : std::max(it->second, ub.pos[i]);
            added[{ s, ub.pos[i]/B }]++;
        }
    }
    std::set<llama_seq_id> keep;
    uint32_t need = 0, back = 0;
    use_clock++;
    for (const auto & [s, p] : pmax) {
        keep.insert(s);
        kvmem_seq * st = find_seq(s);
        // a slot per B cells of each block the batch completes (an image's cells share a position: more than one)
        for (int32_t b = st ? st->next_host : 0; b < (p + 1)/B; ++b) {
            if (!st || !st->blocks.count(b)) {
                const auto a = added.find({ s, b });
                const uint32_t n = (st ? (uint32_t) block_cells(s, b).size() : 0) + (a == added.end() ? 0 : a->second);
                need += kvmem_div_up(n, (uint32_t) B);
            }
        }
        if (st) {
            st->last_used = use_clock;
            back += n_on_disk(*st);
        }
    }
    if (whole_batch) {
        batch_seqs = keep;
    } else {
        keep.insert(batch_seqs.begin(), batch_seqs.end());
    }
    // the batch's sequences come back first (trading places with others), then room for the blocks it completes
    // (when the others' blocks can make it: none leaves in vain)
    bool home = true;
    for (const auto & [s, p] : pmax) {
        if (!bring_home(s, keep)) {
            home = false;
            break;
        }
    }
    const bool room = home && (pool.n_free() >= need || (pool.n_free() + n_spillable(keep) >= need && make_host_room(need, keep)));
    const bool moved = back > 0 || n_spilled > 0;
    settle_disk("the host pool is full");
    if (moved || !room) {
        publish();
    }
    if (room) {
        return true;
    }
    if (!home) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, get_last_error().c_str());
        return false;
    }
    const std::string disk_note = !disk.enabled() ? "" : !spill_error.empty() ? "; " + spill_error :
            format("; the disk tier has %u of %u blocks free", disk.n_free(), disk.capacity());
    set_last_error(format("KV tiering host pool is full (%u blocks of %u tokens, %.1f MiB, %u free%s): this request "
            "needs %u more; raise --kvmem-host-mib%s (or lower the context)", pool.capacity(), kp.block,
            pool.mib(pool.capacity()), pool.n_free(), disk_note.c_str(), need,
            disk.enabled() ? " or --kvmem-disk-mib" : " or add a disk tier (--kvmem-disk-path)"));
    if (disk.enabled()) {
        LLAMA_LOG_WARN("kvmem_disk: %s\n", get_last_error().c_str()); // the server may free a slot and go on
    }
    return false;
}

void llama_kvmem_cache::write_through(llama_seq_id seq_id, bool embd) {
    const int32_t B = kp.block;
    const auto & cells = kvmem_cells();
    const llama_pos pmax = cells.seq_pos_max(seq_id);
    if (pmax < 0) {
        return;
    }
    kvmem_seq & st = open_seq(seq_id); // a follower's sequence starts here (it sees no begin_batch)
    // after an image's ubatch the block of its position is not done: its next ubatch adds cells at that position
    const int32_t done = embd ? pmax/B : (pmax + 1)/B;
    int32_t written = done;
    for (int32_t b = st.next_host; b < done; ++b) {
        if (st.blocks.count(b)) {
            continue;
        }
        const std::vector<uint32_t> idx = block_cells(seq_id, b);
        if (idx.empty()) {
            continue; // positions an image spans without cells of their own
        }
        const bool regular = one_cell_per_position(b, idx);
        kvmem_block hb;
        if (!take_slots(hb, kvmem_div_up((uint32_t) idx.size(), (uint32_t) B))) {
            if (!host_full_logged) {
                LLAMA_LOG_ERROR("%s: kvmem host pool is full; raise --kvmem-host-mib\n", __func__);
                host_full_logged = true;
            }
            written = b; // tried again after the next ubatch
            break;
        }
        hb.resident = true;
        hb.ext.resize(idx.size());
        for (size_t t = 0; t < idx.size(); ++t) {
            hb.ext[t] = cells.ext_get(idx[t]);
            if (!regular) {
                hb.pos.push_back(cells.pos_get(idx[t])); // an image's block (its cells share positions)
            }
        }
        copy_block(hb, idx, /*to_dev*/ false);
        if (kp.trace && hb.holds_image()) {
            LLAMA_LOG_WARN("kvmem_trace: image seq=%d block=%d cells=%zu slots=%u\n", seq_id, b, idx.size(), hb.n_slots());
        }
        st.blocks.emplace(b, std::move(hb));
        const auto toks = st.rows.tokens.find(b);
        if (toks != st.rows.tokens.end()) {
            st.lexicon.add(b, toks->second); // a document for the lexical picks from now on
        }
        store_summary(st, b, st.blocks.at(b));
    }
    copier.wait();
    st.next_host = std::max(st.next_host, written);
}

bool llama_kvmem_cache::one_cell_per_position(int32_t b, const std::vector<uint32_t> & idx) const {
    const int32_t B = kp.block;
    bool regular = (int32_t) idx.size() == B;
    for (int32_t t = 0; regular && t < B; ++t) {
        regular = kvmem_cells().pos_get(idx[t]) == b*B + t;
    }
    return regular;
}

bool llama_kvmem_cache::take_slots(kvmem_block & hb, uint32_t n) {
    if (pool.n_free() < n) {
        return false;
    }
    GGML_ASSERT(n >= 1 && pool.take(hb.slot));
    hb.more_slots.resize(n - 1);
    for (uint32_t & slot : hb.more_slots) {
        GGML_ASSERT(pool.take(slot));
    }
    return true;
}

void llama_kvmem_cache::copy_block(const kvmem_block & hb, const std::vector<uint32_t> & idx, bool to_dev) {
    // slot j holds cells [j*B, (j+1)*B) of the block; a last slot of fewer cells repeats its last cell, so every
    // copy moves whole slots and the repeated rows, copied back, write that cell's own rows again
    const uint32_t B = kp.block;
    GGML_ASSERT(!idx.empty() && idx.size() == hb.ext.size() && kvmem_div_up((uint32_t) idx.size(), B) == hb.n_slots());
    if (idx.size() == B) {
        to_dev ? copier.to_device(pool_bytes(hb), idx) : copier.to_host(pool_bytes(hb), idx);
        return;
    }
    for (uint32_t j = 0; j < hb.n_slots(); ++j) {
        std::vector<uint32_t> part(idx.begin() + (size_t) j*B, idx.begin() + std::min<size_t>(idx.size(), (size_t) (j + 1)*B));
        part.resize(B, part.back());
        uint8_t * host = pool.slot_ptr(j == 0 ? hb.slot : hb.more_slots[j - 1]);
        GGML_ASSERT(!hb.on_disk && "a block on disk is brought back before its bytes are read");
        to_dev ? copier.to_device(host, part) : copier.to_host(host, part);
    }
}

std::vector<uint32_t> llama_kvmem_cache::block_cells(llama_seq_id seq_id, int32_t b) const {
    const int32_t B = kp.block;
    std::vector<uint32_t> idx;
    const auto & sp = kvmem_cells().seq_pos_get(seq_id);
    for (auto it = sp.lower_bound({ b*B, 0 }); it != sp.end() && it->first < (b + 1)*B; ++it) {
        idx.push_back(it->second);
    }
    return idx;
}

// n free cells: n contiguous ones if there are (one copy per layer for K and for V), searched from `from` (where the
// last stage-in ended, so that a selection staging many blocks scans the cells about once); else the lowest free
// ones; none when fewer than n are free
template <typename is_free_fn>
static std::vector<uint32_t> kvmem_free_cells(uint32_t n_cells, uint32_t n, uint32_t from, const is_free_fn & is_free) {
    std::vector<uint32_t> idx;
    uint32_t run = 0;
    for (uint32_t k = 0; k < n_cells && run < n; ++k) {
        const uint32_t i = (from + k) % n_cells;
        run = is_free(i) ? (i == 0 ? 1 : run + 1) : 0; // runs do not wrap around
        if (run == n) {
            for (uint32_t j = 0; j < n; ++j) {
                idx.push_back(i + 1 - n + j);
            }
        }
    }
    if (idx.empty()) {
        for (uint32_t i = 0; i < n_cells && idx.size() < n; ++i) {
            if (is_free(i)) {
                idx.push_back(i);
            }
        }
    }
    return idx.size() == n ? idx : std::vector<uint32_t>();
}

std::vector<uint32_t> llama_kvmem_cache::free_run(uint32_t n) const {
    const auto & cells = kvmem_cells();
    return kvmem_free_cells(cells.size(), n, stage_hint, [&cells](uint32_t i) { return cells.is_empty(i); });
}

std::vector<std::vector<uint32_t>> llama_kvmem_cache::place_stage_ins(llama_seq_id seq_id,
        const std::vector<int32_t> & leaving, const std::vector<uint32_t> & sizes) {
    const auto & cells = kvmem_cells();
    std::vector<char> is_free(cells.size());
    for (uint32_t i = 0; i < cells.size(); ++i) {
        is_free[i] = cells.is_empty(i);
    }
    for (const int32_t b : leaving) {
        for (const uint32_t i : block_cells(seq_id, b)) {
            is_free[i] = is_free[i] || cells.seq_count(i) == 1; // freed by the eviction unless shared
        }
    }
    std::vector<std::vector<uint32_t>> placed;
    while (placed.size() < sizes.size()) {
        std::vector<uint32_t> idx = kvmem_free_cells(cells.size(), sizes[placed.size()], stage_hint,
                [&is_free](uint32_t i) { return is_free[i] != 0; });
        if (idx.empty()) {
            break;
        }
        for (const uint32_t i : idx) {
            is_free[i] = 0;
        }
        stage_hint = (idx.back() + 1) % cells.size();
        placed.push_back(std::move(idx));
    }
    return placed;
}

bool llama_kvmem_cache::stage_in(llama_seq_id seq_id, int32_t b, kvmem_block & hb, kvmem_journal * journal) {
    const std::vector<uint32_t> idx = free_run((uint32_t) hb.ext.size());
    if (idx.empty()) {
        return false;
    }
    stage_hint = (idx.back() + 1) % kvmem_cells().size();
    return stage_in_at(seq_id, b, hb, idx, journal);
}

bool llama_kvmem_cache::stage_in_at(llama_seq_id seq_id, int32_t b, kvmem_block & hb, const std::vector<uint32_t> & idx,
        kvmem_journal * journal) {
    auto & cells = kvmem_cells();
    GGML_ASSERT(!hb.resident && "a block is staged in once");
    if (idx.size() != hb.ext.size()) {
        return false;
    }
    for (const uint32_t i : idx) {
        if (i >= cells.size() || !cells.is_empty(i)) {
            return false;
        }
    }
    copy_block(hb, idx, /*to_dev*/ true);
    book_stage_in(seq_id, b, hb, idx, journal);
    return true;
}

void llama_kvmem_cache::book_stage_in(llama_seq_id seq_id, int32_t b, kvmem_block & hb, const std::vector<uint32_t> & idx,
        kvmem_journal * journal) {
    auto & cells = kvmem_cells();
    GGML_ASSERT(!hb.resident && idx.size() == hb.ext.size() && "a block is staged in once, into as many cells as it has");
    for (size_t t = 0; t < idx.size(); ++t) {
        GGML_ASSERT(cells.is_empty(idx[t]) && "a stage-in takes free cells");
        cells.pos_set(idx[t], hb.cell_pos(b, kp.block, (uint32_t) t));
        cells.ext_set(idx[t], hb.ext[t]);
        cells.seq_add(idx[t], seq_id);
    }
    hb.resident = true;
    if (journal) {
        journal->staged.push_back({ seq_id, b });
    }
}

bool llama_kvmem_cache::stage_in_making_room(llama_seq_id seq_id, int32_t b, kvmem_block & hb, kvmem_journal * journal) {
    bool ok = stage_in(seq_id, b, hb, journal);
    while (!ok && evict_one(seq_id, journal)) {
        ok = stage_in(seq_id, b, hb, journal);
    }
    return ok;
}
