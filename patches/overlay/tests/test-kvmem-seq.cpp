// The phase machine of a sequence and the undo journal.

#include "test-kvmem.h"

#include "llama-kvmem-seq.h"

#include <algorithm>
#include <string>
#include <vector>

KV_SUITE(seq) {
    kvmem_seq st;
    KV_CHECK(st.phase() == kvmem_phase::IDLE && !st.active());

    // a prompt chunk without outputs, then its last batch: a turn, however few tokens it has
    KV_CHECK(st.classify(512, 0, false, false) == kvmem_batch_kind::PROMPT);
    st.start_prompt(false, 0);
    KV_CHECK(st.phase() == kvmem_phase::PROMPT && st.active() && st.next_prefill == -1);
    KV_CHECK(st.classify(1, 1, true, false) == kvmem_batch_kind::TURN);
    KV_CHECK(st.classify(7, 1, true, false) == kvmem_batch_kind::TURN);

    // the query rows of a prompt's ubatches: all of them, unless the application named the prompt's end (with the
    // last user message or alone); then those that end within reach of it (and every row during generation)
    KV_CHECK(st.wants_query_rows(10, 384));
    // a prompt without messages names only its end: the same ubatches, and the query is the prompt's last tokens
    st.set_hint(-1, 580);
    KV_CHECK(st.hint_p0 == -1 && st.hint_p1 == 580);
    KV_CHECK(!st.wants_query_rows(195, 384) && st.wants_query_rows(196, 384) && st.query_start(580, 64) == 516);
    st.set_hint(-1, -1);
    KV_CHECK(st.hint_p1 == -1 && st.wants_query_rows(10, 384));
    st.set_hint(580, 500); // an empty span says nothing
    KV_CHECK(st.hint_p0 == -1 && st.hint_p1 == -1);
    st.set_hint(500, 580);
    KV_CHECK(st.hint_p0 == 500 && st.hint_p1 == 580);
    KV_CHECK(!st.wants_query_rows(195, 384) && st.wants_query_rows(196, 384) && st.wants_query_rows(599, 384));

    // a turn's query: the prompt's last tokens, from the named user message on, and never an image's embeddings
    KV_CHECK(st.query_start(600, 64) == 536 && st.query_start(560, 256) == 500 && st.query_start(40, 64) == 0);
    st.embd_end = 550;
    KV_CHECK(st.query_start(600, 256) == 550 && st.query_start(600, 32) == 568);
    KV_CHECK(st.query_start(550, 256) == 550); // a prompt that ends with an image: nothing to decode again
    st.embd_end = -1;
    // a block of an image weighs its slots: resident and in all; a plain block's cells are at b*B + t
    st.blocks[2].more_slots = { 7, 8 };
    st.blocks[2].pos = { 40, 40, 41 };
    st.blocks[2].resident = true;
    KV_CHECK(st.blocks[2].n_slots() == 3 && st.blocks[2].irregular() && st.blocks[2].cell_pos(2, 16, 1) == 40);
    KV_CHECK(st.blocks[2].holds_image());
    st.blocks[6].pos = { 100, 101, 103 }; // text after an image's span: a gap, no shared position
    KV_CHECK(st.blocks[6].irregular() && !st.blocks[6].holds_image());
    st.blocks.erase(6);
    KV_CHECK(st.blocks[5].cell_pos(5, 16, 3) == 83 && !st.blocks[5].irregular());
    KV_CHECK(st.n_resident() == 3 && st.n_slots() == 4 && !st.all_resident());
    st.blocks[5].resident = true;
    KV_CHECK(st.all_resident());
    st.blocks.clear();

    st.blocks[0].resident = true;
    st.blocks[3].resident = true;
    st.set_picks({ { 3, 0.5f }, { 4, 0.9f } }); // block 4 is not resident: not a pick
    KV_CHECK(st.blocks[3].picked && st.blocks[3].score == 0.5f && !st.blocks[4].picked && !st.blocks[0].picked);

    st.start_turn(600, 580, 600);
    KV_CHECK(st.phase() == kvmem_phase::GEN && st.turn.pos == 600 && st.turn.q0 == 580 && st.turn.q1 == 600);
    KV_CHECK(st.hint_p1 == -1 && st.wants_query_rows(10, 0)); // the hint was the prompt's

    // during generation: one sampled token is generation, a multi-token batch with one output is a new prompt
    // unless the application marks its prompts and did not mark this one (a draft catching up)
    KV_CHECK(st.classify(1, 1, true, false) == kvmem_batch_kind::GEN);
    KV_CHECK(st.classify(4, 1, true, false) == kvmem_batch_kind::TURN);
    KV_CHECK(st.classify(4, 1, true, true) == kvmem_batch_kind::GEN);
    st.prompt_mark = true;
    KV_CHECK(st.classify(4, 1, true, true) == kvmem_batch_kind::TURN);
    KV_CHECK(st.classify(4, 4, true, true) == kvmem_batch_kind::GEN); // speculative verification

    // the next prompt: the finished turn's picks become ordinary blocks, its question and schedule are gone
    st.next_event = 700;
    st.events.emplace_back();
    st.start_prompt(true, 601);
    KV_CHECK(st.phase() == kvmem_phase::PROMPT && !st.blocks[3].picked && st.blocks[3].score == 0.0f);
    KV_CHECK(st.events.empty() && st.next_event == -1 && st.turn.q0 == -1 && !st.prompt_mark);
    KV_CHECK(st.next_prefill == 601); // retrieval prefill selects from the prompt's first batch
    KV_CHECK(st.turn.pos == 600);     // the last turn's end stays until the prompt is cut below it

    st.cut_prompt();
    KV_CHECK(st.phase() == kvmem_phase::IDLE && st.turn.pos == -1);
    st.resume_gen();
    KV_CHECK(st.phase() == kvmem_phase::GEN);
    st.released = true;
    KV_CHECK(!st.active());

    KV_CHECK(std::string(kvmem_reason_name(kvmem_reason::REFRESH)) == "refresh");
    KV_CHECK(std::string(kvmem_reason_name(kvmem_reason::TURN)) == "turn");
}

