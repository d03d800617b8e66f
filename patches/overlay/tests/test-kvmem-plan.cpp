// The selection plan: sink + question + recent + picks, inside a prompt at most half picks, recency without rows,
// hybrid's alternation between attention and lexical picks.

#include "test-kvmem.h"

#include "llama-kvmem-select.h"

#include <random>

namespace {

const kvmem_dims DIMS = { 1, 2, 1, 8, 16 };
const kvmem_geometry GEOM = { 16, 1, 1, 6 }; // 1 sink block, 1 recent block, budget 6 blocks

// 12 blocks on the host with mass summaries; the keys of block `needle` point along the first axis
kvmem_seq make_history(const kvmem_scorer & sc, int needle) {
    std::mt19937 rng(11);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    kvmem_seq st;
    for (int32_t b = 0; b < 12; ++b) {
        st.blocks[b].slot = (uint32_t) b;
        std::vector<float> keys(DIMS.block*DIMS.key_row());
        for (uint32_t t = 0; t < DIMS.block; ++t) {
            for (uint32_t i = 0; i < DIMS.head_dim; ++i) {
                keys[t*DIMS.key_row() + i] = i == 0 ? (b == needle ? 4.0f : 0.0f) : noise(rng);
            }
        }
        auto & sum = st.rows.summary[b];
        sum.resize(sc.summary_size());
        sc.summarize(keys.data(), sum.data());
        st.rows.tokens[b] = std::vector<llama_token>(DIMS.block, (llama_token) (10 + b % 3));
        st.lexicon.add(b, st.rows.tokens[b]); // what write-through does
    }
    return st;
}

std::vector<float> query_row() {
    std::vector<float> q(DIMS.query_row(), 0.0f);
    q[0] = q[DIMS.head_dim] = 3.0f;
    return q;
}

// generating the answer to a question in block 10, asked at position 12*16 + 4
void ask(kvmem_seq & st) {
    st.start_prompt(false, 0);
    st.start_turn(12*16 + 4, 10*16, 10*16 + 8);
    st.turn.q = query_row();
    st.turn.n_q = 1;
}

} // namespace

KV_SUITE(plan) {
    const kvmem_scorer mass(DIMS, LLAMA_KVMEM_METHOD_MASS);
    kvmem_seq st = make_history(mass, 4);
    ask(st);
    kvmem_plan p = kvmem_plan_selection(GEOM, st, 6, kvmem_reason::TURN, mass, kvmem_host_scores(st, mass), 128, false, 0);
    KV_CHECK(p.target.size() == 5); // the share less the partial tail
    KV_CHECK(p.target.count(0) && p.target.count(10) && p.target.count(11) && p.target.count(4));
    KV_CHECK(p.n_sink == 1 && p.n_question == 1 && p.n_recent == 1 && p.n_rows == 1 && p.n_lexical == 0);
    KV_CHECK(p.picks.size() == 2 && p.picks.count(4) && p.picks.at(4) >= p.picks.begin()->second);

    // during generation the newest generated tokens' rows join the question's
    st.rows.query[12*16 + 5] = query_row();
    st.rows.query[12*16 + 2] = query_row(); // before the turn's end: not a generated token
    const kvmem_query q = kvmem_query_rows(st, 128);
    KV_CHECK(q.n_turn == 1 && q.n_newest() == 1 && q.newest[0] == 12*16 + 5);
    p = kvmem_plan_selection(GEOM, st, 6, kvmem_reason::REFRESH, mass, kvmem_host_scores(st, mass), 128, false, 0);
    KV_CHECK(p.n_rows == 2);

    // inside a prompt (retrieval prefill) the picks take at most half of what the fixed blocks leave
    kvmem_seq pre = make_history(mass, 4);
    pre.start_prompt(true, 0);
    pre.rows.query[11*16] = query_row();
    p = kvmem_plan_selection(GEOM, pre, 6, kvmem_reason::PREFILL, mass, kvmem_host_scores(pre, mass), 128, false, 0);
    KV_CHECK(p.n_question == 0 && p.target.size() == 2 + (5 - 2)/2 && p.target.count(4));

    // recency: the newest blocks, no picks
    const kvmem_scorer recency(DIMS, LLAMA_KVMEM_METHOD_RECENCY);
    kvmem_seq rec = make_history(mass, 4);
    ask(rec);
    p = kvmem_plan_selection(GEOM, rec, 6, kvmem_reason::TURN, recency, kvmem_host_scores(rec, recency), 128, false, 0);
    KV_CHECK(p.picks.empty() && p.target == std::set<int32_t>({ 0, 8, 9, 10, 11 }));

    // hybrid: attention first, then the block that holds the question's rare word
    const kvmem_scorer hybrid(DIMS, LLAMA_KVMEM_METHOD_HYBRID);
    kvmem_seq hy = make_history(hybrid, 4);
    hy.rows.tokens[7][3] = 777;
    hy.lexicon.add(7, hy.rows.tokens[7]);
    ask(hy);
    hy.turn.tokens = kvmem_question_tokens({ 55, 777 }, 16.0f); // 55 occurs nowhere
    p = kvmem_plan_selection(GEOM, hy, 6, kvmem_reason::TURN, hybrid, kvmem_host_scores(hy, hybrid), 128, false, 0);
    KV_CHECK(p.target.count(4) && p.target.count(7) && p.n_lexical == 1);
    KV_CHECK(p.picks.at(4) > p.picks.at(7)); // merged order: the first pick leaves last

    // a block of an image weighs its slots: the needle's block of three slots does not fit the two that the fixed
    // blocks leave, so the next blocks by score take them
    kvmem_seq img = make_history(mass, 4);
    img.blocks[4].more_slots = { 20, 21 };
    ask(img);
    p = kvmem_plan_selection(GEOM, img, 6, kvmem_reason::TURN, mass, kvmem_host_scores(img, mass), 128, false, 0);
    KV_CHECK(!p.target.count(4) && p.target.size() == 5 && p.weight == 5);
    // with room for it, it comes in first and weighs three
    p = kvmem_plan_selection(GEOM, img, 8, kvmem_reason::TURN, mass, kvmem_host_scores(img, mass), 128, false, 0);
    KV_CHECK(p.target.count(4) && p.weight == 7 && p.target.size() == 5);

    // a block without a summary is never ranked, but takes the room the ranked blocks leave (newest first)
    kvmem_seq bare = make_history(mass, 4);
    for (int32_t b = 1; b < 10; ++b) {
        if (b != 4) {
            bare.rows.summary.erase(b);
        }
    }
    ask(bare);
    p = kvmem_plan_selection(GEOM, bare, 7, kvmem_reason::TURN, mass, kvmem_host_scores(bare, mass), 128, false, 0);
    KV_CHECK(p.target == std::set<int32_t>({ 0, 4, 8, 9, 10, 11 }) && p.picks.size() == 1 && p.picks.count(4));
}
