// A ubatch's captured tensors come back in one round with their values: computed by a scheduler on a backend (the
// CPU, or KVMEM_TEST_DEVICE), read in place from host memory or copied asynchronously from a device, in rounds
// of other sizes one after the other.

#include "test-kvmem.h"

#include "llama-kvmem-readback.h"

#include <cmath>
#include <vector>

namespace {

struct two_outputs {
    ggml_context * ctx = nullptr;
    ggml_tensor * in = nullptr;
    ggml_tensor * doubled = nullptr;
    ggml_tensor * plus_one = nullptr;
    ggml_cgraph * gf = nullptr;
};

two_outputs build(int64_t n) {
    two_outputs g;
    ggml_init_params params = { 16*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc*/ true };
    g.ctx = ggml_init(params);
    g.in = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, 64, n);
    ggml_set_input(g.in);
    g.doubled = ggml_scale(g.ctx, g.in, 2.0f);
    g.plus_one = ggml_scale_bias(g.ctx, g.in, 1.0f, 1.0f);
    ggml_set_output(g.doubled);
    ggml_set_output(g.plus_one);
    g.gf = ggml_new_graph(g.ctx);
    ggml_build_forward_expand(g.gf, g.doubled);
    ggml_build_forward_expand(g.gf, g.plus_one);
    return g;
}

} // namespace

KV_SUITE(readback) {
    ggml_backend_t be = kvtest::graph_backend();
    KV_CHECK(be != nullptr);
    if (!be) {
        return;
    }
    ggml_backend_t cpu = ggml_backend_dev_init(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), nullptr);
    const bool same = ggml_backend_get_device(be) == ggml_backend_get_device(cpu);
    std::vector<ggml_backend_t> backends = { be };
    if (!same) {
        backends.push_back(cpu);
    }
    ggml_backend_sched_t sched = ggml_backend_sched_new(backends.data(), nullptr, (int) backends.size(), 64, false, true);

    kvmem_readback readback;
    for (const int64_t n : { 3, 40, 7 }) { // the scratch grows, then a smaller round reuses it
        two_outputs g = build(n);
        KV_CHECK(ggml_backend_sched_alloc_graph(sched, g.gf));
        std::vector<float> x(64*n);
        for (size_t i = 0; i < x.size(); ++i) {
            x[i] = 0.25f*(float) i - (float) n;
        }
        ggml_backend_tensor_set(g.in, x.data(), 0, ggml_nbytes(g.in));
        KV_CHECK(ggml_backend_sched_graph_compute(sched, g.gf) == GGML_STATUS_SUCCESS);

        const size_t a = readback.add(g.doubled);
        const size_t b = readback.add(g.plus_one);
        KV_CHECK(a == 0 && b == 1); // a new round after the previous fetch
        readback.fetch(sched);
        int wrong = 0;
        for (size_t i = 0; i < x.size(); ++i) {
            wrong += readback.rows(a)[i] != 2.0f*x[i];
            wrong += std::fabs(readback.rows(b)[i] - (x[i] + 1.0f)) > 1e-6f;
        }
        KV_CHECK(wrong == 0);
        ggml_backend_sched_reset(sched);
        ggml_free(g.ctx);
    }
    // a round with nothing in it reads nothing (the last graph's tensors are gone: they must not be read again)
    readback.fetch(sched);
    ggml_backend_sched_free(sched);
    ggml_backend_free(cpu);
    ggml_backend_free(be);
}
