// kvmem unit tests: recurrent state snapshots (llama-kvmem-snapshot.h) on a real hybrid model's recurrent memory.
// KVMEM_TEST_MODEL names a hybrid GGUF (tests/test_engine_units.py passes the tiny synthetic qwen35); without it
// the suite says so and checks nothing. With KVMEM_TEST_DEVICE the model's layers and the copies go to that device
// (pinned rooms, asynchronous copies); otherwise everything runs on the CPU.

#include "test-kvmem.h"

#include "llama.h"
#include "llama-io.h"
#include "llama-kvmem-readback.h"
#include "llama-kvmem-snapshot.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

#include <cstring>
#include <vector>

namespace {

// the recurrent state of a sequence as state_write writes it, tensor bytes read synchronously
class bytes_writer : public llama_io_write_i {
public:
    std::vector<uint8_t> buf;
    void write(const void * src, size_t size) override {
        buf.insert(buf.end(), (const uint8_t *) src, (const uint8_t *) src + size);
    }
    void write_tensor(ggml_tensor * t, size_t offset, size_t size) override {
        const size_t o = buf.size();
        buf.resize(o + size);
        ggml_backend_tensor_get(t, buf.data() + o, offset, size);
    }
    size_t n_bytes() override { return buf.size(); }
};

std::vector<uint8_t> state_of(const llama_memory_recurrent & recr, llama_seq_id s) {
    bytes_writer w;
    recr.state_write(w, s);
    return w.buf;
}

void decode(llama_context * ctx, std::vector<llama_token> toks) {
    KV_CHECK(llama_decode(ctx, llama_batch_get_one(toks.data(), (int32_t) toks.size())) == 0);
    llama_synchronize(ctx);
}

} // namespace

KV_SUITE(snapshot) {
    const char * path = std::getenv("KVMEM_TEST_MODEL");
    if (!path || !*path) {
        std::fprintf(stderr, "snapshot: KVMEM_TEST_MODEL is not set: nothing checked\n");
        return;
    }
    ggml_backend_load_all(); // the backend modules next to this binary
    ggml_backend_t dev_be = std::getenv("KVMEM_TEST_DEVICE") ? kvtest::graph_backend() : nullptr;
    ggml_backend_t cpu_be = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    std::vector<ggml_backend_t> backends;
    if (dev_be) {
        backends.push_back(dev_be);
    }
    backends.push_back(cpu_be);
    ggml_backend_sched_t sched = ggml_backend_sched_new(backends.data(), nullptr, (int) backends.size(),
            GGML_DEFAULT_GRAPH_SIZE, false, false);

    auto mp = llama_model_default_params();
    mp.n_gpu_layers = dev_be ? 999 : 0;
    llama_model * model = llama_model_load_from_file(path, mp);
    KV_CHECK(model != nullptr);
    if (!model) {
        return;
    }
    auto cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 64;
    cp.n_ubatch = 64;
    llama_context * ctx = llama_init_from_model(model, cp);
    auto * hybrid = dynamic_cast<llama_memory_hybrid *>(llama_get_memory(ctx));
    KV_CHECK(hybrid != nullptr);
    if (hybrid) {
        llama_memory_recurrent & recr = *hybrid->get_mem_recr();
        decode(ctx, { 1, 2, 3, 4, 5, 6, 7, 8 });
        const auto at8 = state_of(recr, 0);

        kvmem_snapshot snap(8, kvmem_room());
        snap.take(sched, recr, 0);
        std::fprintf(stderr, "snapshot: %zu bytes, %s\n", at8.size(), dev_be ? "device copies" : "CPU");
        decode(ctx, { 9, 10, 11, 12 });
        const auto at12 = state_of(recr, 0);
        KV_CHECK(at12 != at8);           // the state moved on
        KV_CHECK(snap.written() == at8); // the snapshot did not
        kvmem_snapshot later(12, kvmem_room());
        later.take(sched, recr, 0);

        const auto restore = [&](const kvmem_snapshot & s) {
            s.restore(sched, recr, 0);
            for (ggml_backend_t be : backends) {
                ggml_backend_synchronize(be);
            }
            return state_of(recr, 0);
        };
        KV_CHECK(restore(snap) == at8);
        KV_CHECK(restore(later) == at12);

        // a session file's bytes restore the same state
        const kvmem_snapshot from_file(8, snap.written());
        KV_CHECK(from_file.written() == at8);
        KV_CHECK(restore(from_file) == at8);
        KV_CHECK(restore(later) == at12);

        // a dropped snapshot's room holds the next one
        kvmem_snapshot reused(12, snap.release_room());
        reused.take(sched, recr, 0);
        KV_CHECK(reused.written() == at12);
        KV_CHECK(restore(reused) == at12);
    }
    llama_free(ctx);
    llama_model_free(model);
    ggml_backend_sched_free(sched);
    ggml_backend_free(cpu_be);
    if (dev_be) {
        ggml_backend_free(dev_be);
    }
}
