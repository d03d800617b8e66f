"""Our patch series for the pinned llama.cpp (data package: `series`, `*.patch`, `overlay/`)."""

from pathlib import Path

PATCHES_DIR = Path(__file__).resolve().parent
