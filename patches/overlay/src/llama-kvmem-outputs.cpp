// KVMem: a caller's batch decoded in several passes (segments cut at selections, recomputed tails) returns one
// set of outputs (kvmem-llama): each pass's logits, embeddings and next-n rows are kept per batch token on the
// host, a later pass replacing an earlier one's rows for the same token, and put back at the end.

#include "llama-kvmem.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-model.h"

#include <algorithm>
#include <cstring>

void llama_context::kvmem_collect_outputs(const std::vector<int64_t> & index, kvmem_assembled_outputs & acc) {
    // index[j]: the caller's batch index of the pass's token j (-1: a token of an earlier batch)
    llama_kvmem_outputs o;
    kvmem_take_outputs(index.size(), o);
    const size_t n_vocab = model.vocab.n_tokens();
    const size_t n_embd_out = model.hparams.n_embd_out();
    for (size_t j = 0; j < index.size(); ++j) {
        const int64_t i = index[j];
        if (i < 0) {
            continue;
        }
        if (j < o.ids.size() && o.ids[j] >= 0) {
            const size_t r = o.ids[j];
            if (!o.logits.empty()) {
                acc.logits[i].assign(o.logits.begin() + r*n_vocab, o.logits.begin() + (r + 1)*n_vocab);
            }
            if (!o.embd.empty()) {
                acc.embd[i].assign(o.embd.begin() + r*n_embd_out, o.embd.begin() + (r + 1)*n_embd_out);
            }
        }
        if (!o.nextn.empty()) {
            acc.nextn[i].assign(o.nextn.begin() + j*n_embd_out, o.nextn.begin() + (j + 1)*n_embd_out);
        }
    }
    acc.any = true;
}

bool llama_context::kvmem_restore_outputs(const llama_batch_ext & batch, const kvmem_assembled_outputs & acc) {
    llama_kvmem_outputs o;
    o.ids.assign(batch.tokens.size(), -1);
    for (size_t i = 0; i < batch.tokens.size(); ++i) {
        if (!batch.tokens[i].output || (acc.logits[i].empty() && acc.embd[i].empty())) {
            continue;
        }
        o.ids[i] = o.n_out++;
        o.logits.insert(o.logits.end(), acc.logits[i].begin(), acc.logits[i].end());
        o.embd.insert(o.embd.end(), acc.embd[i].begin(), acc.embd[i].end());
    }
    bool nextn = true;
    for (const auto & row : acc.nextn) {
        nextn = nextn && !row.empty();
    }
    if (nextn) {
        for (const auto & row : acc.nextn) {
            o.nextn.insert(o.nextn.end(), row.begin(), row.end());
        }
    }
    return kvmem_put_outputs(o);
}

void llama_context::kvmem_take_outputs(size_t n_tok, llama_kvmem_outputs & o) {
    output_reorder();
    const size_t n_vocab = model.vocab.n_tokens();
    const size_t n_embd_out = model.hparams.n_embd_out();
    o.ids.assign(output_ids.begin(), output_ids.begin() + std::min(n_tok, output_ids.size()));
    o.n_out = 0;
    for (const auto id : o.ids) {
        o.n_out = std::max(o.n_out, id + 1);
    }
    o.logits.clear();
    o.embd.clear();
    o.nextn.clear();
    if (logits.data) {
        o.logits.assign(logits.data, logits.data + (size_t) o.n_out*n_vocab);
    }
    if (embd.data && embd.size > 0) {
        o.embd.assign(embd.data, embd.data + (size_t) o.n_out*n_embd_out);
    }
    // draft-mtp reads one unmasked next-n row per batch token
    if (cparams.embeddings_nextn && !cparams.embeddings_nextn_masked && embd_nextn.data) {
        o.nextn.assign(embd_nextn.data, embd_nextn.data + n_tok*n_embd_out);
    }
}

bool llama_context::kvmem_put_outputs(const llama_kvmem_outputs & o) {
    if (output_reserve(o.n_out) < (uint32_t) o.n_out) { // lays the views out for these outputs again
        return false;
    }
    if (logits.data && !o.logits.empty()) {
        std::memcpy(logits.data, o.logits.data(), o.logits.size()*sizeof(float));
    }
    if (embd.data && !o.embd.empty()) {
        std::memcpy(embd.data, o.embd.data(), o.embd.size()*sizeof(float));
    }
    if (embd_nextn.data && !o.nextn.empty()) {
        std::memcpy(embd_nextn.data, o.nextn.data(), o.nextn.size()*sizeof(float));
    }
    std::fill(output_ids.begin(), output_ids.end(), -1);
    std::copy(o.ids.begin(), o.ids.end(), output_ids.begin());
    n_outputs = o.n_out;
    return true;
}
