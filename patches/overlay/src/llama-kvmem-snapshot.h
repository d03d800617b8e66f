#pragma once

// KVMem: recurrent state snapshots of hybrid models (kvmem-llama). A turn's query span is recomputed after its
// selection, starting from the recurrent state where the span starts, so every prompt batch of a tiered sequence
// snapshots that state (~150 MiB at the 27B shape: 48 delta-net layers). Its tensor bytes go by asynchronous copies
// on the stream that computes the model (ordered with its graphs: the host does not wait) into pinned host memory
// that is allocated once and reused ("rooms"); the few other bytes of the state stay in ordinary memory. A restore
// copies back the same way. Pinned host memory rather than VRAM: on a 16 GB card the VRAM belongs to the working set,
// and the PCIe copy of one snapshot (~3 ms on the H200) is stream time, not a host wait.
//
// The implementation is in llama-kvmem-hybrid.cpp.

#include "llama.h"
#include "llama-kvmem-readback.h"

#include "ggml-backend.h"

#include <cstdint>
#include <utility>
#include <vector>

class llama_memory_recurrent;

class kvmem_snapshot {
public:
    kvmem_snapshot(llama_pos pos, kvmem_room && room) : pos(pos), room(std::move(room)) {}
    // a session file's snapshot: the bytes exactly as the recurrent memory's state_write wrote them
    kvmem_snapshot(llama_pos pos, std::vector<uint8_t> && written);

    llama_pos position() const { return pos; }

    // the recurrent state of seq_id now (the copies are queued on the backends of `sched` that own the tensors)
    void take(ggml_backend_sched_t sched, const llama_memory_recurrent & recr, llama_seq_id seq_id);
    // puts it back into seq_id (queued likewise: the next graph on those backends sees it)
    void restore(ggml_backend_sched_t sched, llama_memory_recurrent & recr, llama_seq_id seq_id) const;
    // the bytes as state_write wrote them (session files); waits for the copies of take()
    std::vector<uint8_t> written() const;
    // its memory, for the next snapshot
    kvmem_room release_room() { return std::move(room); }

private:
    llama_pos pos;
    kvmem_room room;
    std::vector<uint8_t> meta;                        // the state's bytes other than tensor data, in write order
    std::vector<std::pair<size_t, size_t>> tensors;   // per tensor written: (where in `meta` it goes, bytes)
    bool whole = false;                               // `meta` holds the tensor bytes too (a session file's)
    mutable std::vector<ggml_backend_t> pending;      // backends whose copies into `room` may still run

    friend class kvmem_snapshot_writer;
    friend class kvmem_snapshot_reader;
};
