// The stager's graphs (on the CPU, or on KVMEM_TEST_DEVICE): a host slot in the pool's type lands in scattered cells of an f16
// working set exactly as the host conversion would put it there, and cells written back come out as the pool's type.

#include "test-kvmem.h"

#include "llama-kvmem-stager.h"

#include <cmath>
#include <random>
#include <vector>

namespace {

constexpr int64_t  N_PER_ROW = 64; // 2 KV heads of 32
constexpr int64_t  N_CELLS   = 96;
constexpr uint32_t BLOCK     = 16;
constexpr uint32_t N_LAYERS  = 2;

struct working_set {
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<kvmem_layer_rows> layers;

    working_set(ggml_backend_t be, ggml_type pool) {
        ggml_init_params params = { 2*N_LAYERS*ggml_tensor_overhead(), nullptr, true };
        ctx = ggml_init(params);
        for (uint32_t il = 0; il < N_LAYERS; ++il) {
            layers.push_back(kvtest::f16_layer(ctx, il, N_PER_ROW, N_CELLS, pool));
        }
        buf = ggml_backend_alloc_ctx_tensors(ctx, be);
        ggml_backend_buffer_clear(buf, 0);
    }
    ~working_set() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
    size_t slot_bytes() const { return (size_t) N_LAYERS*2*BLOCK*layers[0].hrow_k; }
    // row `cell` of layer il's K or V, as f32
    std::vector<float> row(uint32_t il, bool is_v, uint32_t cell) const {
        ggml_tensor * t = is_v ? layers[il].v : layers[il].k;
        std::vector<ggml_fp16_t> h(N_PER_ROW);
        ggml_backend_tensor_get(t, h.data(), (size_t) cell*t->nb[1], h.size()*sizeof(ggml_fp16_t));
        std::vector<float> f(N_PER_ROW);
        ggml_fp16_to_fp32_row(h.data(), f.data(), N_PER_ROW);
        return f;
    }
};

// the f32 values a host slot holds for (layer, K/V, token)
std::vector<float> slot_row(const std::vector<uint8_t> & slot, ggml_type pool, uint32_t il, bool is_v, uint32_t t) {
    const size_t hrow = ggml_row_size(pool, N_PER_ROW);
    const size_t off = ((size_t) il*2*BLOCK + (is_v ? BLOCK : 0) + t)*hrow;
    std::vector<float> f(N_PER_ROW);
    ggml_get_type_traits(pool)->to_float(slot.data() + off, f.data(), N_PER_ROW);
    return f;
}

void check_type(ggml_backend_t be, ggml_type pool, size_t staging_bytes) {
    working_set ws(be, pool);
    std::mt19937 rng(7);
    std::normal_distribution<float> noise(0.0f, 1.0f);

    // three blocks of random keys and values, quantized into host slots as the write-through would
    std::vector<std::vector<uint8_t>> slots(3, std::vector<uint8_t>(ws.slot_bytes()));
    for (auto & slot : slots) {
        std::vector<float> f((size_t) N_LAYERS*2*BLOCK*N_PER_ROW);
        for (auto & x : f) {
            x = noise(rng);
        }
        ggml_quantize_chunk(pool, f.data(), slot.data(), 0, (int64_t) N_LAYERS*2*BLOCK, N_PER_ROW, nullptr);
    }
    // scattered cells: block 0 reversed in cells 0..15, block 1 on even cells 32.., block 2 contiguous at 70
    std::vector<std::vector<uint32_t>> idx(3);
    for (uint32_t t = 0; t < BLOCK; ++t) {
        idx[0].push_back(BLOCK - 1 - t);
        idx[1].push_back(32 + 2*t);
        idx[2].push_back(70 + t);
    }
    kvmem_stager st;
    st.init(be, ws.layers, BLOCK, staging_bytes);
    for (int b = 0; b < 3; ++b) {
        st.to_device(slots[b].data(), idx[b]);
    }
    st.flush();

    // each cell holds its token's row, converted to f16 as the host would (to f32, then to f16)
    double worst = 0.0;
    for (int b = 0; b < 3; ++b) {
        for (uint32_t il = 0; il < N_LAYERS; ++il) {
            for (const bool is_v : { false, true }) {
                for (uint32_t t = 0; t < BLOCK; ++t) {
                    const auto want = slot_row(slots[b], pool, il, is_v, t);
                    const auto got = ws.row(il, is_v, idx[b][t]);
                    for (int64_t i = 0; i < N_PER_ROW; ++i) {
                        worst = std::max(worst, (double) std::fabs(ggml_fp16_to_fp32(ggml_fp32_to_fp16(want[i])) - got[i]));
                    }
                }
            }
        }
    }
    KV_CHECK(worst == 0.0);
    KV_CHECK(ws.row(0, false, 20)[0] == 0.0f); // a cell no block was staged into is untouched

    // the cells written back: the pool's type again, within the type's rounding of what the cells hold
    std::vector<std::vector<uint8_t>> back(3, std::vector<uint8_t>(ws.slot_bytes(), 0xff));
    for (int b = 2; b >= 0; --b) {
        st.to_host(back[b].data(), idx[b]);
    }
    st.flush();
    double err = 0.0, scale = 0.0;
    for (int b = 0; b < 3; ++b) {
        for (uint32_t il = 0; il < N_LAYERS; ++il) {
            for (const bool is_v : { false, true }) {
                for (uint32_t t = 0; t < BLOCK; ++t) {
                    const auto want = ws.row(il, is_v, idx[b][t]);
                    const auto got = slot_row(back[b], pool, il, is_v, t);
                    for (int64_t i = 0; i < N_PER_ROW; ++i) {
                        err = std::max(err, (double) std::fabs(want[i] - got[i]));
                        scale = std::max(scale, (double) std::fabs(want[i]));
                    }
                }
            }
        }
    }
    const double step = pool == GGML_TYPE_F16 ? 0.0 : pool == GGML_TYPE_Q8_0 ? 1.0/127 : 1.0/15;
    KV_CHECK(err <= step*scale + 1e-6);
    if (pool == GGML_TYPE_F16) {
        KV_CHECK(back[1] == slots[1]); // f16 -> f16 -> f16 is exact
    }
}

// more rounds between two flushes than the cell indices' arena holds (one block per round), into six interleaved
// sets of cells in turn: each round's indices and rows arrive in order and no round's indices overwrite those a graph
// of the other half still reads (they travel on the copies' stream), so each set ends with the last block staged
// into it
void check_many_rounds(ggml_backend_t be) {
    working_set ws(be, GGML_TYPE_F16);
    std::vector<std::vector<uint8_t>> slots(3, std::vector<uint8_t>(ws.slot_bytes()));
    for (size_t b = 0; b < slots.size(); ++b) {
        std::vector<float> f((size_t) N_LAYERS*2*BLOCK*N_PER_ROW, (float) b + 1.0f);
        ggml_quantize_chunk(GGML_TYPE_F16, f.data(), slots[b].data(), 0, (int64_t) N_LAYERS*2*BLOCK, N_PER_ROW, nullptr);
    }
    const uint32_t n_sets = N_CELLS/BLOCK;
    std::vector<std::vector<uint32_t>> sets(n_sets);
    for (uint32_t k = 0; k < n_sets; ++k) {
        for (uint32_t t = 0; t < BLOCK; ++t) {
            sets[k].push_back(k + n_sets*t);
        }
    }
    kvmem_stager st;
    st.init(be, ws.layers, BLOCK, 1);
    const int n_rounds = 2600; // over twice the arena's 1,024 blocks
    for (int r = 0; r < n_rounds; ++r) {
        st.to_device(slots[r % 3].data(), sets[r % n_sets]);
    }
    st.flush();
    bool all = true;
    for (uint32_t k = 0; k < n_sets; ++k) {
        int last = n_rounds - 1;
        while (last % (int) n_sets != (int) k) {
            --last;
        }
        for (uint32_t il = 0; il < N_LAYERS; ++il) {
            for (const bool is_v : { false, true }) {
                for (uint32_t t = 0; t < BLOCK; ++t) {
                    all = all && ws.row(il, is_v, sets[k][t])[N_PER_ROW - 1] == (float) (last % 3) + 1.0f;
                }
            }
        }
    }
    KV_CHECK(all);
}

// stage-ins and write-throughs of the same cells between two flushes, one block per round, so that the two halves of
// the staging buffer take turns and every round depends on the one before it: a write-through reads what the stage-in
// before it put there, and the stage-in after it does not overtake it
void check_round_trips(ggml_backend_t be) {
    working_set ws(be, GGML_TYPE_F16);
    const int n_trips = 40;
    std::vector<std::vector<uint8_t>> in(n_trips, std::vector<uint8_t>(ws.slot_bytes()));
    std::vector<std::vector<uint8_t>> out(n_trips, std::vector<uint8_t>(ws.slot_bytes(), 0));
    for (int r = 0; r < n_trips; ++r) {
        std::vector<float> f((size_t) N_LAYERS*2*BLOCK*N_PER_ROW);
        for (size_t i = 0; i < f.size(); ++i) {
            f[i] = (float) (r*7 + (int) (i % 13));
        }
        ggml_quantize_chunk(GGML_TYPE_F16, f.data(), in[r].data(), 0, (int64_t) N_LAYERS*2*BLOCK, N_PER_ROW, nullptr);
    }
    std::vector<uint32_t> idx(BLOCK);
    for (uint32_t t = 0; t < BLOCK; ++t) {
        idx[t] = 50 + t;
    }
    kvmem_stager st;
    st.init(be, ws.layers, BLOCK, 1);
    for (int r = 0; r < n_trips; ++r) {
        st.to_device(in[r].data(), idx);
        st.to_host(out[r].data(), idx);
    }
    st.flush();
    bool all = true;
    for (int r = 0; r < n_trips; ++r) {
        all = all && out[r] == in[r];
    }
    KV_CHECK(all);
}

} // namespace

KV_SUITE(stager) {
    ggml_backend_t be = kvtest::graph_backend(); // the CPU, or KVMEM_TEST_DEVICE
    KV_CHECK(be != nullptr);
    if (!be) {
        return;
    }
    for (const ggml_type pool : { GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q5_0 }) {
        check_type(be, pool, (size_t) 64 << 20); // all three blocks in one graph
        check_type(be, pool, 1);                 // one block per graph: the queue flushes when full
    }
    check_many_rounds(be);
    check_round_trips(be);
    ggml_backend_free(be);
}
