#pragma once

// KVMem: the disk tier under the host pool (kvmem-llama).
//
// When the host pool is full, blocks of idle sequences move to disk and come back when their sequence runs again
// (llama-kvmem-spill.cpp decides which). Here: one file of fixed-size records in the directory asked for, removed
// from the directory as soon as it is open (a crash leaves nothing behind; the space is the process's until it
// ends). A record is a block's pool bytes and its summary. Records are taken lowest first, so the blocks of one
// sequence, written together, are read back in one sequential pass. Written records are flushed to the disk and
// dropped from the page cache, and so are records read back: a block is in host memory once, in the pool.

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

class kvmem_disk_tier {
public:
    kvmem_disk_tier() = default;
    kvmem_disk_tier(const kvmem_disk_tier &) = delete;
    kvmem_disk_tier & operator=(const kvmem_disk_tier &) = delete;
    ~kvmem_disk_tier();

    // records of record_bytes (rounded up to the page) in at most mib MiB under dir, the space taken at once where
    // the file system can (so that no write runs out of it later); throws with the reason when dir is not a writable
    // directory, holds less free space than mib, or mib holds no record
    void init(const std::string & dir, size_t mib, size_t record_bytes);
    bool enabled() const { return fd >= 0; }

    bool take(uint32_t & rec); // the lowest free record; false when the tier is full
    void give(uint32_t rec);

    // one record's parts, one after the other; false with the reason in err (e.g. "No space left on device").
    // A part read into nullptr is skipped (a block's summary read without its bytes)
    using part_out = std::pair<const void *, size_t>;
    using part_in  = std::pair<void *, size_t>;
    bool write(uint32_t rec, const std::vector<part_out> & parts, std::string & err);
    bool read(uint32_t rec, const std::vector<part_in> & parts, std::string & err) const;
    // the records written since the last call: on the disk, out of the page cache; false with the reason in err
    // when the disk did not take them
    bool settle(std::string & err);

    uint32_t capacity() const { return n_recs; }
    uint32_t n_free() const { return (uint32_t) free_recs.size(); }
    size_t record_bytes() const { return rec_bytes; }
    const std::string & path() const { return dir_path; }

private:
    int fd = -1;
    std::string dir_path;
    size_t rec_bytes = 0;
    uint32_t n_recs = 0;
    std::set<uint32_t> free_recs;
    std::vector<char> in_use;      // guards double frees
    std::set<uint32_t> unsettled;  // written, maybe still dirty in the page cache

    size_t offset(uint32_t rec) const { return (size_t) rec*rec_bytes; }
    void drop_pages(uint32_t rec) const;
};
