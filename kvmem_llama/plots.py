"""matplotlib is an extra (`pip install 'kvmem-llama[plots]'`, ~80 MB with its stack) for the PNGs of
`kvmem bench report` and `kvmem eval report`: without it the tables are written and the pictures are
skipped with one line saying how to get them."""

from __future__ import annotations

from types import ModuleType

PLOTS_EXTRA = "pip install 'kvmem-llama[plots]'"


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def available() -> bool:
    return pyplot() is not None


def skipped(what: str) -> str:
    """The one-line hint where a picture is skipped."""
    return f"{what} skipped: matplotlib is not installed ({PLOTS_EXTRA})"
