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
#include <memory>
#include <vector>

// the scheduler's backend whose device owns t's buffer (it can copy t asynchronously); nullptr: none does
ggml_backend_t kvmem_backend_of(ggml_backend_sched_t sched, const ggml_tensor * t);
// the pinned host memory type of be's device (nullptr: none, or no backend)
ggml_backend_buffer_type_t kvmem_pinned_type_of(ggml_backend_t be);

struct kvmem_room_free {
    void operator()(ggml_backend_buffer * b) const { ggml_backend_buffer_free(b); }
};

// host memory that device copies land in: pinned (a device's host buffer type) or, without one, plain (the
// captures' readback, the recurrent snapshots)
class kvmem_room {
public:
    uint8_t * data() { return pinned ? (uint8_t *) ggml_backend_buffer_get_base(pinned.get()) : plain.data(); }
    const uint8_t * data() const { return const_cast<kvmem_room *>(this)->data(); }
    bool is_pinned() const { return pinned != nullptr; }
    size_t size() const { return pinned ? ggml_backend_buffer_get_size(pinned.get()) : plain.size(); }
    // room for at least `bytes`: pinned memory of `host` when it is given, else plain memory
    void reserve(ggml_backend_buffer_type_t host, size_t bytes);

private:
    std::unique_ptr<ggml_backend_buffer, kvmem_room_free> pinned;
    std::vector<uint8_t> plain;
};

class kvmem_readback {
public:
    kvmem_readback() = default;
    kvmem_readback(const kvmem_readback &) = delete;
    kvmem_readback & operator=(const kvmem_readback &) = delete;

    // queue f32 tensor t (whole) for this round; returns its index in the round
    size_t add(ggml_tensor * t);
    // reads every tensor of the round, waits for the copies and ends the round (an empty round reads nothing)
    void fetch(ggml_backend_sched_t sched);
    // the values of the last fetched round's tensor i, valid until the graph runs again or the next fetch()
    const float * rows(size_t i) const;

private:
    std::vector<ggml_tensor *> queued;  // this round's
    std::vector<const uint8_t *> data;  // the last fetched round's
    kvmem_room scratch; // pinned memory of the first owner's device, grown as needed (plain without one)
};
