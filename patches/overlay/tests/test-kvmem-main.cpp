// kvmem unit tests: `test-kvmem` runs every suite, `test-kvmem NAME...` the named ones.

#include "test-kvmem.h"

int main(int argc, char ** argv) {
    int ran = 0;
    for (const auto & [name, fn] : kvtest::suites()) {
        bool wanted = argc < 2;
        for (int i = 1; i < argc; ++i) {
            wanted = wanted || name == argv[i];
        }
        if (wanted) {
            const int before = kvtest::failures();
            fn();
            std::printf("%s %s\n", kvtest::failures() == before ? "ok  " : "FAIL", name.c_str());
            ran++;
        }
    }
    if (ran == 0 || ran < argc - 1) {
        std::fprintf(stderr, "unknown suite among the arguments\n");
        return 2;
    }
    return kvtest::failures() == 0 ? 0 : 1;
}
