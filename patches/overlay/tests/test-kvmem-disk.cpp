// The disk tier's file: records round-trip, are taken lowest first, leave no file behind, and a directory that
// cannot hold the tier is refused with the reason.

#include "test-kvmem.h"

#include "llama-kvmem-disk.h"

#include <cstdlib>
#include <dirent.h>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

static std::string kvtest_tmpdir() {
    char tmpl[] = "/tmp/kvmem-disk-test-XXXXXX";
    const char * dir = mkdtemp(tmpl);
    return dir ? dir : "";
}

static size_t kvtest_entries(const std::string & dir) {
    size_t n = 0;
    if (DIR * d = opendir(dir.c_str())) {
        while (const dirent * e = readdir(d)) {
            n += std::string(e->d_name) != "." && std::string(e->d_name) != "..";
        }
        closedir(d);
    }
    return n;
}

static std::string kvtest_refusal(const std::string & dir, size_t mib, size_t record) {
    kvmem_disk_tier disk;
    try {
        disk.init(dir, mib, record);
    } catch (const std::runtime_error & e) {
        return e.what();
    }
    return "";
}

KV_SUITE(disk) {
    const std::string dir = kvtest_tmpdir();
    KV_CHECK(!dir.empty());
    {
        kvmem_disk_tier disk;
        disk.init(dir, 1, 100000); // 1 MiB of records rounded up to 100 KiB: 10 of them
        KV_CHECK(disk.enabled() && disk.record_bytes() == 102400 && disk.capacity() == 10 && disk.n_free() == 10);
        KV_CHECK(kvtest_entries(dir) == 0); // the file is open, not in the directory

        std::vector<uint8_t> block(70000);
        std::vector<float> summary(5000);
        for (size_t i = 0; i < block.size(); ++i) {
            block[i] = (uint8_t) (i*7 + 3);
        }
        for (size_t i = 0; i < summary.size(); ++i) {
            summary[i] = 0.5f*(float) i - 17.0f;
        }
        uint32_t a = 99, b = 99;
        KV_CHECK(disk.take(a) && a == 0 && disk.take(b) && b == 1);
        std::string err;
        KV_CHECK(disk.write(b, { { block.data(), block.size() }, { summary.data(), summary.size()*sizeof(float) } }, err));
        KV_CHECK(disk.write(a, { { summary.data(), 40 } }, err));
        KV_CHECK(disk.settle(err));

        std::vector<uint8_t> block_back(block.size());
        std::vector<float> summary_back(summary.size());
        KV_CHECK(disk.read(b, { { block_back.data(), block_back.size() }, { summary_back.data(), summary_back.size()*sizeof(float) } }, err));
        KV_CHECK(block_back == block && summary_back == summary);
        std::vector<float> summary_only(summary.size());
        KV_CHECK(disk.read(b, { { nullptr, block.size() }, { summary_only.data(), summary_only.size()*sizeof(float) } }, err));
        KV_CHECK(summary_only == summary); // the block's bytes skipped
        std::vector<float> first(10);
        KV_CHECK(disk.read(a, { { first.data(), 40 } }, err) && first[9] == summary[9]);

        disk.give(a);
        KV_CHECK(disk.n_free() == 9 && disk.take(a) && a == 0); // the lowest free record again
        for (uint32_t r = 0; r < 8; ++r) {
            KV_CHECK(disk.take(a));
        }
        KV_CHECK(disk.n_free() == 0 && !disk.take(a));
    }
    KV_CHECK(kvtest_entries(dir) == 0); // nothing left behind

    const std::string not_dir = kvtest_refusal(dir + "/missing", 1, 4096);
    KV_CHECK(not_dir.find("not a directory") != std::string::npos);
    const std::string too_big = kvtest_refusal(dir, (size_t) 1 << 40, 4096); // a TiB of MiB
    KV_CHECK(too_big.find("MiB free") != std::string::npos && too_big.find("--kvmem-disk-mib") != std::string::npos);
    const std::string too_small = kvtest_refusal(dir, 1, 2 << 20);
    KV_CHECK(too_small.find("too small") != std::string::npos);
    rmdir(dir.c_str());
}
