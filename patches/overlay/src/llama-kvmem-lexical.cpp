// KVMem: the lexical picks of `hybrid` (kvmem-llama). See llama-kvmem-lexical.h.

#include "llama-kvmem-lexical.h"

#include <algorithm>
#include <climits>
#include <cmath>

std::vector<std::pair<llama_token, float>> kvmem_question_tokens(const std::vector<llama_token> & tokens, float half_life) {
    std::vector<std::pair<llama_token, float>> out;
    const size_t n = tokens.size();
    for (size_t i = 0; i < n; ++i) {
        if (tokens[i] >= 0) {
            out.push_back({ tokens[i], std::pow(0.5f, (float) (n - 1 - i)/half_life) });
        }
    }
    return out;
}

void kvmem_lexical_index::add(int32_t block, const std::vector<llama_token> & tokens) {
    remove(block);
    std::map<llama_token, uint16_t> counts;
    for (const llama_token t : tokens) {
        if (t >= 0) {
            uint16_t & c = counts[t];
            c = c < UINT16_MAX ? c + 1 : c;
        }
    }
    auto & distinct = terms[block];
    for (const auto & [t, c] : counts) {
        postings[t][block] = c;
        distinct.push_back(t);
    }
}

void kvmem_lexical_index::remove(int32_t block) {
    const auto it = terms.find(block);
    if (it == terms.end()) {
        return;
    }
    for (const llama_token t : it->second) {
        auto p = postings.find(t);
        p->second.erase(block);
        if (p->second.empty()) {
            postings.erase(p);
        }
    }
    terms.erase(it);
}

void kvmem_lexical_index::remove_from(int32_t b0) {
    while (!terms.empty() && terms.rbegin()->first >= b0) {
        remove(terms.rbegin()->first);
    }
}

std::vector<std::pair<float, int32_t>> kvmem_lexical_index::rank(const std::vector<std::pair<llama_token, float>> & question,
        const std::set<int32_t> & exclude) const {
    // the question's distinct tokens, each with its largest weight, in the order they first occur
    std::vector<std::pair<llama_token, float>> q;
    std::unordered_map<llama_token, size_t> seen;
    for (const auto & [t, w] : question) {
        const auto it = seen.emplace(t, q.size());
        if (it.second) {
            q.push_back({ t, w });
        } else {
            q[it.first->second].second = std::max(q[it.first->second].second, w);
        }
    }
    size_t n_cand = 0;
    for (const auto & [b, distinct] : terms) {
        n_cand += exclude.count(b) ? 0 : 1;
    }
    std::vector<std::pair<float, int32_t>> out;
    if (n_cand < 2) {
        return out;
    }
    const uint32_t n_docs = (uint32_t) terms.size();
    const uint32_t rare_df = std::max<uint32_t>(1, n_docs/10);
    const float k1 = 1.2f;
    // per candidate block: its score, added up in the question's token order, and whether it holds a rare word
    std::map<int32_t, std::pair<float, bool>> cand;
    for (const auto & [t, w] : q) {
        const auto p = postings.find(t);
        if (p == postings.end()) {
            continue;
        }
        const uint32_t df = (uint32_t) p->second.size();
        const float idf = w*std::log(1.0f + (n_docs - df + 0.5f)/(df + 0.5f));
        const bool rare = df <= rare_df && w >= 0.25f;
        for (const auto & [b, c] : p->second) {
            if (!exclude.count(b)) {
                auto & e = cand[b];
                e.first += idf*c*(k1 + 1.0f)/(c + k1);
                e.second = e.second || rare;
            }
        }
    }
    // the bar: mean + 2 sd over every block not excluded (the ones no question token occurs in score 0)
    double sum = 0.0, sum2 = 0.0;
    for (const auto & [b, e] : cand) {
        sum += e.first;
        sum2 += (double) e.first*e.first;
    }
    const double mean = sum/n_cand;
    const double sd = std::sqrt(std::max(0.0, sum2/n_cand - mean*mean));
    const float bar = (float) (mean + 2.0*sd);
    for (const auto & [b, e] : cand) {
        if (e.second && e.first > bar && e.first > 0.0f) {
            out.push_back({ e.first, b });
        }
    }
    std::stable_sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    return out;
}
