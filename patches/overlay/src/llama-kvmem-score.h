#pragma once

// KVMem block summaries and scoring (kvmem-llama): which history blocks a query needs.
//
// A block's summary is built once, when the block is complete, from the pre-RoPE keys of its tokens;
// a selection scores every block of a sequence against the turn's query rows. Key and query
// rows are float [n_lt][heads][head_dim] per token (n_lt = tiered layers). One implementation per method,
// all on the CPU; selection is shared by all layers, so every method reduces (layer, head, query row)
// evidence to one score per block.
// Pure functions of their inputs (tests/kvmem).

#include "llama.h"
#include "llama-kvmem-params.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

struct kvmem_dims {
    uint32_t n_lt      = 0; // tiered (attention) layers
    uint32_t n_head    = 0;
    uint32_t n_head_kv = 0;
    uint32_t head_dim  = 0;
    uint32_t block     = 0; // tokens per block

    size_t key_row()   const { return (size_t) n_lt*n_head_kv*head_dim; } // floats per token
    size_t query_row() const { return (size_t) n_lt*n_head*head_dim; }
};

// key_row(pos, lt, k): the layer-lt part of the key row of the k-th cell at position pos (an image's cells share
// one), nullptr when it is not known
using kvmem_key_rows = std::function<const float * (llama_pos pos, uint32_t lt, uint32_t k)>;

class kvmem_scorer {
public:
    // n_threads: the context's threads (scoring runs inside its decode)
    kvmem_scorer(const kvmem_dims & dims, int32_t method, uint32_t n_threads = 1);

    int32_t method() const { return named; }
    const kvmem_dims & dims() const { return d; }
    // hybrid: the picks alternate between the attention score and the question's rare words (llama-kvmem.cpp)
    bool lexical() const { return named == LLAMA_KVMEM_METHOD_HYBRID; }
    bool scores() const { return meth != LLAMA_KVMEM_METHOD_RECENCY; }

    // floats of one block's summary (0: the method needs none)
    size_t summary_size() const;

    // rows[t*n_lt + lt]: layer lt's key row ([kv head][head_dim]) of the block's token t in [0, block), read where
    // it was captured; nullptr when the token is not known (a block cut by a truncation): then the chunks of `old`
    // (a summary of the block before the cut) that lie within its first n_same tokens are kept, and the others are
    // summarized from the rows that are known. A block of another number of cells (an image's) gives its rows in
    // cell order, its pages spread over them evenly (no `old`)
    void summarize(const std::vector<const float *> & rows, float * out, const float * old = nullptr,
            uint32_t n_same = 0) const;
    // a whole block from rows one token after another ([t][layer][kv head][head_dim])
    void summarize(const float * keys, float * out) const;

    // scores of the blocks whose summaries are given (nullptr: no summary, scored -inf); only the
    // candidates are ranked, but methods that normalize attention count every block (the sink and the
    // recent window take their share of the query's attention). q: n_rows query rows.
    void score(const std::vector<const float *> & summaries, const std::vector<char> & candidate,
            const float * q, size_t n_rows, std::vector<float> & out) const;

    static const char * method_name(int32_t method);
    static int32_t method_from_name(const std::string & name); // -1 if unknown
    static int32_t resolve(int32_t method); // RETRIEVAL -> the default scorer

private:
    kvmem_dims d;
    int32_t named; // the method asked for (RETRIEVAL resolved)
    int32_t meth;  // the attention scorer it uses
    uint32_t sub = 16; // sub-page / chunk tokens
    uint32_t n_threads = 1;

    void score_bounds(const std::vector<const float *> & sums, const std::vector<char> & cand,
            const float * q, size_t n_rows, std::vector<float> & out) const;
    void score_meankey(const std::vector<const float *> & sums, const float * q, size_t n_rows, std::vector<float> & out) const;
    void score_mass(const std::vector<const float *> & sums, const float * q, size_t n_rows, std::vector<float> & out) const;
};
