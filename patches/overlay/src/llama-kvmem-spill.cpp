// KVMem: blocks between the host pool and the disk tier (kvmem-llama). When a batch needs pool slots that are not
// free, blocks of the other sequences go to disk, the least recently used sequence first and, within it, its blocks
// out of the working set first; a sequence's blocks on disk come back before it runs again (its batches, a
// truncation). See llama-kvmem-disk.h for the file.

#include "llama-kvmem.h"

#include "llama-impl.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <tuple>

// a disk record holds one slot: a block of more slots (an image's) takes a record for each
static bool kvmem_may_spill(const kvmem_block & hb) {
    return !hb.on_disk;
}

// the disk records of a block on disk, one per slot
static std::vector<uint32_t> kvmem_records(const kvmem_block & hb) {
    std::vector<uint32_t> recs = { hb.disk_rec };
    recs.insert(recs.end(), hb.more_recs.begin(), hb.more_recs.end());
    return recs;
}

void llama_kvmem_cache::init_disk() {
    if (leader || kp.disk_path.empty()) {
        return; // a draft's cache follows its target, whose blocks it mirrors in its own pool
    }
    const size_t summary_bytes = summaries ? scorer->summary_size()*sizeof(float) : 0;
    const size_t mib = kp.disk_mib > 0 ? kp.disk_mib : (size_t) std::ceil(pool.mib(pool.capacity()));
    disk.init(kp.disk_path, mib, pool.block_bytes() + summary_bytes);
    LLAMA_LOG_WARN("kvmem_disk: disk tier %u blocks (%.1f MiB) under %s: idle sequences' blocks go there when the host "
            "pool is full\n", disk.capacity(), disk.capacity()*disk.record_bytes()/1024.0/1024.0, disk.path().c_str());
}

uint8_t * llama_kvmem_cache::pool_bytes(const kvmem_block & hb) const {
    GGML_ASSERT(!hb.on_disk && "a block on disk is brought back before its bytes are read");
    return pool.slot_ptr(hb.slot);
}

void llama_kvmem_cache::release_storage(kvmem_block & hb) {
    if (hb.on_disk) {
        for (const uint32_t rec : kvmem_records(hb)) {
            disk.give(rec);
        }
        hb.more_recs.clear();
        hb.on_disk = false;
    } else {
        pool.give(hb.slot);
        for (const uint32_t slot : hb.more_slots) {
            pool.give(slot);
        }
        hb.more_slots.clear();
    }
}

uint32_t llama_kvmem_cache::n_on_disk(const kvmem_seq & st) const {
    if (!disk.enabled()) {
        return 0; // asked at every batch: without a tier, no walk over the blocks on the decode path
    }
    uint32_t n = 0;
    for (const auto & [b, hb] : st.blocks) {
        n += hb.on_disk ? hb.n_slots() : 0;
    }
    return n;
}

bool llama_kvmem_cache::spill(kvmem_block & hb, std::string & err) {
    GGML_ASSERT(kvmem_may_spill(hb));
    const uint32_t k = hb.n_slots();
    if (disk.n_free() < k) {
        err = disk_full_message();
        return false;
    }
    std::vector<uint32_t> recs(k);
    for (uint32_t & rec : recs) {
        GGML_ASSERT(disk.take(rec));
    }
    // a summary in the store lives in the block's first slot, which the next block takes: it goes along
    const std::vector<float> summary = hb.summarized ? summaries->get(hb.slot) : std::vector<float>();
    std::vector<const uint8_t *> src = { pool.slot_ptr(hb.slot) };
    for (const uint32_t slot : hb.more_slots) {
        src.push_back(pool.slot_ptr(slot));
    }
    if (!write_records(recs, src, summary, err)) {
        for (const uint32_t rec : recs) {
            disk.give(rec);
        }
        return false;
    }
    pool.give(hb.slot);
    for (const uint32_t slot : hb.more_slots) {
        pool.give(slot);
    }
    hb.more_slots.clear();
    hb.on_disk = true;
    hb.disk_rec = recs[0];
    hb.more_recs.assign(recs.begin() + 1, recs.end());
    return true;
}

