// Stage-in throughput of the stager alone (no model, no cells' books): a turn's worth of blocks of a 27B model's
// shape (16 attention layers, 4 KV heads x 256, 128-token blocks) copied from pinned host slots into scattered cells
// of an f16 working set, for several staging sizes, next to plain host->device copies of the same slots (the link).
//
//   bench-kvmem-stager [OUT.json]        (KVMEM_TEST_DEVICE=CUDA0 picks the device; the CPU otherwise)
//
// Prints a table (median and min of 5 repeats after a warm-up) and writes it as JSON.

#include "test-kvmem.h"

#include "llama-kvmem-stager.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

constexpr int64_t  N_PER_ROW = 4*256;   // KV heads x head_dim
constexpr uint32_t N_LAYERS  = 16;
constexpr uint32_t BLOCK     = 128;
constexpr uint32_t N_BLOCKS  = 147;     // a 261K turn's stage-ins on the H200 (12-02)
constexpr int64_t  N_CELLS   = 2*N_BLOCKS*BLOCK;
constexpr int      REPEATS   = 5;

struct case_result {
    std::string what;
    ggml_type pool;
    size_t staging_mib;
    double ms_min, ms_median, gbps_pool, gbps_f16;
};

double now_ms() {
    return ggml_time_us()/1000.0;
}

// median and min of REPEATS runs of fn after one warm-up
std::pair<double, double> timed(const std::function<void()> & fn) {
    fn();
    std::vector<double> ms;
    for (int r = 0; r < REPEATS; ++r) {
        const double t0 = now_ms();
        fn();
        ms.push_back(now_ms() - t0);
    }
    std::sort(ms.begin(), ms.end());
    return { ms[REPEATS/2], ms[0] };
}

struct setup {
    ggml_backend_t be;
    ggml_type pool;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t ws_buf = nullptr, host_buf = nullptr;
    std::vector<kvmem_layer_rows> layers;
    size_t slot_bytes = 0;
    uint8_t * host = nullptr;
    std::vector<std::vector<uint32_t>> idx;

    setup(ggml_backend_t be_in, ggml_type pool_in) : be(be_in), pool(pool_in) {
        ggml_init_params params = { (2*N_LAYERS + 1)*ggml_tensor_overhead(), nullptr, true };
        ctx = ggml_init(params);
        for (uint32_t il = 0; il < N_LAYERS; ++il) {
            layers.push_back(kvtest::f16_layer(ctx, il, N_PER_ROW, N_CELLS, pool));
            slot_bytes += (size_t) BLOCK*(layers.back().hrow_k + layers.back().hrow_v);
        }
        ws_buf = ggml_backend_alloc_ctx_tensors(ctx, be);
        ggml_backend_dev_t dev = ggml_backend_get_device(be);
        ggml_backend_buffer_type_t hbt = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
        host_buf = ggml_backend_buft_alloc_buffer(hbt ? hbt : ggml_backend_cpu_buffer_type(), (size_t) N_BLOCKS*slot_bytes);
        host = (uint8_t *) ggml_backend_buffer_get_base(host_buf);
        // blocks of valid rows (zeros are valid in every type), into every other block of cells
        std::fill(host, host + (size_t) N_BLOCKS*slot_bytes, 0);
        for (uint32_t b = 0; b < N_BLOCKS; ++b) {
            std::vector<uint32_t> cells(BLOCK);
            for (uint32_t t = 0; t < BLOCK; ++t) {
                cells[t] = 2*b*BLOCK + t;
            }
            idx.push_back(std::move(cells));
        }
    }
    ~setup() {
        ggml_backend_buffer_free(host_buf);
        ggml_backend_buffer_free(ws_buf);
        ggml_free(ctx);
    }
    double f16_bytes() const { return (double) N_BLOCKS*N_LAYERS*2*BLOCK*ggml_row_size(GGML_TYPE_F16, N_PER_ROW); }
};

case_result stage_ins(const setup & s, size_t staging_mib) {
    kvmem_stager st;
    st.init(s.be, s.layers, BLOCK, staging_mib << 20);
    const auto [median, min] = timed([&]() {
        for (uint32_t b = 0; b < N_BLOCKS; ++b) {
            st.to_device(s.host + (size_t) b*s.slot_bytes, s.idx[b]);
        }
        st.flush();
    });
    const double pool_bytes = (double) N_BLOCKS*s.slot_bytes;
    return { "stager, " + std::to_string(st.capacity()/2) + " blocks per half", s.pool, staging_mib, min, median,
        pool_bytes/median/1e6, s.f16_bytes()/median/1e6 };
}

case_result plain_copies(const setup & s) {
    // one device buffer of one slot, written by every block's copy: the link alone
    ggml_init_params params = { ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) s.slot_bytes);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, s.be);
    const auto [median, min] = timed([&]() {
        for (uint32_t b = 0; b < N_BLOCKS; ++b) {
            ggml_backend_tensor_set_async(s.be, dst, s.host + (size_t) b*s.slot_bytes, 0, s.slot_bytes);
        }
        ggml_backend_synchronize(s.be);
    });
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    const double pool_bytes = (double) N_BLOCKS*s.slot_bytes;
    return { "plain copies of whole slots", s.pool, 0, min, median, pool_bytes/median/1e6, s.f16_bytes()/median/1e6 };
}

} // namespace

int main(int argc, char ** argv) {
    ggml_backend_t be = kvtest::graph_backend();
    if (!be) {
        return 1;
    }
    std::vector<case_result> results;
    for (const ggml_type pool : { GGML_TYPE_F16, GGML_TYPE_Q5_0 }) {
        const setup s(be, pool);
        results.push_back(plain_copies(s));
        for (const size_t mib : { 64, 128, 256 }) {
            results.push_back(stage_ins(s, mib));
        }
    }
    std::printf("%u blocks of %u tokens x %u layers, %s, %d repeats\n", N_BLOCKS, BLOCK, N_LAYERS, ggml_backend_name(be), REPEATS);
    std::printf("| pool | staging MiB | path | ms median | ms min | GB/s (pool bytes) | GB/s (f16 bytes) |\n|---|---:|---|---:|---:|---:|---:|\n");
    for (const auto & r : results) {
        std::printf("| %s | %zu | %s | %.2f | %.2f | %.1f | %.1f |\n", ggml_type_name(r.pool), r.staging_mib, r.what.c_str(),
                r.ms_median, r.ms_min, r.gbps_pool, r.gbps_f16);
    }
    if (argc > 1) {
        FILE * f = std::fopen(argv[1], "w");
        if (!f) {
            std::fprintf(stderr, "cannot write %s\n", argv[1]);
            return 1;
        }
        std::fprintf(f, "{\"backend\": \"%s\", \"blocks\": %u, \"block_tokens\": %u, \"layers\": %u, \"repeats\": %d, \"cases\": [",
                ggml_backend_name(be), N_BLOCKS, BLOCK, N_LAYERS, REPEATS);
        for (size_t i = 0; i < results.size(); ++i) {
            const auto & r = results[i];
            std::fprintf(f, "%s\n  {\"path\": \"%s\", \"pool\": \"%s\", \"staging_mib\": %zu, \"ms_median\": %.3f, \"ms_min\": %.3f, "
                    "\"gbps_pool\": %.2f, \"gbps_f16\": %.2f}", i ? "," : "", r.what.c_str(), ggml_type_name(r.pool),
                    r.staging_mib, r.ms_median, r.ms_min, r.gbps_pool, r.gbps_f16);
        }
        std::fprintf(f, "\n]}\n");
        std::fclose(f);
    }
    ggml_backend_free(be);
    return 0;
}
