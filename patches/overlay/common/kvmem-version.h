// kvmem-llama: version of our patch series, compiled into every engine binary.
// Kept in sync with kvmem_llama.__version__ (tests/test_patches.py checks it).
#pragma once

#define KVMEM_LLAMA_VERSION "0.1.0"
