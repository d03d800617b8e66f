#pragma once

// KVMem: state files written whole or not at all (kvmem-llama). See llama-kvmem-state.cpp.

#include <cstddef>
#include <functional>

struct llama_file;

// `write` fills a temporary file beside `path` (PATH.XXXXXXXX.tmp), renamed over `path` once it is complete and on
// the disk: a save that fails part way (a full disk, a state the engine refuses) leaves the old file as it was and
// no temporary file; a killed one leaves the old file and its temporary file. Returns what `write` returns; throws
// with the reason.
size_t llama_kvmem_write_file(const char * path, const std::function<size_t(llama_file &)> & write);
