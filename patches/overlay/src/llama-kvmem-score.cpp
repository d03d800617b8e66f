// KVMem block summaries and scoring (kvmem-llama). See llama-kvmem-score.h.

#include "llama-kvmem-score.h"

#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>

// the method `--kvmem-method retrieval` (the default) stands for; chosen by measurement (docs/eval)
static constexpr int32_t KVMEM_DEFAULT_METHOD = LLAMA_KVMEM_METHOD_HYBRID;

// bound methods rank a block by the mean of its few best (layer, KV head) z-scores
static constexpr size_t KVMEM_TOP_HEADS = 4;
// votes: each (layer, KV head) votes for this many blocks
static constexpr size_t KVMEM_VOTES_PER_HEAD = 8;

static const char * const KVMEM_METHOD_NAMES[LLAMA_KVMEM_METHOD_COUNT] = {
    "retrieval", "recency", "quest", "meankey", "subpage", "votes", "mass", "hybrid",
};

const char * kvmem_scorer::method_name(int32_t method) {
    return method >= 0 && method < LLAMA_KVMEM_METHOD_COUNT ? KVMEM_METHOD_NAMES[method] : "unknown";
}

int32_t kvmem_scorer::method_from_name(const std::string & name) {
    for (int32_t m = 0; m < LLAMA_KVMEM_METHOD_COUNT; ++m) {
        if (name == KVMEM_METHOD_NAMES[m]) {
            return m;
        }
    }
    return -1;
}

int32_t kvmem_scorer::resolve(int32_t method) {
    return method == LLAMA_KVMEM_METHOD_RETRIEVAL ? KVMEM_DEFAULT_METHOD : method;
}

kvmem_scorer::kvmem_scorer(const kvmem_dims & dims, int32_t method, uint32_t threads) :
        d(dims), named(resolve(method)), meth(named == LLAMA_KVMEM_METHOD_HYBRID ? LLAMA_KVMEM_METHOD_MASS : named),
        n_threads(std::max<uint32_t>(1, threads)) {
    GGML_ASSERT(d.n_head_kv > 0 && d.n_head % d.n_head_kv == 0 && d.block > 0);
    sub = std::min<uint32_t>(meth == LLAMA_KVMEM_METHOD_MASS ? 8 : 16, d.block);
    while (d.block % sub != 0) {
        sub /= 2;
    }
}

size_t kvmem_scorer::summary_size() const {
    const size_t per = (size_t) d.n_lt*d.n_head_kv*d.head_dim;
    switch (meth) {
        case LLAMA_KVMEM_METHOD_QUEST:   return 2*per;                   // [lt][kv][max | min][hd]
        case LLAMA_KVMEM_METHOD_MEANKEY: return per;                     // [lt][kv][hd]
        case LLAMA_KVMEM_METHOD_SUBPAGE:
        case LLAMA_KVMEM_METHOD_VOTES:   return 2*per*(d.block/sub);     // [lt][kv][sub-page][max | min][hd]
        case LLAMA_KVMEM_METHOD_MASS:    return per*(d.block/sub);       // [lt][kv][chunk][hd]
        default:                         return 0;
    }
}

void kvmem_scorer::summarize(const float * keys, float * out) const {
    std::vector<const float *> rows((size_t) d.block*d.n_lt);
    for (size_t i = 0; i < rows.size(); ++i) {
        rows[i] = keys + i*d.n_head_kv*d.head_dim; // token t's layer lt at t*n_lt + lt
    }
    summarize(rows, out);
}

