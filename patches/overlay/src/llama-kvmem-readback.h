#pragma once

// KVMem: reading a ubatch's captured rows back from the backends that computed them (kvmem-llama).
//
// Every device tensor's copy is queued at once into one pinned host scratch (the device's host buffer type) and
// each backend is waited for once, so the copies run back to back without a host round trip each (one
// synchronous copy per layer and tensor cost ~0.5 ms per decoded token on the H200). Tensors already in host
// memory (the CPU backend) are read where they are.

#include "ggml.h"
#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <vector>

// the scheduler's backend whose device owns t's buffer (it can copy t asynchronously); nullptr: none does
ggml_backend_t kvmem_backend_of(ggml_backend_sched_t sched, const ggml_tensor * t);

class kvmem_readback {
public:
    kvmem_readback() = default;
    kvmem_readback(const kvmem_readback &) = delete;
    kvmem_readback & operator=(const kvmem_readback &) = delete;
    ~kvmem_readback();

    // queue f32 tensor t (whole) for this round; returns its index in the round
    size_t add(ggml_tensor * t);
    // reads every tensor of the round, waits for the copies and ends the round (an empty round reads nothing)
    void fetch(ggml_backend_sched_t sched);
    // the values of the last fetched round's tensor i, valid until the graph runs again or the next fetch()
    const float * rows(size_t i) const;

private:
    std::vector<ggml_tensor *> queued;  // this round's
    std::vector<const uint8_t *> data;  // the last fetched round's
    ggml_backend_buffer_t pinned = nullptr; // a GPU's host buffer, grown as needed
    std::vector<uint8_t> plain;             // when that device has no host buffer type

    // room for `bytes`: pinned memory of be's device where it has a host buffer type (be may be nullptr)
    uint8_t * scratch(ggml_backend_t be, size_t bytes);
};
