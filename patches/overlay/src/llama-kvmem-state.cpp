// KVMem: a tiered context's saved state (kvmem-llama): llama_state_seq_* and the server's slot save/restore.
//
// A state holds every sequence's whole history: the working set as llama_kv_cache writes it (the same cells in the
// same order, so the next tokens attend as before), then the host pool's blocks (K/V as the pool keeps them, block
// summaries, token ids, M-RoPE positions and pick scores, the key rows of the newest blocks). A state of another
// block size, model, layer layout, pool type or scorer is refused with what differs, and the sequence is left empty,
// never as a context with holes. The restored sequence is idle: its next prompt is a new turn that selects as after
// any prompt.

#include "llama-kvmem-state.h"
#include "llama-kvmem.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-mmap.h"
#include "llama-model.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>

#ifndef _WIN32
#include <unistd.h>
#endif

static constexpr uint32_t KVMEM_STATE_MAGIC   = 0x544d564b; // "KVMT"
static constexpr uint32_t KVMEM_STATE_VERSION = 2; // 2: blocks of images (their cells' positions, several slots)

template <typename T>
static void kvmem_put(llama_io_write_i & io, const T & v) {
    io.write(&v, sizeof(v));
}

template <typename T>
static T kvmem_take(llama_io_read_i & io) {
    T v;
    io.read(&v, sizeof(v));
    return v;
}

template <typename T>
static void kvmem_put_vec(llama_io_write_i & io, const std::vector<T> & v) {
    kvmem_put<uint64_t>(io, v.size());
    if (!v.empty()) {
        io.write(v.data(), v.size()*sizeof(T));
    }
}

// what a record of unbounded size may hold at most (a corrupt length must not allocate the machine's memory)
static constexpr size_t kvmem_take_limit = (size_t) 1 << 34;

// a vector of at most `max` values
template <typename T>
static std::vector<T> kvmem_take_vec(llama_io_read_i & io, size_t max) {
    const uint64_t n = kvmem_take<uint64_t>(io);
    if (n > max) {
        throw std::runtime_error(format("a tiered state's record holds %llu values where at most %zu fit: the file is "
                "corrupt", (unsigned long long) n, max));
    }
    std::vector<T> v(n);
    if (n > 0) {
        io.read(v.data(), n*sizeof(T));
    }
    return v;
}

// a record of the wrong size (0 is allowed: "none") is a corrupt file, refused before it is read out of bounds
static void kvmem_check_size(size_t got, size_t want, const char * what) {
    if (got != 0 && got != want) {
        throw std::runtime_error(format("a tiered state's %s holds %zu values, not %zu: the file is corrupt", what, got,
                want));
    }
}

template <typename T>
static std::vector<T> kvmem_take_exact(llama_io_read_i & io, size_t n, const char * what) {
    std::vector<T> v = kvmem_take_vec<T>(io, n);
    kvmem_check_size(v.size(), n, what);
    return v;
}

// a map of rows: its size, then each key and its values
template <typename K, typename T>
static void kvmem_put_map(llama_io_write_i & io, const std::map<K, std::vector<T>> & rows) {
    kvmem_put<uint32_t>(io, rows.size());
    for (const auto & [key, values] : rows) {
        kvmem_put(io, key);
        kvmem_put_vec(io, values);
    }
}

template <typename K, typename T>
static std::map<K, std::vector<T>> kvmem_take_map(llama_io_read_i & io, size_t max_values) {
    std::map<K, std::vector<T>> rows;
    for (uint32_t i = 0, n = kvmem_take<uint32_t>(io); i < n; ++i) {
        const K key = kvmem_take<K>(io);
        rows[key] = kvmem_take_vec<T>(io, max_values);
    }
    return rows;
}

std::string llama_kvmem_cache::state_layout() const {
    std::string s = format("model %s; block %u tokens; query %u tokens; summary %zu floats; %zu tiered layers",
            model_id.c_str(), kp.block, kp.query_tokens, scorer->summary_size(), lrows.size());
    for (const auto & l : lrows) {
        s += format("; layer %u pool %s/%s", l.il, ggml_type_name(l.pool_k), ggml_type_name(l.pool_v));
    }
    return s;
}

