// KVMem: the graph hook (kvmem-llama): the pre-RoPE keys and queries of every tiered attention layer become graph
// outputs, read after the ubatch by llama-kvmem-rows.cpp.

#include "llama-kvmem.h"

#include "llama-graph.h"

#include <algorithm>

// walk back from the tensor handed to the attention builder to the input of its RoPE op
static ggml_tensor * kvmem_pre_rope(ggml_tensor * t) {
    ggml_tensor * cur = t;
    for (int i = 0; i < 6 && cur; ++i) {
        if (cur->op == GGML_OP_ROPE) {
            return cur->src[0];
        }
        if (cur->op == GGML_OP_SCALE || cur->op == GGML_OP_CONT || cur->op == GGML_OP_RESHAPE ||
            cur->op == GGML_OP_VIEW  || cur->op == GGML_OP_CPY) {
            cur = cur->src[0];
            continue;
        }
        break;
    }
    return t; // no RoPE found (e.g. NoPE layers): the tensor itself is position-free
}

static ggml_tensor * kvmem_f32_cont(ggml_context * ctx0, ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 ? ggml_cont(ctx0, t) : ggml_cast(ctx0, ggml_cont(ctx0, t), GGML_TYPE_F32);
}

void llama_kvmem_graph_capture(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_result * res,
        ggml_tensor * q_cur, ggml_tensor * k_cur, int il, const llama_kvmem_params & kp) {
    if (!res || il < 0 || kp.leader || kvmem_scorer::resolve(kp.method) == LLAMA_KVMEM_METHOD_RECENCY) {
        return; // followers and recency select without keys or queries
    }
    // pre-RoPE: measured to match a question to its fact better than positional keys (docs/eval)
    ggml_tensor * k_src = kvmem_pre_rope(k_cur);
    ggml_tensor * q_src = kvmem_pre_rope(q_cur);
    if (ggml_n_dims(k_src) > 3 || ggml_n_dims(q_src) > 3 || k_src->ne[0] != q_src->ne[0]) {
        return;
    }
    // the query of a turn is the end of its last user message: the rows of each ubatch's last tokens
    // (query_tokens, plus slack for the chat template's closing tokens) are enough to cover it
    const int64_t n_tokens = q_src->ne[2];
    const int64_t nq = std::min<int64_t>((int64_t) kp.query_tokens + 64, n_tokens);

    ggml_tensor * k_out = kvmem_f32_cont(ctx0, k_src);
    ggml_tensor * q_tail = ggml_view_3d(ctx0, q_src, q_src->ne[0], q_src->ne[1], nq,
            q_src->nb[1], q_src->nb[2], (n_tokens - nq)*q_src->nb[2]);
    ggml_tensor * q_out = kvmem_f32_cont(ctx0, q_tail);

    ggml_format_name(k_out, "kvmem_k-%d", il);
    ggml_format_name(q_out, "kvmem_q-%d", il);
    ggml_set_output(k_out);
    ggml_set_output(q_out);
    ggml_build_forward_expand(gf, k_out);
    ggml_build_forward_expand(gf, q_out);

    if ((int) res->t_kvmem_k.size() <= il) {
        res->t_kvmem_k.resize(il + 1, nullptr);
        res->t_kvmem_q.resize(il + 1, nullptr);
    }
    res->t_kvmem_k[il] = k_out;
    res->t_kvmem_q[il] = q_out;
}