std::string llama_kvmem_cache::disk_full_message() const {
    return format("the disk tier is full (%u blocks, %.1f MiB under %s)", disk.capacity(),
            disk.capacity()*disk.record_bytes()/1024.0/1024.0, disk.path().c_str());
}

uint32_t llama_kvmem_cache::n_spillable(const std::set<llama_seq_id> & keep, uint32_t max_slots) const {
    if (!disk.enabled()) {
        return 0;
    }
    uint32_t n = 0;
    for (const auto & [s, st] : seqs) {
        for (const auto & [b, hb] : st.blocks) {
            n += !keep.count(s) && kvmem_may_spill(hb) && hb.n_slots() <= max_slots ? hb.n_slots() : 0;
        }
    }
    return n;
}

bool llama_kvmem_cache::make_host_room(uint32_t need, const std::set<llama_seq_id> & keep) {
    spill_error.clear();
    if (pool.n_free() >= need || !disk.enabled()) {
        return pool.n_free() >= need;
    }
    copier.wait(); // no copy may still read a slot that is given away
    // sequences that may leave: released (the application is done with them) before idle before the others, each
    // group least recently used first
    std::vector<std::pair<std::tuple<int, uint64_t>, llama_seq_id>> order;
    for (const auto & [s, st] : seqs) {
        if (!keep.count(s) && std::any_of(st.blocks.begin(), st.blocks.end(), [](const auto & e) { return kvmem_may_spill(e.second); })) {
            const int group = st.released ? 0 : st.phase() == kvmem_phase::IDLE ? 1 : 2;
            order.push_back({ { group, st.last_used }, s });
        }
    }
    std::sort(order.begin(), order.end());
    for (const auto & [key, s] : order) {
        kvmem_seq & st = seqs.at(s);
        std::vector<int32_t> blocks; // out of the working set first, then the resident ones, each oldest first
        for (const int pass : { 0, 1 }) {
            for (const auto & [b, hb] : st.blocks) {
                if (kvmem_may_spill(hb) && hb.resident == (pass == 1)) {
                    blocks.push_back(b);
                }
            }
        }
        for (const int32_t b : blocks) {
            kvmem_block & hb = st.blocks.at(b);
            if (pool.n_free() >= need) {
                break;
            }
            if (hb.n_slots() > disk.n_free()) {
                continue; // an image's block needs more records than are left: smaller blocks may still go
            }
            if (!spill(hb, spill_error)) {
                break;
            }
            n_spilled += hb.n_slots();
            if (kp.trace) {
                LLAMA_LOG_WARN("kvmem_trace: spill seq=%d block=%d slots=%u\n", s, b, hb.n_slots());
            }
        }
        if (pool.n_free() >= need || !spill_error.empty()) {
            break;
        }
    }
    if (pool.n_free() < need && spill_error.empty()) {
        spill_error = disk.n_free() == 0 ? disk_full_message() : "no other sequence's blocks can leave the host pool";
    }
    return pool.n_free() >= need;
}

void llama_kvmem_cache::settle_disk(const char * why) {
    if (n_spilled == 0) {
        return;
    }
    std::string err;
    if (!disk.settle(err)) {
        // the blocks may not be on the disk as written: say so (a later read of them fails or is refused)
        set_last_error(format("KV tiering: flushing the disk tier under %s failed: %s", disk.path().c_str(), err.c_str()));
        LLAMA_LOG_ERROR("%s: %s\n", __func__, get_last_error().c_str());
    }
    LLAMA_LOG_WARN("kvmem_disk: %u blocks (%.1f MiB) of idle sequences moved to the disk tier (%s); %u of %u disk blocks "
            "free\n", n_spilled, pool.mib(n_spilled), why, disk.n_free(), disk.capacity());
    n_spilled = 0;
}

