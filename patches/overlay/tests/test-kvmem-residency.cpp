// Shares, protected blocks and the eviction order (invariants 1 and 4 of llama-kvmem.h).

#include "test-kvmem.h"

#include "llama-kvmem-residency.h"

// a sequence with blocks [0, n) in the host pool, those in `resident` also in the working set
static kvmem_seq make_seq(int32_t n, std::initializer_list<int32_t> resident) {
    kvmem_seq st;
    for (int32_t b = 0; b < n; ++b) {
        st.blocks[b].slot = (uint32_t) b;
    }
    for (int32_t b : resident) {
        st.blocks[b].resident = true;
    }
    return st;
}

static kvmem_seq generating(kvmem_seq st, llama_pos q0, llama_pos q1, llama_pos pos) {
    st.start_prompt(false, 0);
    st.start_turn(pos, q0, q1);
    return st;
}

KV_SUITE(residency) {
    const kvmem_geometry g = { 16, 1, 2, 10 }; // 16-token blocks, 1 sink block, 2 recent, budget of 10 blocks
    const kvmem_residency rules(g);
    KV_CHECK(g.floor_share() == 5);

    kvmem_seqs seqs;
    seqs[0] = generating(make_seq(12, { 0, 1, 2, 3, 4, 5, 9, 10, 11 }), 9*16, 10*16, 12*16); // question in block 9
    // one active sequence has the whole budget; two share it, never below the floor
    KV_CHECK(rules.share_blocks(seqs, 0) == 10);
    seqs[1] = make_seq(6, { 0, 1, 2, 3, 4 }); // a prompt within its share
    seqs[1].start_prompt(false, 0);
    KV_CHECK(rules.share_blocks(seqs, 0) == 5 && rules.share_blocks(seqs, 1) == 5);
    // a block of an image (40 cells at one position: three slots) weighs three blocks in what is resident; its
    // eviction frees its 40 cells, not three blocks' 48
    seqs[1].blocks[3].more_slots = { 20, 21 };
    seqs[1].blocks[3].pos.assign(40, 3*16);
    KV_CHECK(seqs[1].n_resident() == 7);
    KV_CHECK(rules.movable_cells(seqs, 1, false, false) == 3*16 + 40); // all but the sink
    seqs[1].blocks[3].more_slots.clear();
    seqs[1].blocks[3].pos.clear();

    // protected: the sink always; while generating the question and the newest blocks; a prompt protects none
    const kvmem_seq & gen = seqs[0];
    KV_CHECK(rules.protected_block(gen, 0) && rules.protected_block(gen, 9) && rules.protected_block(gen, 10) &&
             rules.protected_block(gen, 11));
    KV_CHECK(!rules.protected_block(gen, 1) && !rules.protected_block(gen, 8));
    KV_CHECK(rules.protected_block(seqs[1], 0) && !rules.protected_block(seqs[1], 4));

    // an idle sequence's blocks go first, oldest first, never its sink
    seqs[2] = make_seq(4, { 0, 2, 3 });
    auto v = rules.victim(seqs, 0);
    KV_CHECK(v && v->seq == 2 && v->block == 2 && v->tier == kvmem_evict_tier::IDLE_SEQ);
    seqs.erase(2);

    // then the asking sequence's ordinary blocks oldest first, then its picks lowest score first
    seqs[0].blocks[1].picked = true;
    seqs[0].blocks[1].score  = 0.9f;
    seqs[0].blocks[5].picked = true;
    seqs[0].blocks[5].score  = 0.2f;
    v = rules.victim(seqs, 0);
    KV_CHECK(v && v->seq == 0 && v->block == 2 && v->tier == kvmem_evict_tier::OWN);
    for (int32_t b : { 2, 3, 4 }) {
        seqs[0].blocks[b].resident = false;
    }
    v = rules.victim(seqs, 0);
    KV_CHECK(v && v->block == 5 && v->tier == kvmem_evict_tier::OWN_PICK);
    seqs[0].blocks[5].resident = false;
    v = rules.victim(seqs, 0);
    KV_CHECK(v && v->block == 1 && v->tier == kvmem_evict_tier::OWN_PICK);
    seqs[0].blocks[1].resident = false;

    // nothing of its own is left but protected blocks: a prompt of another sequence within its share is squeezed
    v = rules.victim(seqs, 0);
    KV_CHECK(v && v->seq == 1 && v->block == 1 && v->tier == kvmem_evict_tier::PROMPT_SQUEEZE);
    // ... but never by a follower cache (MTP draft), and never a generating sequence within its share
    KV_CHECK(!rules.victim(seqs, 0, [](llama_seq_id, int32_t) { return false; }));
    seqs[1] = generating(make_seq(6, { 0, 1, 2, 4, 5 }), 5*16, 6*16, 6*16);
    KV_CHECK(!rules.victim(seqs, 0));

    // beyond its share, another generating sequence gives up its unprotected blocks
    seqs[1] = generating(make_seq(9, { 0, 1, 2, 3, 4, 5, 6, 7, 8 }), 8*16, 9*16, 9*16);
    v = rules.victim(seqs, 0);
    KV_CHECK(v && v->seq == 1 && v->block == 1 && v->tier == kvmem_evict_tier::OTHER_BEYOND_SHARE);

    // a follower keeps the blocks its target holds until last
    kvmem_seqs one;
    one[0] = make_seq(6, { 0, 1, 2, 3 });
    one[0].start_prompt(false, 0);
    v = rules.victim(one, 0, [](llama_seq_id, int32_t b) { return b == 1; });
    KV_CHECK(v && v->block == 2 && !v->leader_resident);
    one[0].blocks[2].resident = one[0].blocks[3].resident = false;
    v = rules.victim(one, 0, [](llama_seq_id, int32_t b) { return b == 1; });
    KV_CHECK(v && v->block == 1 && v->leader_resident);

    // what a batch could free: a generating sequence alone in the batch may use all its unprotected blocks,
    // next to others only what it holds beyond its share
    kvmem_seqs two;
    two[0] = generating(make_seq(12, { 0, 1, 2, 3, 4, 5, 6, 7, 10, 11 }), 10*16, 11*16, 12*16);
    KV_CHECK(rules.movable_cells(two, 0, true, true) == 7*16);
    two[1] = make_seq(2, { 0, 1 });
    two[1].start_prompt(false, 0);
    KV_CHECK(rules.movable_cells(two, 0, true, false) == 5*16);
    // an image's block of two slots (20 cells) frees its 20 cells
    two[0].blocks[2].more_slots = { 30 };
    two[0].blocks[2].pos.assign(20, 2*16);
    KV_CHECK(rules.movable_cells(two, 0, true, true) == 6*16 + 20);
    // under the share cap (11 slots resident, share 5) the blocks leave oldest first until the share is reached:
    // 1, the image's 2, 3, 4, 5 (six slots, 84 cells, not six slots of B)
    KV_CHECK(rules.movable_cells(two, 0, true, false) == 4*16 + 20);
    // picks leave after the ordinary blocks, lowest score first
    two[0].blocks[1].picked = two[0].blocks[3].picked = true;
    two[0].blocks[1].score = 2.0f;
    two[0].blocks[3].score = 1.0f;
    two[0].blocks[2].more_slots.clear();
    two[0].blocks[2].pos.clear();
    two[0].blocks[7].more_slots = { 31, 32 };
    two[0].blocks[7].pos.assign(40, 7*16);
    // 12 slots, share 5: ordinary 2, 4, 5, 6, then the image's 7 (three slots, 40 cells) crosses the share
    KV_CHECK(rules.movable_cells(two, 0, true, false) == 4*16 + 40);
}
