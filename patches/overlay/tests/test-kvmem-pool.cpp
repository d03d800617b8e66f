// The host pool's slots.

#include "test-kvmem.h"

#include "llama-kvmem-pool.h"

#include <cstring>
#include <set>

KV_SUITE(pool) {
    kvmem_host_pool pool;
    pool.init(ggml_backend_cpu_buffer_type(), 256, 3);
    KV_CHECK(pool.capacity() == 3 && pool.n_free() == 3 && pool.block_bytes() == 256);

    std::set<uint32_t> taken;
    uint32_t slot = 0;
    for (int i = 0; i < 3; ++i) {
        KV_CHECK(pool.take(slot));
        taken.insert(slot);
        std::memset(pool.slot_ptr(slot), i + 1, pool.block_bytes()); // each slot is its own memory
    }
    KV_CHECK(taken.size() == 3 && *taken.begin() == 0 && *taken.rbegin() == 2);
    KV_CHECK(!pool.take(slot) && pool.n_used() == 3);
    KV_CHECK(pool.slot_ptr(0)[255] == 1 && pool.slot_ptr(2)[0] == 3);

    pool.give(1);
    KV_CHECK(pool.n_free() == 1 && pool.take(slot) && slot == 1);
    KV_CHECK(pool.mib(4096) == 1.0);
}
