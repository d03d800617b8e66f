// Block summaries and scorers, and the lexical (BM25) picks of hybrid.

#include "test-kvmem.h"

#include "llama-kvmem-lexical.h"
#include "llama-kvmem-score.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
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
    sc.summarize(keys.data(), out.data());
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
    std::vector<const float *> rows((size_t) DIMS.block*DIMS.n_lt, nullptr); // the first 8 tokens unknown
    for (uint32_t t = 8; t < DIMS.block; ++t) {
        for (uint32_t lt = 0; lt < DIMS.n_lt; ++lt) {
            rows[(size_t) t*DIMS.n_lt + lt] = keys.data() + t*DIMS.key_row() + (size_t) lt*DIMS.n_head_kv*DIMS.head_dim;
        }
    }
    mass.summarize(rows, out.data(), old.data(), 8);
    KV_CHECK(std::all_of(out.begin(), out.begin() + DIMS.head_dim, [](float x) { return x == 42.0f; }));
    float mean1 = 0.0f;
    for (uint32_t t = 8; t < 16; ++t) {
        mean1 += keys[t*DIMS.key_row() + 1]/8.0f;
    }
    KV_CHECK(std::fabs(out[DIMS.head_dim + 1] - mean1) < 1e-5f);

    // an image's block gives every cell's row (here 24 cells, more than a block's 16): its two chunks are the
    // means of its first and its last 12 rows
    const auto image = make_keys(2, -1, 5);
    std::vector<const float *> cells;
    for (uint32_t c = 0; c < 24; ++c) {
        cells.push_back(image[c/16].data() + (c % 16)*DIMS.key_row());
    }
    mass.summarize(cells, out.data());
    float first = 0.0f, last = 0.0f;
    for (uint32_t c = 0; c < 12; ++c) {
        first += cells[c][1]/12.0f;
        last  += cells[12 + c][1]/12.0f;
    }
    KV_CHECK(std::fabs(out[1] - first) < 1e-5f && std::fabs(out[DIMS.head_dim + 1] - last) < 1e-5f);

    // a mass score is the square of the block's share of each (head, row), summed: the share is the softmax over the
    // blocks of each block's best chunk logit. Block 0's chunks both hold 2*e0, block 1's hold 0 and e0; the query
    // row is 3*e0 in both heads, so the best logits are 6s and 3s (s = 1/sqrt(head_dim)).
    std::vector<std::vector<float>> two(2, std::vector<float>((size_t) DIMS.block*DIMS.key_row(), 0.0f));
    for (uint32_t t = 0; t < DIMS.block; ++t) {
        two[0][t*DIMS.key_row()] = 2.0f;
        two[1][t*DIMS.key_row()] = t < 8 ? 0.0f : 1.0f;
    }
    const std::vector<std::vector<float>> two_sums = { summarize(mass, two[0]), summarize(mass, two[1]) };
    std::vector<float> scores;
    mass.score({ two_sums[0].data(), two_sums[1].data() }, { 1, 1 }, make_query().data(), 1, scores);
    const double s = 1.0/std::sqrt((double) DIMS.head_dim);
    const double share0 = 1.0/(1.0 + std::exp(-3.0*s));
    KV_CHECK(std::fabs(scores[0] - 2*share0*share0) < 1e-5);
    KV_CHECK(std::fabs(scores[1] - 2*(1 - share0)*(1 - share0)) < 1e-5);
}

