#pragma once

// KVMem: the lexical picks of `hybrid` (kvmem-llama): blocks that share the question's rare words, by BM25 over block
// token ids. An inverted index (token -> blocks holding it, with counts) is kept up to date as blocks are written to
// the host pool and dropped, so a selection touches only the posting lists of the question's tokens, never every
// block's tokens. Pure (tests/test-kvmem-score.cpp).

#include "llama.h"

#include <cstdint>
#include <map>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

// the question's tokens, weighted toward its end: half the weight every `half_life` tokens before it (-1 = unknown)
std::vector<std::pair<llama_token, float>> kvmem_question_tokens(const std::vector<llama_token> & tokens, float half_life);

class kvmem_lexical_index {
public:
    // a block on the host with its token ids (-1 = unknown); replaces what the block held
    void add(int32_t block, const std::vector<llama_token> & tokens);
    void remove(int32_t block);
    void remove_from(int32_t b0); // every block >= b0

    size_t n_docs() const { return terms.size(); }
    bool contains(int32_t block) const { return terms.count(block) > 0; }

    // blocks (not in `exclude`) that share rare words with the question, best first: BM25 with the question's
    // weights (the span may start inside a long message), kept only when a block stands out (mean + 2 sd over
    // every block not excluded) and holds a rare word (in at most a tenth of the blocks) from near the question's
    // end, so a question without rare words adds none
    std::vector<std::pair<float, int32_t>> rank(const std::vector<std::pair<llama_token, float>> & question,
            const std::set<int32_t> & exclude) const;

private:
    std::unordered_map<llama_token, std::map<int32_t, uint16_t>> postings; // token -> block -> count
    std::map<int32_t, std::vector<llama_token>> terms;                     // block -> its distinct tokens
};
