"""The `kvmem` command line (shipped as kvmem_llama.cli): parsing and printing only."""
