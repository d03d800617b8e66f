"""kvmem-llama: llama.cpp with a tiered KV cache (GPU working set + host RAM pool)."""

__version__ = "0.1.0"
