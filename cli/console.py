"""Shared console helpers for the CLI: one rich console, human sizes, error printing."""

from __future__ import annotations

import sys

from rich.console import Console

# Pipes and log files get 140 columns instead of rich's 80, so tables and paths stay readable.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 140)


def human_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def fail(message: str, hint: str | None = None, code: int = 1) -> None:
    # soft wrap: the terminal folds long lines, so paths and commands in the message stay one piece
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    if hint:
        err_console.print(f"[yellow]hint:[/] {hint}", soft_wrap=True)
    sys.exit(code)
