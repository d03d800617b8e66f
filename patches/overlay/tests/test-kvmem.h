#pragma once

// A small test harness for the kvmem unit tests: KV_CHECK records a failure and goes on; each suite is a function
// registered by KV_SUITE and run by name (ctest runs one suite per test).

#include <cstdio>
#include <functional>
#include <map>
#include <string>

namespace kvtest {

inline int & failures() { static int n = 0; return n; }

inline std::map<std::string, std::function<void()>> & suites() {
    static std::map<std::string, std::function<void()>> s;
    return s;
}

struct registrar {
    registrar(const char * name, std::function<void()> fn) { suites()[name] = std::move(fn); }
};

} // namespace kvtest

#define KV_CHECK(cond) do { \
        if (!(cond)) { \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            kvtest::failures()++; \
        } \
    } while (0)

#define KV_SUITE(name) \
    static void kvsuite_##name(); \
    static kvtest::registrar kvreg_##name(#name, kvsuite_##name); \
    static void kvsuite_##name()
