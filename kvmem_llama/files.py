"""File helpers every store uses: the one sha256 of a file, and installs that are all or nothing.

An install either leaves the complete new thing in place or nothing changed: content is written
into a staging path beside its destination (same filesystem) and renamed over it at the end.
(vendor/fetch.py, the pin's own fetch code, keeps a self-contained copy of the hash.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol


class ByteProgress(Protocol):
    def advance(self, n: int) -> None: ...


def sha256_file(path: Path | str, progress: ByteProgress | None = None, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file; `progress.advance(n)` is told how much was read."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            digest.update(view[:n])
            if progress:
                progress.advance(n)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def atomic_directory(final: Path, prefix: str = ".staging-") -> Iterator[Path]:
    """An empty staging directory beside `final` to fill; when the block ends without an error it
    takes `final`'s place (an older `final` is deleted first). On an error `final` is left as it was
    and the staging directory is deleted."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=prefix))
    try:
        yield staging
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
