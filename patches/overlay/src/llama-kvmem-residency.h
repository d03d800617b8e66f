#pragma once

// KVMem residency rules (kvmem-llama): each sequence's share of the working set, the blocks that may not leave,
// and which block leaves first when room is needed. Pure functions of the sequences' state (tests/kvmem).

#include "llama-kvmem-seq.h"

#include <cstdint>
#include <functional>
#include <optional>

// the working set in blocks
struct kvmem_geometry {
    uint32_t block         = 0; // tokens per block
    uint32_t sink_blocks   = 0;
    uint32_t recent_blocks = 0;
    uint32_t budget_blocks = 0;

    // the least a sequence keeps: its sink, its recent window, one retrieved block and the partial tail
    uint32_t floor_share() const { return sink_blocks + recent_blocks + 2; }
};

// eviction order, lowest first (invariant 4 of llama-kvmem.h)
enum class kvmem_evict_tier : uint8_t {
    IDLE_SEQ,            // blocks of idle (released, cut or new) sequences
    OWN,                 // the asking sequence's ordinary blocks, oldest first
    OWN_PICK,            // its picks, lowest score first
    OTHER_BEYOND_SHARE,  // another active sequence's ordinary blocks beyond its share
    OTHER_PICK_BEYOND_SHARE,
    PROMPT_SQUEEZE,      // last resort: a sequence reading a prompt, within its share (its prefill window shrinks)
};

const char * kvmem_evict_tier_name(kvmem_evict_tier tier);

struct kvmem_victim {
    llama_seq_id     seq   = -1;
    int32_t          block = -1;
    kvmem_evict_tier tier  = kvmem_evict_tier::IDLE_SEQ;
    bool   leader_resident = false; // a follower (MTP draft) keeps the blocks its target has resident until last
    double key             = 0.0;   // within a tier: block index (oldest first) or pick score (lowest first)

    bool before(const kvmem_victim & o) const;
};

class kvmem_residency {
public:
    explicit kvmem_residency(const kvmem_geometry & geometry) : g(geometry) {}

    // the sequence's part of the budget in pool blocks: the active sequences share it equally, each keeps at least
    // its floor (a block of an image counts its slots against it)
    uint32_t share_blocks(const kvmem_seqs & seqs, llama_seq_id seq_id) const;

    // blocks that never leave: the sinks; while a turn is answered also its question and its newest blocks
    bool protected_block(const kvmem_seq & st, int32_t b) const;

    // the block to evict next to make room for for_seq, if any may go. resident_in_leader: for a follower
    // cache, whether its target holds that block (nullptr: not a follower)
    using leader_query = std::function<bool(llama_seq_id, int32_t)>;
    std::optional<kvmem_victim> victim(const kvmem_seqs & seqs, llama_seq_id for_seq,
            const leader_query & resident_in_leader = nullptr) const;

    // cells the sequence could give up for a batch of in_batch sequences (an image's block frees its cells, not
    // its slots times B); under the share cap, those of the blocks victim() would take before it reaches its share
    uint32_t movable_cells(const kvmem_seqs & seqs, llama_seq_id s, bool in_batch, bool alone_in_batch) const;

    const kvmem_geometry g;
};