void kvmem_scorer::summarize(const std::vector<const float *> & rows, float * out, const float * old, uint32_t n_same) const {
    GGML_ASSERT(!rows.empty() && rows.size() % d.n_lt == 0 && (!old || rows.size() == (size_t) d.block*d.n_lt));
    const uint32_t n_tok = (uint32_t) (rows.size()/d.n_lt);
    const uint32_t hd = d.head_dim;
    const uint32_t n_pages = (meth == LLAMA_KVMEM_METHOD_QUEST || meth == LLAMA_KVMEM_METHOD_MEANKEY) ? 1 : d.block/sub;
    const uint32_t page = d.block/n_pages;
    const bool bounds = meth == LLAMA_KVMEM_METHOD_QUEST || meth == LLAMA_KVMEM_METHOD_SUBPAGE || meth == LLAMA_KVMEM_METHOD_VOTES;
    const size_t per_page = bounds ? 2*(size_t) hd : hd;
    std::fill(out, out + summary_size(), 0.0f);
    for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
        for (uint32_t hk = 0; hk < d.n_head_kv; ++hk) {
            const size_t o_lh = ((size_t) lt*d.n_head_kv + hk)*n_pages*per_page;
            for (uint32_t p = 0; p < n_pages; ++p) {
                float * op = out + o_lh + (size_t) p*per_page;
                if (old && (p + 1)*page <= n_same) {
                    std::copy(old + o_lh + (size_t) p*per_page, old + o_lh + (size_t) (p + 1)*per_page, op);
                    continue; // unchanged tokens: the old summary of this page holds
                }
                if (bounds) {
                    std::fill(op, op + hd, -INFINITY);
                    std::fill(op + hd, op + 2*hd, INFINITY);
                }
                uint32_t n = 0;
                // page p: the tokens t with t*n_pages/n_tok == p (a block's own pages when n_tok is B)
                const uint32_t t0 = (p*n_tok + n_pages - 1)/n_pages, t1 = ((p + 1)*n_tok + n_pages - 1)/n_pages;
                for (uint32_t t = t0; t < t1; ++t) {
                    const float * row = rows[(size_t) t*d.n_lt + lt];
                    if (!row) {
                        continue; // cut off by a truncation: the page is summarized from the tokens that are known
                    }
                    n++;
                    const float * k = row + (size_t) hk*hd;
                    for (uint32_t i = 0; i < hd; ++i) {
                        if (bounds) {
                            op[i]      = std::max(op[i], k[i]);
                            op[hd + i] = std::min(op[hd + i], k[i]);
                        } else {
                            op[i] += k[i];
                        }
                    }
                }
                if (n == 0) {
                    if (old) {
                        std::copy(old + o_lh + (size_t) p*per_page, old + o_lh + (size_t) (p + 1)*per_page, op);
                    } else if (bounds) {
                        std::fill(op, op + 2*hd, 0.0f);
                    }
                } else if (!bounds) {
                    for (uint32_t i = 0; i < hd; ++i) {
                        op[i] /= n;
                    }
                }
            }
        }
    }
}

// dot(q, k) of n floats, eight partial sums (vectorizes; built for AVX2+FMA too on x86-64, picked at run time)
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
static float kvmem_dot(const float * q, const float * k, size_t n) {
    float acc[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; ++j) {
            acc[j] += q[i + j]*k[i + j];
        }
    }
    float sum = 0.0f;
    for (; i < n; ++i) {
        sum += q[i]*k[i];
    }
    for (int j = 0; j < 8; ++j) {
        sum += acc[j];
    }
    return sum;
}

// max over n_rows query rows (contiguous, n floats each) of dot(q_r, kb)
static float kvmem_dot_max(const float * q0, size_t n_rows, const float * kb, size_t n) {
    float best = -INFINITY;
    for (size_t r = 0; r < n_rows; ++r) {
        best = std::max(best, kvmem_dot(q0 + r*n, kb, n));
    }
    return best;
}

// out[r*n_k + c] = dot(q_r, k_c) for n_rows query rows and n_k key rows of n floats
static void kvmem_dots(const float * q0, size_t n_rows, const float * k0, size_t n_k, size_t n, float * out) {
    for (size_t c = 0; c < n_k; ++c) {
        for (size_t r = 0; r < n_rows; ++r) {
            out[r*n_k + c] = kvmem_dot(q0 + r*n, k0 + c*n, n);
        }
    }
}

