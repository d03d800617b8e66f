"""Fetch the pinned sdist with pip, verify size + sha256, extract only the llama.cpp tree."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.vendor import Pin

VERIFIED_MARKER = ".kvmem-upstream.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_sdist(path: Path, pin: Pin) -> None:
    """Raise VerificationError unless `path` is byte for byte the pinned archive."""
    size = path.stat().st_size
    if size != pin.size:
        raise VerificationError(
            f"{path} is {size:,} bytes, the pin says {pin.size:,}: refusing to build from it",
            hint=f"delete it and run `kvmem vendor fetch` to download {pin.requirement} again",
        )
    got = sha256_file(path)
    if got != pin.sha256:
        raise VerificationError(
            f"{path} has sha256 {got}, the pin says {pin.sha256}: refusing to build from it",
            hint=f"delete it and run `kvmem vendor fetch` to download {pin.requirement} again",
        )


def sdist_path(cache: Path, pin: Pin) -> Path:
    return cache / "sdist" / pin.filename


def download_sdist(cache: Path, pin: Pin, log: Callable[[str], None] = print) -> Path:
    """Download the pinned sdist with pip into the cache (no build, no deps) and verify it."""
    target = sdist_path(cache, pin)
    if target.exists():
        verify_sdist(target, pin)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        log(f"downloading {pin.requirement} (the pinned llama.cpp, {pin.size / 1e6:.0f} MB) with pip")
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "-d", tmp, pin.requirement,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / pin.filename
        if not got.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise KvmemError(
                f"pip could not download {pin.requirement}:\n{tail}",
                hint="check that PyPI (or your pip index) is reachable; or copy the file to "
                f"{target} by hand (it is verified either way)",
            )
        verify_sdist(got, pin)
        os.replace(got, target)
    return target


def _member_relpath(name: str, pin: Pin) -> str | None:
    """Path below the llama.cpp tree for an archive member, or None if outside it."""
    parts = name.split("/", 1)
    if len(parts) != 2:
        return None
    prefix = pin.tree.rstrip("/") + "/"
    if not parts[1].startswith(prefix):
        return None
    return parts[1][len(prefix):]


def extract_tree(sdist: Path, dest: Path, pin: Pin) -> Path:
    """Verify `sdist`, then extract only `pin.tree` into `dest` (atomically)."""
    verify_sdist(sdist, pin)
    if (dest / VERIFIED_MARKER).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".extract-"))
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive:
                rel = _member_relpath(member.name, pin)
                if not rel:
                    continue
                if rel.startswith("/") or ".." in Path(rel).parts:
                    raise VerificationError(f"unsafe path in {sdist.name}: {member.name}")
                if not (member.isfile() or member.isdir()):
                    continue  # no links or devices from an archive
                member.name = rel
                archive.extract(member, staging, filter="data")
        (staging / VERIFIED_MARKER).write_text(
            f'{{"sha256": "{pin.sha256}", "package": "{pin.requirement}"}}\n', encoding="utf-8"
        )
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def upstream_tree(cache: Path, pin: Pin, log: Callable[[str], None] = print) -> Path:
    """The verified, unpatched upstream tree for `pin`, fetching it if needed."""
    dest = cache / "upstream" / pin.short
    if (dest / VERIFIED_MARKER).exists():
        return dest
    sdist = download_sdist(cache, pin, log)
    log(f"extracting {pin.tree} from {sdist.name}")
    return extract_tree(sdist, dest, pin)
