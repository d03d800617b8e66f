// KVMem: the disk tier under the host pool (kvmem-llama). See llama-kvmem-disk.h.

#include "llama-kvmem-disk.h"

#include "llama-impl.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

static constexpr size_t KVMEM_DISK_PAGE = 4096;

kvmem_disk_tier::~kvmem_disk_tier() {
    if (fd >= 0) {
        close(fd);
    }
}

void kvmem_disk_tier::init(const std::string & dir, size_t mib, size_t record_bytes) {
    GGML_ASSERT(fd < 0 && record_bytes > 0);
    struct stat st;
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        throw std::runtime_error(format("--kvmem-disk-path %s: not a directory", dir.c_str()));
    }
    rec_bytes = GGML_PAD(record_bytes, KVMEM_DISK_PAGE);
    const size_t want = mib*1024*1024;
    n_recs = (uint32_t) std::min<size_t>(want/rec_bytes, UINT32_MAX);
    if (n_recs == 0) {
        throw std::runtime_error(format("--kvmem-disk-mib %zu is too small: one block needs %.2f MiB on disk", mib,
                    rec_bytes/1024.0/1024.0));
    }
    struct statvfs vfs;
    if (statvfs(dir.c_str(), &vfs) != 0) {
        throw std::runtime_error(format("--kvmem-disk-path %s: %s", dir.c_str(), std::strerror(errno)));
    }
    const size_t avail = (size_t) vfs.f_bavail*vfs.f_frsize;
    if (avail < want) {
        throw std::runtime_error(format("--kvmem-disk-path %s has %zu MiB free; --kvmem-disk-mib asks for %zu (lower it, "
                    "or free space there)", dir.c_str(), avail/1024/1024, mib));
    }
    std::string tmpl = dir + "/kvmem-disk-XXXXXX";
    std::vector<char> name(tmpl.begin(), tmpl.end());
    name.push_back('\0');
    fd = mkostemp(name.data(), O_CLOEXEC);
    if (fd < 0) {
        throw std::runtime_error(format("--kvmem-disk-path %s: cannot create a file there: %s", dir.c_str(),
                    std::strerror(errno)));
    }
    unlink(name.data()); // the space is ours until the process ends, and nothing is left behind after a crash
    const int taken = posix_fallocate(fd, 0, (off_t) n_recs*rec_bytes);
    if (taken != 0 && taken != EOPNOTSUPP && taken != EINVAL) {
        close(fd);
        fd = -1;
        throw std::runtime_error(format("--kvmem-disk-path %s: cannot take %zu MiB there: %s", dir.c_str(), mib,
                    std::strerror(taken)));
    }
    dir_path = dir;
    in_use.assign(n_recs, 0);
    for (uint32_t r = 0; r < n_recs; ++r) {
        free_recs.insert(free_recs.end(), r);
    }
}

bool kvmem_disk_tier::take(uint32_t & rec) {
    if (free_recs.empty()) {
        return false;
    }
    rec = *free_recs.begin();
    free_recs.erase(free_recs.begin());
    in_use[rec] = 1;
    return true;
}

void kvmem_disk_tier::give(uint32_t rec) {
    GGML_ASSERT(rec < n_recs && in_use[rec] && "a disk record is given back once");
    in_use[rec] = 0;
    unsettled.erase(rec);
    free_recs.insert(rec);
}

bool kvmem_disk_tier::write(uint32_t rec, const std::vector<part_out> & parts, std::string & err) {
    GGML_ASSERT(rec < n_recs && in_use[rec]);
    std::vector<iovec> iov;
    size_t total = 0;
    for (const auto & [data, size] : parts) {
        iov.push_back({ const_cast<void *>(data), size });
        total += size;
    }
    GGML_ASSERT(total <= rec_bytes);
    size_t done = 0;
    while (done < total) {
        // after a short write, the rest of the parts from where it stopped
        size_t skip = done;
        std::vector<iovec> rest;
        for (const iovec & v : iov) {
            if (skip >= v.iov_len) {
                skip -= v.iov_len;
                continue;
            }
            rest.push_back({ (char *) v.iov_base + skip, v.iov_len - skip });
            skip = 0;
        }
        const ssize_t n = pwritev(fd, rest.data(), (int) rest.size(), (off_t) (offset(rec) + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            err = n < 0 ? std::strerror(errno) : "nothing was written";
            return false;
        }
        done += (size_t) n;
    }
    unsettled.insert(rec);
    return true;
}

bool kvmem_disk_tier::read(uint32_t rec, const std::vector<part_in> & parts, std::string & err) const {
    GGML_ASSERT(rec < n_recs && in_use[rec]);
    size_t at = offset(rec);
    for (const auto & [data, size] : parts) {
        size_t done = data ? 0 : size;
        while (done < size) {
            const ssize_t n = pread(fd, (char *) data + done, size - done, (off_t) (at + done));
            if (n < 0 && errno == EINTR) {
                continue;
            }
            if (n <= 0) {
                err = n < 0 ? std::strerror(errno) : "the disk tier's file is shorter than its records";
                return false;
            }
            done += (size_t) n;
        }
        at += size;
    }
    drop_pages(rec);
    return true;
}

bool kvmem_disk_tier::settle(std::string & err) {
    if (unsettled.empty()) {
        return true;
    }
    // written back first: the page cache drops only clean pages
    const bool ok = fdatasync(fd) == 0;
    if (!ok) {
        err = std::strerror(errno);
    }
    for (const uint32_t rec : unsettled) {
        drop_pages(rec);
    }
    unsettled.clear();
    return ok;
}

void kvmem_disk_tier::drop_pages(uint32_t rec) const {
    posix_fadvise(fd, (off_t) offset(rec), (off_t) rec_bytes, POSIX_FADV_DONTNEED);
}
