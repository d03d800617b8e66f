// Block summaries and scorers, and the lexical (BM25) picks of hybrid.

#include "test-kvmem.h"

#include "llama-kvmem-score.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace {

const kvmem_dims DIMS = { /*n_lt*/ 1, /*n_head*/ 2, /*n_head_kv*/ 1, /*head_dim*/ 8, /*block*/ 16 };

// keys of n_blocks blocks: noise off the first axis, except the needle block whose keys point along it
std::vector<std::vector<float>> make_keys(int n_blocks, int needle, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    std::vector<std::vector<float>> keys(n_blocks, std::vector<float>(DIMS.block*DIMS.key_row()));
    for (int b = 0; b < n_blocks; ++b) {
        for (uint32_t t = 0; t < DIMS.block; ++t) {
            float * k = keys[b].data() + t*DIMS.key_row();
            for (uint32_t i = 0; i < DIMS.head_dim; ++i) {
                k[i] = i == 0 ? (b == needle ? 4.0f : 0.0f) : noise(rng);
            }
        }
    }
    return keys;
}

std::vector<float> summarize(const kvmem_scorer & sc, const std::vector<float> & keys) {
    std::vector<float> out(sc.summary_size());
    sc.summarize([&](uint32_t t) { return keys.data() + t*DIMS.key_row(); }, out.data());
    return out;
}

// one query row: every head along the first axis
std::vector<float> make_query() {
    std::vector<float> q(DIMS.query_row(), 0.0f);
    for (uint32_t h = 0; h < DIMS.n_head; ++h) {
        q[h*DIMS.head_dim] = 3.0f;
    }
    return q;
}

int best_block(int32_t method, int needle) {
    const kvmem_scorer sc(DIMS, method, 2);
    const auto keys = make_keys(8, needle, 7);
    std::vector<std::vector<float>> sums;
    std::vector<const float *> ptrs;
    for (const auto & k : keys) {
        sums.push_back(summarize(sc, k));
    }
    for (const auto & s : sums) {
        ptrs.push_back(s.data());
    }
    std::vector<char> cand(keys.size(), 1);
    cand[0] = 0; // the sink: scored for normalization, never ranked
    const auto q = make_query();
    std::vector<float> out;
    sc.score(ptrs, cand, q.data(), 1, out);
    int best = -1;
    for (size_t b = 0; b < out.size(); ++b) {
        if (cand[b] && (best < 0 || out[b] > out[best])) {
            best = (int) b;
        }
    }
    return best;
}

} // namespace

KV_SUITE(score) {
    // every scorer ranks the block whose keys the query points at first
    for (int32_t m : { LLAMA_KVMEM_METHOD_QUEST, LLAMA_KVMEM_METHOD_MEANKEY, LLAMA_KVMEM_METHOD_SUBPAGE,
                       LLAMA_KVMEM_METHOD_VOTES, LLAMA_KVMEM_METHOD_MASS, LLAMA_KVMEM_METHOD_HYBRID }) {
        KV_CHECK(best_block(m, 5) == 5);
        KV_CHECK(best_block(m, 2) == 2);
    }
    KV_CHECK(kvmem_scorer::resolve(LLAMA_KVMEM_METHOD_RETRIEVAL) == LLAMA_KVMEM_METHOD_HYBRID);
    KV_CHECK(kvmem_scorer::method_from_name("mass") == LLAMA_KVMEM_METHOD_MASS);
    KV_CHECK(kvmem_scorer::method_from_name("nope") == -1);
    const kvmem_scorer recency(DIMS, LLAMA_KVMEM_METHOD_RECENCY);
    KV_CHECK(!recency.scores() && recency.summary_size() == 0);

    // mass summaries are 8-token chunk means; a block cut by a truncation keeps the chunks of its old summary
    // that lie in the unchanged tokens and summarizes the rest from the rows that are known
    const kvmem_scorer mass(DIMS, LLAMA_KVMEM_METHOD_MASS);
    KV_CHECK(mass.summary_size() == 2*DIMS.head_dim);
    const auto keys = make_keys(1, 0, 3)[0];
    std::vector<float> old(mass.summary_size(), 42.0f), out(mass.summary_size());
    mass.summarize([&](uint32_t t) { return t < 8 ? nullptr : keys.data() + t*DIMS.key_row(); }, out.data(), old.data(), 8);
    KV_CHECK(std::all_of(out.begin(), out.begin() + DIMS.head_dim, [](float x) { return x == 42.0f; }));
    float mean1 = 0.0f;
    for (uint32_t t = 8; t < 16; ++t) {
        mean1 += keys[t*DIMS.key_row() + 1]/8.0f;
    }
    KV_CHECK(std::fabs(out[DIMS.head_dim + 1] - mean1) < 1e-5f);
}

KV_SUITE(lexical) {
    // 20 blocks of common words; the question ends with a rare word that one block holds
    std::vector<std::vector<llama_token>> blocks(20);
    for (auto & b : blocks) {
        b = { 1, 2, 3, 1, 2, 3, -1 };
    }
    blocks[7].push_back(99);
    auto docs_of = [&]() {
        std::map<int32_t, const std::vector<llama_token> *> docs;
        for (size_t b = 0; b < blocks.size(); ++b) {
            docs[(int32_t) b] = &blocks[b];
        }
        return docs;
    };
    const auto question = kvmem_question_tokens({ 5, -1, 99 }, 16.0f);
    KV_CHECK(question.size() == 2 && question[1].first == 99 && question[1].second == 1.0f);
    KV_CHECK(std::fabs(question[0].second - std::pow(0.5f, 2.0f/16.0f)) < 1e-6f);

    auto ranked = kvmem_lexical_rank(question, docs_of(), {});
    KV_CHECK(ranked.size() == 1 && ranked[0].second == 7);
    KV_CHECK(kvmem_lexical_rank(question, docs_of(), { 7 }).empty()); // already in the working set

    // a question of common words only adds nothing
    KV_CHECK(kvmem_lexical_rank(kvmem_question_tokens({ 1, 2 }, 16.0f), docs_of(), {}).empty());

    // the rare word recurring in a few more blocks than a tenth of them is no longer rare: no lexical pick
    blocks[2].push_back(99);
    blocks[11].push_back(99);
    KV_CHECK(kvmem_lexical_rank(question, docs_of(), {}).empty());
}