namespace {

// the rule of kvmem_lexical_index::rank written as a scan over every block's tokens: the index must agree with it
std::vector<std::pair<float, int32_t>> scan_rank(const std::vector<std::pair<llama_token, float>> & question,
        const std::map<int32_t, std::vector<llama_token>> & docs, const std::set<int32_t> & exclude) {
    std::vector<llama_token> qt;
    std::vector<float> qw;
    for (const auto & [t, w] : question) {
        const auto it = std::find(qt.begin(), qt.end(), t);
        if (it == qt.end()) {
            qt.push_back(t);
            qw.push_back(w);
        } else {
            qw[it - qt.begin()] = std::max(qw[it - qt.begin()], w);
        }
    }
    std::vector<uint32_t> df(qt.size(), 0);
    std::vector<std::pair<int32_t, std::vector<uint32_t>>> tf;
    for (const auto & [b, toks] : docs) {
        std::vector<uint32_t> c(qt.size(), 0);
        for (const auto t : toks) {
            for (size_t j = 0; j < qt.size(); ++j) {
                c[j] += t == qt[j] ? 1 : 0;
            }
        }
        for (size_t j = 0; j < qt.size(); ++j) {
            df[j] += c[j] > 0 ? 1 : 0;
        }
        if (!exclude.count(b)) {
            tf.push_back({ b, c });
        }
    }
    std::vector<std::pair<float, int32_t>> out;
    if (tf.size() < 2) {
        return out;
    }
    const uint32_t n = (uint32_t) docs.size(), rare_df = std::max<uint32_t>(1, n/10);
    double sum = 0.0, sum2 = 0.0;
    std::vector<std::pair<float, int32_t>> all;
    for (const auto & [b, c] : tf) {
        float sc = 0.0f;
        bool rare = false;
        for (size_t j = 0; j < qt.size(); ++j) {
            const float idf = qw[j]*std::log(1.0f + (n - df[j] + 0.5f)/(df[j] + 0.5f));
            sc += c[j] ? idf*c[j]*2.2f/(c[j] + 1.2f) : 0.0f;
            rare = rare || (c[j] > 0 && df[j] <= rare_df && qw[j] >= 0.25f);
        }
        sum += sc;
        sum2 += (double) sc*sc;
        all.push_back({ rare ? sc : -1.0f, b });
    }
    const double mean = sum/tf.size(), sd = std::sqrt(std::max(0.0, sum2/tf.size() - mean*mean));
    for (const auto & e : all) {
        if (e.first > (float) (mean + 2.0*sd) && e.first > 0.0f) {
            out.push_back(e);
        }
    }
    std::stable_sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    return out;
}

} // namespace

KV_SUITE(lexical) {
    // 20 blocks of common words; the question ends with a rare word that one block holds
    std::map<int32_t, std::vector<llama_token>> docs;
    kvmem_lexical_index index;
    for (int32_t b = 0; b < 20; ++b) {
        docs[b] = { 1, 2, 3, 1, 2, 3, -1 };
    }
    docs[7].push_back(99);
    for (const auto & [b, toks] : docs) {
        index.add(b, toks);
    }
    KV_CHECK(index.n_docs() == 20);
    const auto question = kvmem_question_tokens({ 5, -1, 99 }, 16.0f);
    KV_CHECK(question.size() == 2 && question[1].first == 99 && question[1].second == 1.0f);
    KV_CHECK(std::fabs(question[0].second - std::pow(0.5f, 2.0f/16.0f)) < 1e-6f);

    auto ranked = index.rank(question, {});
    KV_CHECK(ranked.size() == 1 && ranked[0].second == 7);
    KV_CHECK(index.rank(question, { 7 }).empty()); // already in the working set
    // a question of common words only adds nothing
    KV_CHECK(index.rank(kvmem_question_tokens({ 1, 2 }, 16.0f), {}).empty());
    // the rare word recurring in a few more blocks than a tenth of them is no longer rare: no lexical pick
    for (int32_t b : { 2, 11 }) {
        docs[b].push_back(99);
        index.add(b, docs[b]); // replaces what the block held
    }
    KV_CHECK(index.n_docs() == 20 && index.rank(question, {}).empty());
    // dropping blocks (a truncation) takes them out of the counts
    index.remove_from(10);
    KV_CHECK(index.n_docs() == 10 && !index.contains(11) && index.contains(9));

    // on random histories the index ranks exactly as a scan over every block's tokens would
    std::mt19937 rng(17);
    for (int round = 0; round < 40; ++round) {
        std::map<int32_t, std::vector<llama_token>> hist;
        kvmem_lexical_index idx;
        const int32_t n = 3 + (int32_t) (rng() % 60);
        for (int32_t b = 0; b < n; ++b) {
            std::vector<llama_token> toks(16);
            for (auto & t : toks) {
                t = rng() % 7 == 0 ? (llama_token) (rng() % 400) : (llama_token) (rng() % 12) - 1;
            }
            hist[b] = toks;
            idx.add(b, toks);
        }
        std::vector<llama_token> span(8);
        for (auto & t : span) {
            t = rng() % 3 == 0 ? (llama_token) (rng() % 400) : (llama_token) (rng() % 12);
        }
        const auto q = kvmem_question_tokens(span, 4.0f);
        std::set<int32_t> excl = { 0, n - 1 };
        KV_CHECK(idx.rank(q, excl) == scan_rank(q, hist, excl));
        const int32_t cut = (int32_t) (rng() % n);
        idx.remove_from(cut);
        hist.erase(hist.lower_bound(cut), hist.end());
        KV_CHECK(idx.rank(q, {}) == scan_rank(q, hist, {}));
    }
}
