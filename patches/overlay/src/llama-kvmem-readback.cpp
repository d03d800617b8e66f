// KVMem: a ubatch's captured rows read back in one round (kvmem-llama). See llama-kvmem-readback.h.

#include "llama-kvmem-readback.h"

#include <algorithm>

ggml_backend_t kvmem_backend_of(ggml_backend_sched_t sched, const ggml_tensor * t) {
    ggml_backend_buffer_t buf = t->view_src ? t->view_src->buffer : t->buffer;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t be = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev = be ? ggml_backend_get_device(be) : nullptr;
        if (dev && ggml_backend_dev_buffer_type(dev) == ggml_backend_buffer_get_type(buf)) {
            return be;
        }
    }
    return nullptr;
}

ggml_backend_buffer_type_t kvmem_pinned_type_of(ggml_backend_t be) {
    ggml_backend_dev_t dev = be ? ggml_backend_get_device(be) : nullptr;
    return dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
}

void kvmem_room::reserve(ggml_backend_buffer_type_t host, size_t bytes) {
    if (!host) {
        pinned.reset(); // plain memory from now on
    } else if (!pinned || ggml_backend_buffer_get_type(pinned.get()) != host || size() < bytes) {
        pinned.reset(ggml_backend_buft_alloc_buffer(host, bytes));
    }
    if (!pinned && plain.size() < bytes) {
        plain.resize(bytes); // no pinned memory: the same copies, each waited for
    }
}

size_t kvmem_readback::add(ggml_tensor * t) {
    GGML_ASSERT(t && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->buffer);
    queued.push_back(t);
    return queued.size() - 1;
}

void kvmem_readback::fetch(ggml_backend_sched_t sched) {
    data.assign(queued.size(), nullptr);
    std::vector<size_t> offset(queued.size(), 0);
    std::vector<ggml_backend_t> owner(queued.size(), nullptr);
    size_t bytes = 0;
    for (size_t i = 0; i < queued.size(); ++i) {
        if (ggml_backend_buffer_is_host(queued[i]->buffer)) {
            data[i] = (const uint8_t *) queued[i]->data;
            continue;
        }
        offset[i] = bytes;
        bytes = GGML_PAD(bytes + ggml_nbytes(queued[i]), 64);
        owner[i] = kvmem_backend_of(sched, queued[i]);
    }
    if (bytes == 0) {
        queued.clear();
        return;
    }
    const auto first = std::find_if(owner.begin(), owner.end(), [](ggml_backend_t be) { return be != nullptr; });
    if (scratch.size() < bytes) {
        scratch.reserve(kvmem_pinned_type_of(first != owner.end() ? *first : nullptr), bytes + bytes/4);
    }
    uint8_t * base = scratch.data();
    std::vector<ggml_backend_t> backends;
    for (size_t i = 0; i < queued.size(); ++i) {
        if (data[i]) {
            continue;
        }
        if (owner[i]) {
            ggml_backend_tensor_get_async(owner[i], queued[i], base + offset[i], 0, ggml_nbytes(queued[i]));
            backends.push_back(owner[i]);
        } else {
            ggml_backend_tensor_get(queued[i], base + offset[i], 0, ggml_nbytes(queued[i])); // no owner found: waits
        }
        data[i] = base + offset[i];
    }
    std::sort(backends.begin(), backends.end());
    backends.erase(std::unique(backends.begin(), backends.end()), backends.end());
    for (ggml_backend_t be : backends) {
        ggml_backend_synchronize(be);
    }
    queued.clear(); // the tensors belong to this ubatch's graph: the next round adds its own
}

const float * kvmem_readback::rows(size_t i) const {
    GGML_ASSERT(i < data.size());
    return (const float *) data[i];
}
