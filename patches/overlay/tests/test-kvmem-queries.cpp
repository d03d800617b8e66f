// The query store: rows written into a sequence's ring (wrapping), a selection's newest rows uploaded from it, a
// turn's question kept on the backend (the CPU, or KVMEM_TEST_DEVICE) and brought back from its host copy after
// another sequence's turn took the device's rows.

#include "test-kvmem.h"

#include "llama-kvmem-queries.h"

#include <vector>

namespace {

const kvmem_dims D = { /*n_lt*/ 2, /*n_head*/ 4, /*n_head_kv*/ 2, /*head_dim*/ 8, /*block*/ 16 };

// the value of (sequence, position, element) in a row: unique, so a misplaced row shows
float value(uint32_t seq, int32_t pos, size_t i) {
    return (float) seq*100000.0f + (float) pos*1000.0f + (float) i;
}

void write(kvmem_query_store & qs, uint32_t seq, int32_t p0, int32_t p1) {
    for (int32_t p = p0; p < p1; ++p) {
        float * row = qs.ring_row(seq, p);
        for (size_t i = 0; i < D.query_row(); ++i) {
            row[i] = value(seq, p, i);
        }
    }
}

// row r of a span holds (seq, pos): every layer's part, read back from the backend where the scorer reads it
bool holds(const kvmem_graph_scorer::rows_span & s, uint32_t r, uint32_t seq, int32_t pos) {
    const size_t per_layer = (size_t) D.n_head*D.head_dim;
    std::vector<float> part(per_layer);
    bool ok = true;
    for (uint32_t lt = 0; lt < D.n_lt; ++lt) {
        ggml_backend_tensor_get(s.t, part.data(), s.offs + lt*s.layer_nb + r*s.row_nb, part.size()*sizeof(float));
        for (size_t i = 0; i < per_layer; ++i) {
            ok = ok && part[i] == value(seq, pos, lt*per_layer + i);
        }
    }
    return ok;
}

} // namespace

KV_SUITE(queries) {
    ggml_backend_t be = kvtest::graph_backend();
    KV_CHECK(be != nullptr);
    if (!be) {
        return;
    }
    kvmem_query_store qs;
    qs.init(be, D, /*n_seqs*/ 2, /*ring*/ 10, /*turn*/ 4, /*newest*/ 5);
    KV_CHECK(qs.device_bytes() == (size_t) (4 + 5)*D.query_row()*sizeof(float));
    KV_CHECK(qs.host_bytes() == (size_t) 2*(10 + 4)*D.query_row()*sizeof(float));
    KV_CHECK(qs.largest().n == 4 + 5); // one span: a selection's steps are cut from all of its rows

    // positions 5..14 of seq 1: the ring wraps at 10; newest rows across the wrap, and with a gap
    write(qs, 1, 5, 15);
    kvmem_graph_scorer::rows_span s = qs.selection_rows(1, 0, { 8, 9, 10, 11, 12 });
    KV_CHECK(s.n == 5 && holds(s, 0, 1, 8) && holds(s, 1, 1, 9) && holds(s, 2, 1, 10) && holds(s, 4, 1, 12));
    s = qs.selection_rows(1, 0, { 6, 13 });
    KV_CHECK(s.n == 2 && holds(s, 0, 1, 6) && holds(s, 1, 1, 13));

    // seq 1's question stays on the device while its ring moves on; a selection's newest rows follow it
    qs.keep_turn(1, { 9, 10, 11 });
    write(qs, 1, 15, 25); // positions 9..11 leave the ring
    s = qs.selection_rows(1, 3, {});
    KV_CHECK(s.n == 3 && holds(s, 0, 1, 9) && holds(s, 2, 1, 11));
    s = qs.selection_rows(1, 3, { 22, 23, 24 });
    KV_CHECK(s.n == 6 && holds(s, 0, 1, 9) && holds(s, 2, 1, 11) && holds(s, 3, 1, 22) && holds(s, 5, 1, 24));
    // newest rows in place of the question's third row: it comes back from the host copy when asked for again
    s = qs.selection_rows(1, 2, { 20, 21, 22, 23, 24 });
    KV_CHECK(s.n == 7 && holds(s, 1, 1, 10) && holds(s, 2, 1, 20) && holds(s, 6, 1, 24));
    s = qs.selection_rows(1, 3, { 24 });
    KV_CHECK(s.n == 4 && holds(s, 0, 1, 9) && holds(s, 2, 1, 11) && holds(s, 3, 1, 24));

    // seq 0's turn takes the device's rows; seq 1's come back from their host copy, then seq 0's from theirs
    write(qs, 0, 20, 22);
    qs.keep_turn(0, { 20, 21 });
    s = qs.selection_rows(0, 2, {});
    KV_CHECK(holds(s, 0, 0, 20) && holds(s, 1, 0, 21));
    s = qs.selection_rows(1, 3, {});
    KV_CHECK(holds(s, 0, 1, 9) && holds(s, 1, 1, 10) && holds(s, 2, 1, 11));
    write(qs, 0, 22, 40);
    s = qs.selection_rows(0, 2, {});
    KV_CHECK(holds(s, 0, 0, 20) && holds(s, 1, 0, 21));
    // seq 1's newest rows alone take the place of seq 0's question, which comes back from its host copy
    s = qs.selection_rows(1, 0, { 23, 24 });
    KV_CHECK(s.n == 2 && holds(s, 0, 1, 23) && holds(s, 1, 1, 24));
    s = qs.selection_rows(0, 2, { 39 });
    KV_CHECK(s.n == 3 && holds(s, 0, 0, 20) && holds(s, 1, 0, 21) && holds(s, 2, 0, 39));
    ggml_backend_free(be);
}