// run fn(p) for p in [0, n) on up to max_threads threads (the context's; enough work per thread, else inline)
static void kvmem_parallel(size_t n, double work, size_t max_threads, const std::function<void(size_t)> & fn) {
    const size_t n_threads = std::max<size_t>(1, std::min<size_t>({ max_threads, (size_t) (work/16e6) + 1, n }));
    auto worker = [&](size_t t) {
        for (size_t p = t; p < n; p += n_threads) {
            fn(p);
        }
    };
    if (n_threads <= 1) {
        worker(0);
        return;
    }
    std::vector<std::thread> pool;
    for (size_t t = 1; t < n_threads; ++t) {
        pool.emplace_back(worker, t);
    }
    worker(0);
    for (auto & th : pool) {
        th.join();
    }
}

void kvmem_scorer::score(const std::vector<const float *> & sums, const std::vector<char> & cand,
        const float * q, size_t n_rows, std::vector<float> & out) const {
    out.assign(sums.size(), -INFINITY);
    if (n_rows == 0 || sums.empty()) {
        return;
    }
    switch (meth) {
        case LLAMA_KVMEM_METHOD_QUEST:
        case LLAMA_KVMEM_METHOD_SUBPAGE:
        case LLAMA_KVMEM_METHOD_VOTES:   score_bounds(sums, cand, q, n_rows, out); break;
        case LLAMA_KVMEM_METHOD_MEANKEY: score_meankey(sums, q, n_rows, out); break;
        case LLAMA_KVMEM_METHOD_MASS:    score_mass(sums, q, n_rows, out); break;
        default: break;
    }
}

void kvmem_scorer::score_bounds(const std::vector<const float *> & sums, const std::vector<char> & cand,
        const float * q, size_t n_rows, std::vector<float> & out) const {
    // Quest-style upper bound: per (sub-)page, layer and KV head the element-wise min and max of the keys
    // bound q.k for any key of the page by sum_i max(q_i*kmin_i, q_i*kmax_i) = [q+ | q-] . [kmax | kmin].
    // Each query row and query head of the GQA group is scored on its own (unit-normalized) and the max
    // is kept; a block scores its best page. Heads differ in scale, so scores are z-normalized per
    // (layer, KV head) across the candidates; quest/subpage rank by the mean of a block's top few heads,
    // votes by how many (layer, KV head) pairs have the block among their top blocks.
    const uint32_t hd = d.head_dim;
    const size_t hd2 = 2*(size_t) hd;
    const uint32_t group = d.n_head/d.n_head_kv;
    const uint32_t n_pages = meth == LLAMA_KVMEM_METHOD_QUEST ? 1 : d.block/sub;
    const size_t n_lh = (size_t) d.n_lt*d.n_head_kv;
    const size_t per_q = (size_t) d.n_head*hd;

    std::vector<size_t> ids;
    for (size_t i = 0; i < sums.size(); ++i) {
        if (cand[i] && sums[i]) {
            ids.push_back(i);
        }
    }
    const size_t nc = ids.size();
    if (nc == 0) {
        return;
    }
    std::vector<float> cs(nc*n_lh); // [cand][n_lh]
    auto score_pair = [&](size_t p) {
        const uint32_t lt = p/d.n_head_kv, hk = p % d.n_head_kv;
        const size_t n_q = n_rows*group;
        std::vector<float> qs(n_q*hd2);
        for (size_t r = 0; r < n_rows; ++r) {
            for (uint32_t g = 0; g < group; ++g) {
                const float * src = q + r*d.n_lt*per_q + lt*per_q + ((size_t) hk*group + g)*hd;
                double n2 = 0.0;
                for (uint32_t i = 0; i < hd; ++i) {
                    n2 += (double) src[i]*src[i];
                }
                const float inv = n2 > 0.0 ? (float) (1.0/std::sqrt(n2)) : 0.0f;
                float * o = qs.data() + (r*group + g)*hd2;
                for (uint32_t i = 0; i < hd; ++i) {
                    o[i]      = std::max(src[i]*inv, 0.0f);
                    o[hd + i] = std::min(src[i]*inv, 0.0f);
                }
            }
        }
        for (size_t c = 0; c < nc; ++c) {
            const float * kb = sums[ids[c]] + p*n_pages*hd2;
            float best = -INFINITY;
            for (uint32_t pg = 0; pg < n_pages; ++pg) {
                best = std::max(best, kvmem_dot_max(qs.data(), n_q, kb + pg*hd2, hd2));
            }
            cs[c*n_lh + p] = best;
        }
    };
    kvmem_parallel(n_lh, (double) nc*n_lh*n_rows*group*hd2*n_pages, n_threads, score_pair);

    std::vector<float> zs(nc*n_lh, 0.0f);
    for (size_t j = 0; j < n_lh && nc > 1; ++j) {
        double m = 0.0, v = 0.0;
        for (size_t c = 0; c < nc; ++c) {
            m += cs[c*n_lh + j];
        }
        m /= nc;
        for (size_t c = 0; c < nc; ++c) {
            const double x = cs[c*n_lh + j] - m;
            v += x*x;
        }
        const double sd = std::sqrt(v/nc) + 1e-6;
        for (size_t c = 0; c < nc; ++c) {
            zs[c*n_lh + j] = (float) ((cs[c*n_lh + j] - m)/sd);
        }
    }
    if (meth == LLAMA_KVMEM_METHOD_VOTES) {
        // each (layer, KV head) votes for its top blocks; ties broken by the mean z-score
        const size_t k = std::min(KVMEM_VOTES_PER_HEAD, nc);
        std::vector<float> votes(nc, 0.0f), mean_z(nc, 0.0f);
        std::vector<size_t> order(nc);
        for (size_t j = 0; j < n_lh; ++j) {
            for (size_t c = 0; c < nc; ++c) {
                order[c] = c;
                mean_z[c] += zs[c*n_lh + j]/n_lh;
            }
            std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](size_t a, size_t b) { return zs[a*n_lh + j] > zs[b*n_lh + j]; });
            for (size_t i = 0; i < k; ++i) {
                votes[order[i]] += 1.0f;
            }
        }
        for (size_t c = 0; c < nc; ++c) {
            out[ids[c]] = votes[c] + 0.01f*std::tanh(mean_z[c]);
        }
        return;
    }
    const size_t top = std::max<size_t>(1, std::min<size_t>(KVMEM_TOP_HEADS, n_lh));
    for (size_t c = 0; c < nc; ++c) {
        float * zc = zs.data() + c*n_lh;
        std::partial_sort(zc, zc + top, zc + n_lh, std::greater<float>());
        double sc = 0.0;
        for (size_t j = 0; j < top; ++j) {
            sc += zc[j];
        }
        out[ids[c]] = (float) (sc/(double) top);
    }
}

