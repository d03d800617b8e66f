#pragma once

// KVMem: the host KV pool and the copies between it and the GPU working set (kvmem-llama).
//
// A host slot holds one block of every tiered layer: per layer its K rows, then its V rows, in the pool's type.
// The pool lives in the device's host buffer type (pinned memory on CUDA, so copies are DMA), plain memory on
// the CPU. Copies to and from a device run asynchronously on a backend (stream) of their own per device and are
// waited for once per batch of copies.

#include "ggml.h"
#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

// one tiered layer as the copies see it
struct kvmem_layer_rows {
    uint32_t il = 0;          // model layer
    ggml_tensor * k = nullptr;
    ggml_tensor * v = nullptr;
    size_t row_k = 0, row_v = 0;   // bytes per token row in the working set
    size_t hrow_k = 0, hrow_v = 0; // bytes per token row in the host pool (differ when only the pool is quantized)
    ggml_type pool_k = GGML_TYPE_F16, pool_v = GGML_TYPE_F16;
};

class kvmem_host_pool {
public:
    kvmem_host_pool() = default;
    kvmem_host_pool(const kvmem_host_pool &) = delete;
    kvmem_host_pool & operator=(const kvmem_host_pool &) = delete;
    ~kvmem_host_pool();

    // n_slots blocks of block_bytes in buft (throws with the size and the flag to lower)
    void init(ggml_backend_buffer_type_t buft, size_t block_bytes, uint32_t n_slots);

    bool     take(uint32_t & slot);  // false when full
    void     give(uint32_t slot);
    uint8_t * slot_ptr(uint32_t slot) const;

    uint32_t capacity() const { return n_slots; }
    uint32_t n_free() const { return (uint32_t) free_slots.size(); }
    uint32_t n_used() const { return n_slots - n_free(); }
    size_t   block_bytes() const { return slot_bytes; }
    double   mib(uint32_t n_blocks) const { return (double) n_blocks*slot_bytes/1024.0/1024.0; }
    const char * buffer_name() const;

private:
    ggml_backend_buffer_t buf = nullptr;
    uint8_t * base = nullptr;
    size_t slot_bytes = 0;
    uint32_t n_slots = 0;
    std::vector<uint32_t> free_slots;
    std::vector<char> in_use; // guards double frees
};

// copies of one block between a host slot and cells of the working set, converting between the pool's type and
// the working set's where they differ: staged on the working set's backend when all tiered layers are on one
// device, or on the CPU when only the types differ (llama-kvmem-stager.h); else per run of cells, converting on
// the host (layers split over devices and host memory)
class kvmem_stager;

// a CPU backend of our own with n_threads (nullptr without a CPU device); the caller frees it
ggml_backend_t kvmem_cpu_backend(int n_threads);

class kvmem_copier {
public:
    kvmem_copier(); // out of line, where kvmem_stager is complete
    kvmem_copier(const kvmem_copier &) = delete;
    kvmem_copier & operator=(const kvmem_copier &) = delete;
    ~kvmem_copier();

    void init(const std::vector<kvmem_layer_rows> & layers, uint32_t block);

    // host slot -> cells idx (idx[t] receives token t); asynchronous until wait()
    void to_device(const uint8_t * host, const std::vector<uint32_t> & idx);
    // cells idx -> host slot; done by wait() (the cells must not change before it)
    void to_host(uint8_t * host, const std::vector<uint32_t> & idx);
    void wait();

    // where the copies run: "staged on <backend>" or "per run of cells"
    std::string path() const;

    // the backend (stream) of the device that holds the first tiered layer, nullptr when it is host memory
    ggml_backend_t device_backend() const { return layer_be.empty() ? nullptr : layer_be[0]; }

private:
    std::vector<kvmem_layer_rows> layers;
    uint32_t block = 0;
    std::vector<ggml_backend_t> backends; // owned, one per device
    std::vector<ggml_backend_t> layer_be; // per tiered layer, nullptr = host memory
    bool pending = false;
    std::unique_ptr<kvmem_stager> stager;
    ggml_backend_t own_cpu = nullptr; // the stager's backend when the working set is in host memory

    // rows of the working set's type kept until the uploads that read them are done
    std::deque<std::vector<uint8_t>> conv_bufs;
    size_t conv_pending = 0;
    std::vector<float> conv_f32;

    bool converts(bool is_v) const;
    void init_stager();
    size_t conv_bytes() const;
    void convert_rows(ggml_type from, const void * src, ggml_type to, void * dst, size_t n_rows, int64_t n_per_row);
    void upload(uint32_t lt, ggml_tensor * t, const void * src, size_t offset, size_t size);
    void download(uint32_t lt, ggml_tensor * t, void * dst, size_t offset, size_t size);
    // one copy per run of consecutive cells, for one layer's K or V rows
    void copy_runs(uint32_t lt, ggml_tensor * t, uint8_t * rows, size_t row, const std::vector<uint32_t> & idx, bool to_dev);
};