bool llama_kvmem_cache::write_records(const std::vector<uint32_t> & recs, const std::vector<const uint8_t *> & src,
        const std::vector<float> & summary, std::string & err) {
    GGML_ASSERT(recs.size() == src.size());
    for (size_t j = 0; j < recs.size(); ++j) {
        std::vector<kvmem_disk_tier::part_out> parts = { { src[j], pool.block_bytes() } };
        if (j == 0) {
            parts.push_back({ summary.data(), summary.size()*sizeof(float) });
        }
        if (!disk.write(recs[j], parts, err)) {
            err = format("writing a block to the disk tier under %s failed: %s", disk.path().c_str(), err.c_str());
            return false;
        }
    }
    return true;
}

bool llama_kvmem_cache::read_records(const kvmem_block & hb, const std::vector<uint8_t *> & dst,
        std::vector<float> & summary, std::string & err) const {
    const std::vector<uint32_t> recs = kvmem_records(hb);
    GGML_ASSERT(hb.on_disk && recs.size() == dst.size());
    summary.assign(hb.summarized ? scorer->summary_size() : 0, 0.0f);
    for (size_t j = 0; j < recs.size(); ++j) {
        std::vector<kvmem_disk_tier::part_in> parts = { { dst[j], pool.block_bytes() } };
        if (j == 0) {
            parts.push_back({ summary.data(), summary.size()*sizeof(float) });
        }
        if (!disk.read(recs[j], parts, err)) {
            return false;
        }
    }
    return true;
}

void llama_kvmem_cache::place_home(kvmem_block & hb, const std::vector<uint32_t> & slots, const std::vector<float> & summary) {
    hb.on_disk = false;
    hb.more_recs.clear();
    hb.slot = slots[0];
    hb.more_slots.assign(slots.begin() + 1, slots.end());
    if (hb.summarized) {
        summaries->put(hb.slot, summary.data());
    }
}

bool llama_kvmem_cache::read_home(kvmem_block & hb, std::string & err) {
    const uint32_t k = hb.n_slots();
    GGML_ASSERT(hb.on_disk && pool.n_free() >= k);
    std::vector<uint32_t> slots(k);
    std::vector<uint8_t *> dst(k);
    for (uint32_t j = 0; j < k; ++j) {
        GGML_ASSERT(pool.take(slots[j]));
        dst[j] = pool.slot_ptr(slots[j]);
    }
    std::vector<float> summary;
    if (!read_records(hb, dst, summary, err)) {
        for (const uint32_t slot : slots) {
            pool.give(slot);
        }
        return false;
    }
    for (const uint32_t rec : kvmem_records(hb)) {
        disk.give(rec);
    }
    place_home(hb, slots, summary);
    return true;
}

bool llama_kvmem_cache::bring_home(llama_seq_id seq_id, const std::set<llama_seq_id> & keep) {
    kvmem_seq * st = find_seq(seq_id);
    if (!st || n_on_disk(*st) == 0) {
        return true;
    }
    std::set<llama_seq_id> kept = keep;
    kept.insert(seq_id);
    // one block at a time, in the order of the records (one pass over the file): each that comes back frees the
    // records that blocks leaving for it take, so two sequences trade places in a full pool over a full tier
    std::vector<std::pair<uint32_t, int32_t>> recs;
    uint32_t n_recs = 0;
    for (const auto & [b, hb] : st->blocks) {
        if (hb.on_disk) {
            recs.push_back({ hb.disk_rec, b });
            n_recs += hb.n_slots();
        }
    }
    std::sort(recs.begin(), recs.end());
    std::string err;
    const int64_t t0 = ggml_time_us();
    for (const auto & [rec, b] : recs) {
        kvmem_block & hb = st->blocks.at(b);
        const uint32_t k = hb.n_slots();
        if (pool.n_free() < k && pool.n_free() + n_spillable(kept) < k) {
            err = "no other sequence's blocks can leave the host pool for them";
            break;
        }
        if (pool.n_free() >= k || make_host_room(k, kept)) {
            if (!read_home(hb, err)) {
                break;
            }
        } else if (!trade_places(hb, kept, err)) {
            break;
        }
    }
    if (summaries) {
        summaries->flush();
    }
    settle_disk("to make room for a sequence coming back");
    const uint32_t left = n_on_disk(*st);
    if (left > 0) {
        set_last_error(format("KV tiering: %u blocks of sequence %d stay on the disk tier under %s: %s; raise "
                "--kvmem-host-mib or --kvmem-disk-mib", left, seq_id, disk.path().c_str(), err.c_str()));
        return false;
    }
    const double s = (ggml_time_us() - t0)/1e6;
    LLAMA_LOG_WARN("kvmem_disk: %zu blocks (%.1f MiB) of seq %d back from the disk tier in %.3f s (%.0f MB/s)\n",
            recs.size(), pool.mib(n_recs), seq_id, s, s > 0 ? n_recs*disk.record_bytes()/1e6/s : 0.0);
    return true;
}