void llama_kvmem_cache::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    refuse_state_of_follower();
    kvmem_put(io, KVMEM_STATE_MAGIC);
    kvmem_put(io, KVMEM_STATE_VERSION);
    io.write_string(state_layout());
    kvmem_put(io, stage_hint);
    // the sequence's cells, so a restore puts every cell where it was (attention then sums in the same order)
    std::vector<uint32_t> cells;
    if (seq_id != -1) {
        for (const auto & [pos, idx] : kvmem_cells().seq_pos_get(seq_id)) {
            cells.push_back(idx);
        }
        std::sort(cells.begin(), cells.end());
    }
    kvmem_put_vec(io, cells);
    llama_kv_cache::state_write(io, seq_id, flags);
    std::vector<llama_seq_id> ids;
    for (const auto & [s, st] : seqs) {
        if (seq_id == -1 || s == seq_id) {
            ids.push_back(s);
        }
    }
    kvmem_put<uint32_t>(io, ids.size());
    for (const llama_seq_id s : ids) {
        write_seq(io, s, seqs.at(s));
    }
}

void llama_kvmem_cache::write_seq(llama_io_write_i & io, llama_seq_id seq_id, const kvmem_seq & st) const {
    kvmem_put(io, seq_id);
    kvmem_put(io, st.next_host);
    kvmem_put<uint32_t>(io, st.blocks.size());
    kvmem_put<uint32_t>(io, st.n_slots());
    for (const auto & [b, hb] : st.blocks) {
        kvmem_put(io, b);
        kvmem_put<uint8_t>(io, hb.picked);
        kvmem_put(io, hb.score);
        kvmem_put_vec(io, hb.ext);
        kvmem_put_vec(io, hb.pos);
        if (hb.on_disk) { // read where it waits
            std::vector<uint8_t> bytes;
            std::vector<float> summary;
            read_spilled(hb, bytes, summary);
            io.write(bytes.data(), bytes.size());
            kvmem_put_vec(io, summary);
            continue;
        }
        io.write(pool_bytes(hb), pool.block_bytes());
        for (const uint32_t slot : hb.more_slots) {
            io.write(pool.slot_ptr(slot), pool.block_bytes());
        }
        kvmem_put_vec(io, hb.summarized ? block_summary(st, b) : std::vector<float>()); // from the summary store
    }
    // the summaries kept here (the host scorer's, blocks not in the pool yet), the newest key rows (to rebuild a
    // summary after a cut) and the token ids of every block
    kvmem_put_map(io, st.rows.summary);
    kvmem_put<uint32_t>(io, st.rows.stale.size());
    for (const auto & [b, stale] : st.rows.stale) {
        kvmem_put(io, b);
        kvmem_put_vec(io, stale.first);
        kvmem_put(io, stale.second);
    }
    kvmem_put_map(io, st.rows.key);
    kvmem_put_map(io, st.rows.tokens);
    // the newest tokens' query rows (a follow-up's question span reaches back into them), then what recomputes a
    // turn's question on a hybrid model: the recent prompt tokens and the recurrent state snapshots
    kvmem_put<uint32_t>(io, st.rows.query.size());
    for (const auto & [p, row] : st.rows.query) {
        kvmem_put(io, p);
        const float * data = row.empty() ? query_store->ring_row((uint32_t) seq_id, p) : row.data();
        kvmem_put_vec(io, std::vector<float>(data, data + dims.query_row()));
    }
    kvmem_put_vec(io, std::vector<kvmem_prompt_token>(st.tokens.begin(), st.tokens.end()));
    kvmem_put<uint32_t>(io, st.snapshots.size());
    for (const auto & snapshot : st.snapshots) {
        kvmem_put(io, snapshot.position());
        kvmem_put_vec(io, snapshot.written());
    }
}