KV_SUITE(journal) {
    // the re-selection evicted blocks 3 then 5 (with their cells) and staged in 8 then 9
    kvmem_journal j;
    j.evicted = { { { 0, 3 }, { 10, 11 } }, { { 0, 5 }, { 20, 21 } }, { { 1, 2 }, { 30, 31 } } };
    j.staged  = { { 0, 8 }, { 0, 9 } };

    std::vector<std::string> calls;
    std::vector<int32_t> resident = { 8, 9 };
    auto is_res = [&](int32_t b) { for (int32_t r : resident) { if (r == b) { return true; } } return false; };
    kvmem_undo_ops ops;
    ops.is_back   = [&](llama_seq_id s, int32_t b) { return s == 1 || is_res(b); }; // seq 1's block: dropped meanwhile
    ops.is_staged = [&](llama_seq_id, int32_t b) { return is_res(b); };
    ops.evict     = [&](llama_seq_id, int32_t b) { calls.push_back("evict " + std::to_string(b)); resident.erase(std::remove(resident.begin(), resident.end(), b), resident.end()); };
    ops.stage_at  = [&](llama_seq_id, int32_t b, const std::vector<uint32_t> & idx) {
        calls.push_back("at " + std::to_string(b) + ":" + std::to_string(idx[0]));
        return b != 3; // block 3's cells are taken: it goes anywhere free
    };
    ops.stage_any = [&](llama_seq_id, int32_t b) { calls.push_back("any " + std::to_string(b)); return true; };

    const auto [back_in, back_out] = kvmem_undo(j, ops);
    const std::vector<std::string> want = { "evict 9", "evict 8", "at 5:20", "at 3:10", "any 3" };
    KV_CHECK(calls == want);
    KV_CHECK(back_in == 2 && back_out == 2);
}
