// The graph scorer over f16 summaries on a backend (the CPU, or KVMEM_TEST_DEVICE) ranks as the host `mass` scorer does.

#include "test-kvmem.h"

#include "llama-kvmem-select.h"
#include "llama-kvmem-summaries.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

KV_SUITE(summaries) {
    ggml_backend_t be = kvtest::graph_backend(); // the CPU, or KVMEM_TEST_DEVICE
    KV_CHECK(be != nullptr);
    if (!be) {
        return;
    }

    const kvmem_dims d = { /*n_lt*/ 2, /*n_head*/ 4, /*n_head_kv*/ 2, /*head_dim*/ 16, /*block*/ 32 };
    const kvmem_scorer mass(d, LLAMA_KVMEM_METHOD_MASS, 2);
    const uint32_t n_ch = (uint32_t) (mass.summary_size()/d.key_row());
    KV_CHECK(n_ch == 4);

    // 24 blocks of random keys; two of them carry a direction the queries share, strongly and weakly
    std::mt19937 rng(3);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    const int n_blocks = 24;
    std::vector<std::vector<float>> sums(n_blocks, std::vector<float>(mass.summary_size()));
    for (int b = 0; b < n_blocks; ++b) {
        std::vector<float> keys(d.block*d.key_row());
        for (size_t i = 0; i < keys.size(); ++i) {
            keys[i] = noise(rng) + (i % d.head_dim == 0 ? (b == 9 ? 5.0f : b == 17 ? 2.5f : 0.0f) : 0.0f);
        }
        mass.summarize(keys.data(), sums[b].data());
    }
    const uint32_t n_rows = 20;
    std::vector<float> q(n_rows*d.query_row());
    for (size_t i = 0; i < q.size(); ++i) {
        q[i] = 0.3f*noise(rng) + (i % d.head_dim == 0 ? 2.0f : 0.0f);
    }

    // host scores
    std::vector<const float *> ptrs;
    for (const auto & s : sums) {
        ptrs.push_back(s.data());
    }
    std::vector<float> host;
    mass.score(ptrs, std::vector<char>(n_blocks, 1), q.data(), n_rows, host);

    // the graph's, the blocks in shuffled slots of a larger store
    kvmem_summary_store store;
    store.init(be, d, n_ch, 40);
    std::vector<uint32_t> slots(n_blocks);
    std::iota(slots.begin(), slots.end(), 7u);
    std::shuffle(slots.begin(), slots.end(), rng);
    for (int b = 0; b < n_blocks; ++b) {
        store.put(slots[b], sums[b].data());
    }
    kvmem_graph_scorer graph(be, store);
    const kvtest::backend_rows qb(be, d, q);
    std::vector<float> dev_scores;
    graph.score(slots, { qb.span(0, n_rows) }, dev_scores);
    KV_CHECK(dev_scores.size() == (size_t) n_blocks);

    auto order = [&](const std::vector<float> & s) {
        std::vector<int> o(n_blocks);
        std::iota(o.begin(), o.end(), 0);
        std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return s[a] > s[b]; });
        return o;
    };
    const auto ho = order(host), go = order(dev_scores);
    KV_CHECK(ho[0] == 9 && go[0] == 9 && ho[1] == 17 && go[1] == 17);
    double worst = 0.0;
    for (int b = 0; b < n_blocks; ++b) {
        worst = std::max(worst, std::fabs(host[b] - dev_scores[b])/std::max(1e-6, (double) std::fabs(host[b])));
    }
    KV_CHECK(worst < 2e-2); // f16 summaries
    KV_CHECK(store.bytes() == (size_t) 2*2*40*4*16*2);

    // the store gives back each block's summary as put, rounded to f16 (11 significant bits)
    for (const int b : { 0, 9, 23 }) {
        const std::vector<float> back = store.get(slots[b]);
        bool close = back.size() == sums[b].size();
        for (size_t i = 0; close && i < back.size(); ++i) {
            close = std::fabs(back[i] - sums[b][i]) <= std::fabs(sums[b][i])/1024.0f + 1e-7f;
        }
        KV_CHECK(close);
    }

    // query rows in two spans (the turn's, then the newest generated tokens') score as one
    std::vector<float> split;
    graph.score(slots, { qb.span(0, 7), qb.span(7, n_rows - 7) }, split);
    KV_CHECK(split.size() == dev_scores.size());
    for (int b = 0; b < n_blocks; ++b) {
        KV_CHECK(std::fabs(split[b] - dev_scores[b]) <= 1e-6f*std::max(1.0f, std::fabs(dev_scores[b])));
    }

    // scores equal up to float rounding (another grouping of the same sums)
    auto same = [](const std::vector<float> & a, const std::vector<float> & b) {
        bool ok = a.size() == b.size();
        for (size_t i = 0; ok && i < a.size(); ++i) {
            ok = std::fabs(a[i] - b[i]) <= 1e-5f*std::max(1.0f, std::fabs(b[i]));
        }
        return ok;
    };

    // the step bound sets how many rows a step takes, never the scores: one row per step, then seven (the last
    // step short), against all 20 in one step per span
    KV_CHECK(graph.last_timing().n_steps == 2);
    const size_t per_row = (size_t) n_blocks*n_ch*d.n_head*sizeof(float);
    for (const uint32_t rows : { 1u, 7u }) {
        kvmem_graph_scorer stepped(be, store, rows*per_row + per_row/2);
        KV_CHECK(stepped.rows_per_step(n_blocks) == rows);
        std::vector<float> s;
        stepped.score(slots, { qb.span(0, 7), qb.span(7, n_rows - 7) }, s);
        KV_CHECK(stepped.last_timing().n_steps == (n_rows + rows - 1)/rows && same(s, dev_scores));
    }
    KV_CHECK(kvmem_graph_scorer(be, store, 1).rows_per_step(n_blocks) == 1); // a bound below one row: one

    KV_CHECK(kvmem_max_query_rows(128) == 192 && kvmem_max_query_rows(1) == 2);

    // every query head reads its own KV head (heads 0-1 share KV head 0, 2-3 KV head 1): queries that differ per
    // head and keys that differ per KV head score as on the host
    std::vector<float> qh(q.size());
    for (size_t i = 0; i < qh.size(); ++i) {
        const size_t h = (i/d.head_dim) % d.n_head;
        qh[i] = 0.3f*noise(rng) + (i % d.head_dim == 1 + h ? 3.0f : 0.0f);
    }
    std::vector<float> host_h, dev_h;
    mass.score(ptrs, std::vector<char>(n_blocks, 1), qh.data(), n_rows, host_h);
    const kvtest::backend_rows qhb(be, d, qh);
    graph.score(slots, { qhb.span(0, n_rows) }, dev_h);
    double worst_h = 0.0;
    for (int b = 0; b < n_blocks; ++b) {
        worst_h = std::max(worst_h, std::fabs(host_h[b] - dev_h[b])/std::max(1e-6, (double) std::fabs(host_h[b])));
    }
    KV_CHECK(worst_h < 2e-2);

    // a scorer reserved for the largest selection (every slot of the store, the most rows) keeps its compute
    // buffer through smaller ones, and scores as before
    {
        kvmem_graph_scorer reserved(be, store, 3*per_row);
        reserved.reserve({ qb.span(0, n_rows), qhb.span(0, n_rows/2) });
        const size_t taken = reserved.compute_bytes();
        KV_CHECK(taken > 0);
        std::vector<float> s;
        for (const uint32_t rows : { n_rows, 5u }) {
            reserved.score(slots, { qb.span(0, rows) }, s);
            KV_CHECK(reserved.compute_bytes() == taken);
        }
        std::vector<float> one;
        graph.score(slots, { qb.span(0, 5) }, one);
        KV_CHECK(same(s, one));
    }
    // an empty question scores nothing
    std::vector<float> none;
    graph.score(slots, {}, none);
    KV_CHECK(none.size() == (size_t) n_blocks && none[9] == 0.0f);
    ggml_backend_free(be);
}