void llama_kvmem_cache::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    refuse_state_of_follower();
    read_header(io); // a state of another layout is refused before anything changes
    refuse_restore_under_full_followers(seq_id);
    if (seq_id != -1) {
        seq_rm(seq_id, -1, -1); // what is replaced goes first, also when the state holds no cells
    }
    const uint32_t hint = kvmem_take<uint32_t>(io);
    // the working set: llama_kv_cache empties what it replaces (our seq_rm and clear give the old history's host
    // slots back), into the cells the sequence had when they are free
    slot_info_vec_t layout = saved_layout(kvmem_take_vec<uint32_t>(io, get_size()), seq_id);
    llama_kv_cache::state_read_sinfo(io, seq_id, flags, nullptr, layout.empty() ? nullptr : &layout);
    try {
        const uint32_t n_seqs = kvmem_take<uint32_t>(io);
        if (seq_id != -1 && n_seqs > 1) {
            throw std::runtime_error("a state of several sequences cannot be restored into one");
        }
        for (uint32_t i = 0; i < n_seqs; ++i) {
            const llama_seq_id saved = kvmem_take<llama_seq_id>(io);
            const llama_seq_id dest  = seq_id == -1 ? saved : seq_id;
            if (dest < 0 || (uint32_t) dest >= n_seq_cap) {
                throw std::runtime_error(format("the state holds sequence %d; this context has %u", dest, n_seq_cap));
            }
            read_seq(io, dest);
        }
    } catch (...) {
        if (seq_id == -1) {
            clear(true);
        } else {
            seq_rm(seq_id, -1, -1);
        }
        throw;
    }
    for (auto & [s, st] : seqs) {
        if (seq_id == -1 || s == seq_id) {
            for (auto & [b, hb] : st.blocks) {
                hb.resident = block_cells(s, b).size() == hb.ext.size();
            }
            find_images(st);
        }
    }
    stage_hint = hint < get_size() ? hint : 0;
    publish();
}

void llama_kvmem_cache::check_block_cells(int32_t b, const kvmem_block & hb) const {
    // one cell per position, or (an image's block) each cell's position inside the block
    const llama_pos p0 = b*(llama_pos) kp.block, p1 = p0 + (llama_pos) kp.block;
    const bool ok = b >= 0 && (hb.pos.empty() ? hb.ext.size() == kp.block : hb.pos.size() == hb.ext.size() &&
            std::is_sorted(hb.pos.begin(), hb.pos.end()) && hb.pos.front() >= p0 && hb.pos.back() < p1);
    if (!ok) {
        throw std::runtime_error(format("a tiered state's block %d holds %zu cells at %zu positions that are not its "
                "own: the file is corrupt", b, hb.ext.size(), hb.pos.size()));
    }
}

void llama_kvmem_cache::find_images(kvmem_seq & st) const {
    // a turn's query starts after the last image (its embeddings cannot be decoded again): the end of the last block
    // that holds one
    st.embd_end = -1;
    for (const auto & [b, hb] : st.blocks) {
        if (hb.holds_image()) {
            st.embd_end = (b + 1)*(llama_pos) kp.block;
        }
    }
}

void llama_kvmem_cache::refuse_state_of_follower() const {
    if (leader) {
        throw std::runtime_error("this is a draft model's cache that follows a tiered context (MTP): save and restore "
                "the target context's state; the draft starts a restored sequence empty");
    }
}

void llama_kvmem_cache::refuse_restore_under_full_followers(llama_seq_id seq_id) const {
    // the draft's keys of the history are not in the state: its cache must not hold older tokens of the sequence,
    // or its next batch (after the restored history) would not continue them
    for (const llama_kvmem_cache * f : followers) {
        for (llama_seq_id s = 0; s < (llama_seq_id) n_seq_cap; ++s) {
            if ((seq_id == -1 || s == seq_id) && f->seq_pos_max(s) >= 0) {
                throw std::runtime_error(format("the draft model's cache (MTP) still holds sequence %d: empty it "
                        "(llama_memory_seq_rm on the draft context) before restoring the target's state", s));
            }
        }
    }
}