bool llama_kvmem_cache::trade_places(kvmem_block & hb, const std::set<llama_seq_id> & kept, std::string & err) {
    // the disk tier has too few records for the blocks that would make room: this block is read aside and its
    // records go to one-slot blocks of other sequences. Enough of them must exist, so that the trade cannot stop
    // half-way with the block's records taken
    const uint32_t k = hb.n_slots();
    GGML_ASSERT(hb.on_disk && pool.n_free() < k);
    if (pool.n_free() + n_spillable(kept, 1) < k) {
        err = spill_error.empty() ? disk_full_message() : spill_error;
        return false;
    }
    const size_t block_bytes = pool.block_bytes();
    std::vector<uint8_t> aside;
    std::vector<float> summary;
    if (!read_aside(hb, aside, summary, err)) {
        return false;
    }
    const std::vector<uint32_t> recs = kvmem_records(hb);
    for (const uint32_t rec : recs) {
        disk.give(rec);
    }
    if (!make_host_room(k, kept)) {
        // only a failed write stops it: the block goes back to disk while k records are free
        err = spill_error;
        std::string werr = "no records are left for it";
        bool back = disk.n_free() >= k;
        if (back) {
            std::vector<uint32_t> again(k);
            std::vector<const uint8_t *> src(k);
            for (uint32_t j = 0; j < k; ++j) {
                GGML_ASSERT(disk.take(again[j]));
                src[j] = aside.data() + j*block_bytes;
            }
            hb.disk_rec = again[0];
            hb.more_recs.assign(again.begin() + 1, again.end());
            back = write_records(again, src, summary, werr);
        }
        if (!back) {
            GGML_ABORT("kvmem: a block could be neither kept in the pool nor written back to disk: %s (%s)",
                    err.c_str(), werr.c_str());
        }
        return false;
    }
    std::vector<uint32_t> slots(k);
    for (uint32_t j = 0; j < k; ++j) {
        GGML_ASSERT(pool.take(slots[j]));
        std::memcpy(pool.slot_ptr(slots[j]), aside.data() + j*block_bytes, block_bytes);
    }
    place_home(hb, slots, summary);
    return true;
}

bool llama_kvmem_cache::read_aside(const kvmem_block & hb, std::vector<uint8_t> & bytes, std::vector<float> & summary,
        std::string & err) const {
    const size_t block_bytes = pool.block_bytes();
    bytes.resize(hb.n_slots()*block_bytes);
    std::vector<uint8_t *> dst(hb.n_slots());
    for (uint32_t j = 0; j < hb.n_slots(); ++j) {
        dst[j] = bytes.data() + j*block_bytes;
    }
    return read_records(hb, dst, summary, err);
}

void llama_kvmem_cache::read_spilled(const kvmem_block & hb, std::vector<uint8_t> & bytes, std::vector<float> & summary) const {
    std::string err;
    if (!read_aside(hb, bytes, summary, err)) {
        throw std::runtime_error(format("reading a block from the disk tier under %s failed: %s", disk.path().c_str(),
                    err.c_str()));
    }
}