void kvmem_scorer::score_meankey(const std::vector<const float *> & sums, const float * q, size_t n_rows, std::vector<float> & out) const {
    // KVMem: per (layer, KV head) the cosine of the block's mean key and the query averaged over its rows
    // and the heads of the GQA group; the block's score is the mean over layers and KV heads
    const uint32_t hd = d.head_dim;
    const uint32_t group = d.n_head/d.n_head_kv;
    const size_t per_q = (size_t) d.n_head*hd;
    const size_t n_lh = (size_t) d.n_lt*d.n_head_kv;
    std::vector<float> qm(n_lh*hd, 0.0f);
    for (size_t r = 0; r < n_rows; ++r) {
        for (uint32_t lt = 0; lt < d.n_lt; ++lt) {
            for (uint32_t h = 0; h < d.n_head; ++h) {
                const float * src = q + r*d.n_lt*per_q + lt*per_q + (size_t) h*hd;
                float * dst = qm.data() + ((size_t) lt*d.n_head_kv + h/group)*hd;
                for (uint32_t i = 0; i < hd; ++i) {
                    dst[i] += src[i];
                }
            }
        }
    }
    std::vector<float> qn(n_lh);
    for (size_t p = 0; p < n_lh; ++p) {
        double n2 = 0.0;
        for (uint32_t i = 0; i < hd; ++i) {
            n2 += (double) qm[p*hd + i]*qm[p*hd + i];
        }
        qn[p] = (float) std::sqrt(n2);
    }
    for (size_t b = 0; b < sums.size(); ++b) {
        if (!sums[b]) {
            continue;
        }
        double total = 0.0;
        for (size_t p = 0; p < n_lh; ++p) {
            const float * k = sums[b] + p*hd;
            double dot = 0.0, n2 = 0.0;
            for (uint32_t i = 0; i < hd; ++i) {
                dot += (double) k[i]*qm[p*hd + i];
                n2  += (double) k[i]*k[i];
            }
            const double den = std::sqrt(n2)*qn[p];
            total += den > 0.0 ? dot/den : 0.0;
        }
        out[b] = (float) (total/n_lh);
    }
}