void llama_kvmem_cache::read_header(llama_io_read_i & io) const {
    if (kvmem_take<uint32_t>(io) != KVMEM_STATE_MAGIC) {
        throw std::runtime_error("the state was not saved by a tiered context (--kvmem-budget): restore it without "
                "tiering, or save it again with tiering on");
    }
    const uint32_t version = kvmem_take<uint32_t>(io);
    if (version != KVMEM_STATE_VERSION) {
        throw std::runtime_error(format("the tiered state has format %u, this engine reads format %u", version,
                KVMEM_STATE_VERSION));
    }
    std::string layout;
    io.read_string(layout);
    if (layout != state_layout()) {
        throw std::runtime_error(format("the tiered state was saved with another layout.\n  saved: %s\n  here:  %s",
                layout.c_str(), state_layout().c_str()));
    }
}

llama_kv_cache::slot_info_vec_t llama_kvmem_cache::saved_layout(const std::vector<uint32_t> & cells,
        llama_seq_id seq_id) {
    if (seq_id == -1 || cells.empty()) {
        return {};
    }
    if (!std::is_sorted(cells.begin(), cells.end()) || std::adjacent_find(cells.begin(), cells.end()) != cells.end()) {
        throw std::runtime_error("a tiered state's cell list is not in order: the file is corrupt");
    }
    const auto & kv = kvmem_cells();
    for (const uint32_t i : cells) {
        if (i >= kv.size() || !kv.is_empty(i)) {
            return {}; // another sequence holds it now: llama_kv_cache finds free cells
        }
    }
    slot_info sinfo;
    sinfo.s0 = sinfo.s1 = 0;
    sinfo.strm = { 0 };
    sinfo.idxs = { cells };
    return { sinfo };
}

