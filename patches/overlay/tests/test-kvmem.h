#pragma once

// A small test harness for the kvmem unit tests: KV_CHECK records a failure and goes on; each suite is a function
// registered by KV_SUITE and run by name (ctest runs one suite per test).

#include <cstdio>
#include <functional>
#include <map>
#include <string>

namespace kvtest {

inline int & failures() { static int n = 0; return n; }

inline std::map<std::string, std::function<void()>> & suites() {
    static std::map<std::string, std::function<void()>> s;
    return s;
}

struct registrar {
    registrar(const char * name, std::function<void()> fn) { suites()[name] = std::move(fn); }
};

} // namespace kvtest

#define KV_CHECK(cond) do { \
        if (!(cond)) { \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            kvtest::failures()++; \
        } \
    } while (0)

#define KV_SUITE(name) \
    static void kvsuite_##name(); \
    static kvtest::registrar kvreg_##name(#name, kvsuite_##name); \
    static void kvsuite_##name()

#include "ggml-backend.h"
#include "llama-kvmem-pool.h"
#include "llama-kvmem-summaries.h"

#include <cstdlib>
#include <vector>

namespace kvtest {

// the backend the graph suites run on: KVMEM_TEST_DEVICE names a device (e.g. CUDA0, on a GPU build host), else
// the CPU; the caller frees it
inline ggml_backend_t graph_backend() {
    ggml_backend_load_all(); // the backend modules next to this binary
    const char * name = std::getenv("KVMEM_TEST_DEVICE");
    ggml_backend_dev_t dev = name && *name ? ggml_backend_dev_by_name(name) : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) {
        std::fprintf(stderr, "no device %s\n", name ? name : "CPU");
        return nullptr;
    }
    std::fprintf(stderr, "graphs on %s\n", ggml_backend_dev_name(dev));
    return ggml_backend_dev_init(dev, nullptr);
}

// one tiered layer of an f16 working set of n_cells cells over a host pool of type `pool` (tensors in ctx, not
// allocated)
inline kvmem_layer_rows f16_layer(ggml_context * ctx, uint32_t il, int64_t n_per_row, int64_t n_cells, ggml_type pool) {
    kvmem_layer_rows l;
    l.il = il;
    l.k = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_per_row, n_cells);
    l.v = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_per_row, n_cells);
    l.row_k = l.row_v = ggml_row_size(GGML_TYPE_F16, n_per_row);
    l.hrow_k = l.hrow_v = ggml_row_size(pool, n_per_row);
    l.pool_k = l.pool_v = pool;
    return l;
}

// host query rows ([row][layer][head][head_dim]) in a tensor on the backend, where the graph scorer reads them
struct backend_rows {
    kvmem_dims d;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * t = nullptr;

    backend_rows(ggml_backend_t be, const kvmem_dims & dims, const std::vector<float> & rows) : d(dims) {
        ggml_init_params params = { ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
        ctx = ggml_init(params);
        t = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, (int64_t) rows.size());
        buf = ggml_backend_alloc_ctx_tensors(ctx, be);
        ggml_backend_tensor_set(t, rows.data(), 0, ggml_nbytes(t));
    }
    ~backend_rows() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
    // rows r0 .. r0 + n - 1
    kvmem_graph_scorer::rows_span span(uint32_t r0, uint32_t n) const {
        const size_t layer = (size_t) d.n_head*d.head_dim*sizeof(float);
        return { t, (size_t) r0*d.query_row()*sizeof(float), d.query_row()*sizeof(float), layer, n };
    }
};

} // namespace kvtest