void kvmem_scorer::score_mass(const std::vector<const float *> & sums, const float * q, size_t n_rows, std::vector<float> & out) const {
    // each query row and query head spends one unit of attention over the blocks: a block's logit is its best
    // chunk's (a chunk mean stands for its `sub` keys), its share the softmax of those logits over the scored
    // blocks. The block's score sums the squares of its shares, so that the few confident heads that find a fact
    // outweigh the many diffuse ones. (Taking the best chunk before the softmax, rather than the best chunk
    // probability of a softmax over every chunk, ranks the blocks of one row alike and moves half as many bytes
    // on the device: the graph scorer computes the same.)
    const uint32_t hd = d.head_dim;
    const uint32_t group = d.n_head/d.n_head_kv;
    const uint32_t n_ch = d.block/sub;
    const size_t per_q = (size_t) d.n_head*hd;
    const size_t n_pairs = (size_t) d.n_lt*d.n_head;
    const float scale = 1.0f/std::sqrt((float) hd);

    std::vector<size_t> ids;
    for (size_t i = 0; i < sums.size(); ++i) {
        if (sums[i]) {
            ids.push_back(i);
        }
    }
    const size_t nb = ids.size();
    const size_t n_k = nb*n_ch;
    if (nb == 0) {
        return;
    }
    std::vector<std::vector<double>> acc_by_pair(n_pairs);
    auto run_pair = [&](size_t p) {
        const uint32_t lt = p/d.n_head, h = p % d.n_head;
        const uint32_t hk = h/group;
        // gather this (layer, KV head)'s chunk means: [n_k][hd]
        std::vector<float> keys(n_k*hd);
        for (size_t c = 0; c < nb; ++c) {
            const float * src = sums[ids[c]] + ((size_t) lt*d.n_head_kv + hk)*n_ch*hd;
            std::memcpy(keys.data() + c*n_ch*hd, src, (size_t) n_ch*hd*sizeof(float));
        }
        std::vector<float> qs(n_rows*hd);
        for (size_t r = 0; r < n_rows; ++r) {
            std::memcpy(qs.data() + r*hd, q + r*d.n_lt*per_q + lt*per_q + (size_t) h*hd, hd*sizeof(float));
        }
        std::vector<float> logits(n_rows*n_k);
        kvmem_dots(qs.data(), n_rows, keys.data(), n_k, hd, logits.data());
        auto & acc = acc_by_pair[p];
        acc.assign(nb, 0.0);
        std::vector<float> best(nb); // one row's block logits
        for (size_t r = 0; r < n_rows; ++r) {
            const float * l = logits.data() + r*n_k;
            for (size_t c = 0; c < nb; ++c) {
                best[c] = *std::max_element(l + c*n_ch, l + (c + 1)*n_ch)*scale;
            }
            const float mx = *std::max_element(best.begin(), best.end());
            double den = 0.0;
            for (size_t c = 0; c < nb; ++c) {
                den += std::exp((double) best[c] - mx);
            }
            for (size_t c = 0; c < nb; ++c) {
                const double share = std::exp((double) best[c] - mx)/den;
                acc[c] += share*share;
            }
        }
    };
    kvmem_parallel(n_pairs, (double) n_pairs*n_rows*n_k*hd, n_threads, run_pair);
    for (size_t c = 0; c < nb; ++c) {
        double s = 0.0;
        for (size_t p = 0; p < n_pairs; ++p) {
            s += acc_by_pair[p][c];
        }
        out[ids[c]] = (float) s;
    }
}
