"""kvmem-llama: a patched llama.cpp with KV tiering, its Python binding and the `kvmem` CLI."""

from setuptools import find_packages, setup

PLOTS = ["matplotlib>=3.7"]

setup(
    name="kvmem-llama",
    version="0.1.0",
    description="Run long-context GGUF models on consumer GPUs: llama.cpp with a tiered (GPU + host RAM) KV cache",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # cli/, vendor/ and patches/ live at the top level of the repo but ship inside
    # the kvmem_llama namespace, so site-packages gets no top-level `cli` package.
    packages=[
        "kvmem_llama",
        *(f"kvmem_llama.{sub}" for sub in find_packages("kvmem_llama")),
        "kvmem_llama.cli",
        "kvmem_llama.vendor",
        "kvmem_llama.patches",
    ],
    package_dir={
        "kvmem_llama": "kvmem_llama",
        "kvmem_llama.cli": "cli",
        "kvmem_llama.vendor": "vendor",
        "kvmem_llama.patches": "patches",
    },
    package_data={
        "kvmem_llama": ["data/*"],
        "kvmem_llama.evaluation": ["data/*"],
        "kvmem_llama.vendor": ["pin.json"],
        "kvmem_llama.patches": ["series", "*.patch", "overlay/**/*"],
    },
    install_requires=[
        "cffi>=1.15",
        "click>=8.1",
        "httpx>=0.25",
        "rich>=13",
        "platformdirs>=3",
        "psutil>=5.9",
        "gguf>=0.10",
        "numpy>=1.24",
    ],
    extras_require={
        # NVML (pynvml) for GPU detection: without it kvmem sees no GPU and says why (`kvmem doctor`)
        "gpu": ["nvidia-ml-py>=12"],
        # the PNGs of `kvmem bench report` / `kvmem eval report` (skipped with a hint without it)
        "plots": PLOTS,
        # pexpect drives `kvmem chat` through a pseudo-terminal, selenium the web UI in Chromium;
        # the report tests draw the PNGs too
        "test": ["pytest>=7", "openai>=1.30", "ruff>=0.5", "pexpect>=4.8", "selenium>=4.10", *PLOTS],
    },
    entry_points={"console_scripts": ["kvmem=kvmem_llama.cli.main:main"]},
)