void llama_kvmem_cache::read_seq(llama_io_read_i & io, llama_seq_id seq_id) {
    kvmem_seq & st = open_seq(seq_id);
    st.next_host = kvmem_take<int32_t>(io);
    const uint32_t n_blocks = kvmem_take<uint32_t>(io);
    const uint32_t n_slots  = kvmem_take<uint32_t>(io);
    const bool room = n_slots <= pool.n_free() || (n_slots <= pool.n_free() + n_spillable({ seq_id }) &&
            make_host_room(n_slots, { seq_id }));
    settle_disk("to restore a saved state");
    if (!room) {
        throw std::runtime_error(format("the state holds %u blocks of history (%u host slots); the host pool has room "
                "for %u (raise --kvmem-host-mib)", n_blocks, n_slots, pool.n_free()));
    }
    for (uint32_t i = 0; i < n_blocks; ++i) {
        const int32_t b = kvmem_take<int32_t>(io);
        kvmem_block hb;
        hb.picked = kvmem_take<uint8_t>(io) != 0;
        hb.score  = kvmem_take<float>(io);
        hb.ext    = kvmem_take_vec<llama_kv_cell_ext>(io, get_size());
        hb.pos    = kvmem_take_vec<llama_pos>(io, get_size());
        check_block_cells(b, hb);
        if (st.blocks.count(b)) {
            throw std::runtime_error(format("a tiered state holds block %d twice: the file is corrupt", b));
        }
        if (!take_slots(hb, kvmem_div_up((uint32_t) hb.ext.size(), kp.block))) {
            throw std::runtime_error(format("a tiered state's blocks take more than the %u host slots it names: the "
                    "file is corrupt", n_slots));
        }
        auto & placed = st.blocks.emplace(b, std::move(hb)).first->second; // books first: a failure gives it back
        io.read(pool.slot_ptr(placed.slot), pool.block_bytes());
        for (const uint32_t slot : placed.more_slots) {
            io.read(pool.slot_ptr(slot), pool.block_bytes());
        }
        std::vector<float> sum = kvmem_take_vec<float>(io, scorer->summary_size());
        kvmem_check_size(sum.size(), scorer->summary_size(), "block summary");
        if (!sum.empty()) {
            st.rows.summary[b] = std::move(sum);
            store_summary(st, b, placed);
        }
    }
    for (auto & [b, sum] : kvmem_take_map<int32_t, float>(io, scorer->summary_size())) {
        kvmem_check_size(sum.size(), scorer->summary_size(), "block summary");
        st.rows.summary[b] = std::move(sum);
    }
    for (auto & [b, hb] : st.blocks) {
        store_summary(st, b, hb); // saved by a host scorer, restored where the summaries live on the scoring backend
    }
    for (uint32_t i = 0, n = kvmem_take<uint32_t>(io); i < n; ++i) {
        const int32_t b = kvmem_take<int32_t>(io);
        std::vector<float> sum = kvmem_take_vec<float>(io, scorer->summary_size());
        st.rows.stale[b] = { std::move(sum), kvmem_take<uint32_t>(io) };
    }
    st.rows.key = kvmem_take_map<llama_pos, float>(io, (size_t) get_size()*dims.key_row()); // an image's: a row per cell
    st.rows.tokens = kvmem_take_map<int32_t, llama_token>(io, kp.block);
    for (const auto & [p, row] : st.rows.key) {
        if (row.empty() || row.size() % dims.key_row() != 0) { // a row per cell at the position (an image's: several)
            throw std::runtime_error(format("a tiered state's key rows at position %d hold %zu values, not a multiple "
                    "of %zu: the file is corrupt", p, row.size(), dims.key_row()));
        }
    }
    for (const auto & [b, toks] : st.rows.tokens) {
        kvmem_check_size(toks.size(), kp.block, "block's token ids");
    }
    for (const auto & [b, toks] : st.rows.tokens) {
        if (st.blocks.count(b)) {
            st.lexicon.add(b, toks); // a document for the lexical picks, as when it was written through
        }
    }
    for (auto & [p, row] : kvmem_take_map<llama_pos, float>(io, dims.query_row())) {
        kvmem_check_size(row.size(), dims.query_row(), "query row");
        float * ring = query_store ? query_store->ring_row((uint32_t) seq_id, p) : nullptr;
        if (ring) {
            std::copy(row.begin(), row.end(), ring);
            row.clear(); // the position is noted here, the row lives in the graph scorer's ring
        }
        st.rows.query[p] = std::move(row);
    }
    const auto prompt_tokens = kvmem_take_vec<kvmem_prompt_token>(io, kvmem_take_limit);
    st.tokens.assign(prompt_tokens.begin(), prompt_tokens.end());
    for (auto & [p, snapshot] : kvmem_take_map<llama_pos, uint8_t>(io, kvmem_take_limit)) {
        st.snapshots.emplace_back(p, std::move(snapshot)); // restored from these bytes as they are
    }
    if (summaries) {
        summaries->flush();
    }
}

size_t llama_kvmem_write_file(const char * path, const std::function<size_t(llama_file &)> & write) {
    // a name of its own: two processes saving the same file do not write into one temporary file
    const std::string tmp = format("%s.%08x.tmp", path, (unsigned) std::random_device{}());
    FILE * fp = std::fopen(tmp.c_str(), "wb");
    if (!fp) {
        throw std::runtime_error(format("cannot write %s: %s", tmp.c_str(), std::strerror(errno)));
    }
    size_t res = 0;
    try {
        llama_file file(fp);
        res = write(file);
    } catch (const std::exception & e) {
        std::fclose(fp);
        std::remove(tmp.c_str());
        throw std::runtime_error(format("cannot save %s: %s (the previous file is unchanged)", path, e.what()));
    } catch (...) {
        std::fclose(fp);
        std::remove(tmp.c_str());
        throw;
    }
    // buffered bytes that do not fit (a full disk) fail here, not in write(); the rename comes after the data is on
    // the disk, so a power cut leaves the old file or the new one
    bool flushed = std::fflush(fp) == 0;
#ifndef _WIN32
    flushed = flushed && fsync(fileno(fp)) == 0;
#endif
    const int  err     = errno;
    if (std::fclose(fp) != 0 || !flushed || std::rename(tmp.c_str(), path) != 0) {
        const std::string why = std::strerror(flushed ? errno : err);
        std::remove(tmp.c_str());
        throw std::runtime_error(format("cannot save %s: %s (the previous file is unchanged)", path, why.c_str()));
    }
    return res;
}
