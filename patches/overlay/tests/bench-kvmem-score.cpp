// The graph scorer alone (no model): a selection over a 27B model's shape (16 attention layers, 24 query heads over
// 4 KV heads of 256, 128-token blocks of 16 chunk means) at 32K, 131K and 261K tokens of history: a turn's 128
// query rows, and a refresh's 192 at the longest history.
//
//   bench-kvmem-score [OUT.json [BLOCKS [REPEATS]]]   (KVMEM_TEST_DEVICE=CUDA0 picks the device; the CPU otherwise)
//
// BLOCKS: one history of that many blocks instead of the three (a small one to try the bench on a CPU; one to
// profile under ncu). Prints a table (median and min of REPEATS, default 5, after a warm-up) and writes it as
// JSON. The summaries are synthetic: noise, plus a per-block strength along one direction the query rows share, so
// that the ranking has a spread.

#include "test-kvmem.h"

#include "llama-kvmem-summaries.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr kvmem_dims DIMS = { /*n_lt*/ 16, /*n_head*/ 24, /*n_head_kv*/ 4, /*head_dim*/ 256, /*block*/ 128 };
constexpr uint32_t N_CHUNKS = 16;  // the `mass` scorer's 8-token chunks

struct case_result {
    uint32_t blocks, rows;
    double ms_median, ms_min;
    uint32_t steps;
};

double now_ms() {
    return ggml_time_us()/1000.0;
}

} // namespace

int main(int argc, char ** argv) {
    // blocks of 32,768, 131,072 and 261,400 tokens, or the one history asked for
    const std::vector<uint32_t> sizes = argc > 2 ? std::vector<uint32_t>{ std::max(1u, (uint32_t) std::stoul(argv[2])) }
                                                 : std::vector<uint32_t>{ 256u, 1024u, 2043u };
    const int repeats = argc > 3 ? std::max(1, std::stoi(argv[3])) : 5;
    ggml_backend_t be = kvtest::graph_backend();
    if (!be) {
        return 1;
    }
    const uint32_t n_slots = sizes.back();

    std::mt19937 rng(7);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    std::uniform_real_distribution<float> strength(0.0f, 3.0f);
    kvmem_summary_store store;
    store.init(be, DIMS, N_CHUNKS, n_slots);
    std::vector<float> sum((size_t) DIMS.n_lt*DIMS.n_head_kv*N_CHUNKS*DIMS.head_dim);
    for (uint32_t b = 0; b < n_slots; ++b) {
        const float s = strength(rng);
        for (size_t i = 0; i < sum.size(); ++i) {
            sum[i] = noise(rng) + (i % DIMS.head_dim == 0 ? s : 0.0f);
        }
        store.put(b, sum.data());
    }
    store.flush();
    const uint32_t max_rows = 192; // a refresh's question and newest rows
    std::vector<float> q((size_t) max_rows*DIMS.query_row());
    for (size_t i = 0; i < q.size(); ++i) {
        q[i] = 0.3f*noise(rng) + (i % DIMS.head_dim == 0 ? 2.0f : 0.0f);
    }
    const kvtest::backend_rows rows(be, DIMS, q);

    std::vector<case_result> results;
    for (const uint32_t n_blocks : sizes) {
        std::vector<uint32_t> slots(n_blocks);
        std::iota(slots.begin(), slots.end(), 0u);
        for (const uint32_t n_rows : { 128u, max_rows }) {
            if (n_rows == max_rows && n_blocks != sizes.back()) {
                continue; // a refresh's rows at the longest history only
            }
            kvmem_graph_scorer scorer(be, store, KVMEM_SCORE_STEP_BYTES);
            std::vector<float> scores;
            scorer.score(slots, { rows.span(0, n_rows) }, scores); // warm-up
            std::vector<double> ms;
            for (int r = 0; r < repeats; ++r) {
                const double t0 = now_ms();
                scorer.score(slots, { rows.span(0, n_rows) }, scores);
                ms.push_back(now_ms() - t0);
            }
            std::sort(ms.begin(), ms.end());
            results.push_back({ n_blocks, n_rows, ms[repeats/2], ms[0], scorer.last_timing().n_steps });
        }
    }

    std::printf("graph scorer, %u layers x %u heads (%u KV) x %u, %u chunks per block, %s, %d repeats\n", DIMS.n_lt,
            DIMS.n_head, DIMS.n_head_kv, DIMS.head_dim, N_CHUNKS, ggml_backend_name(be), repeats);
    std::printf("| blocks | tokens | query rows | steps | ms median | ms min |\n|---:|---:|---:|---:|---:|---:|\n");
    for (const auto & r : results) {
        std::printf("| %u | %u | %u | %u | %.2f | %.2f |\n", r.blocks, r.blocks*DIMS.block, r.rows, r.steps,
                r.ms_median, r.ms_min);
    }
    if (argc > 1) {
        FILE * f = std::fopen(argv[1], "w");
        if (!f) {
            std::fprintf(stderr, "cannot write %s\n", argv[1]);
            return 1;
        }
        std::fprintf(f, "{\"backend\": \"%s\", \"repeats\": %d, \"cases\": [", ggml_backend_name(be), repeats);
        for (size_t i = 0; i < results.size(); ++i) {
            const auto & r = results[i];
            std::fprintf(f, "%s\n  {\"blocks\": %u, \"rows\": %u, \"steps\": %u, \"ms_median\": %.3f, "
                    "\"ms_min\": %.3f}", i ? "," : "", r.blocks, r.rows, r.steps, r.ms_median, r.ms_min);
        }
        std::fprintf(f, "\n]}\n");
        std::fclose(f);
    }
    ggml_backend_free(be);
    return 0;
}
