"""Moving engines and sources between machines, verified.

- source packs: the patched tree as one compact tar.xz (for a build host with no registry access,
  e.g. the GPU machine), unpacked into the same cache slot `kvmem build` uses;
- engine packages: one tarball per built target (bin/, lib/ with relative RPATH, include/,
  licenses/, build-info.json) plus a SHA256SUMS over all of them;
- install: verify the tarball's sha256 against SHA256SUMS, every file against build-info,
  the target SM against the GPU, then move it into the engine store atomically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

import httpx

from kvmem_llama import hardware
from kvmem_llama.build import TREE_MARKER, patched_tree, tree_root, upstream_series
from kvmem_llama.engine import Engine, check_engine_for_gpus, install_engine, load_engine, tree_key
from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.files import atomic_directory, sha256_file
from kvmem_llama.patching import load_series
from kvmem_llama.vendor import load_pin

# Parts of upstream that no engine build reads (docs, vocab test models, web UI sources, tests, ...).
PACK_EXCLUDES = ("docs", "models", "media", "benches", ".github", "tests", "examples", "tools/ui/tests",
                 "gguf-py", "conversion", "pocs", "app", "skills", ".devops", "ci", ".git")
SUMS_FILE = "SHA256SUMS"


# --- source packs ---


def pack_source(out_dir: Path, upstream: bool = False) -> Path:
    """Write the patched tree of this checkout's pin + series (or the bare pin) as one tar.xz."""
    pin, series = load_pin(), (upstream_series() if upstream else load_series())
    src = patched_tree(pin, series, log=lambda _m: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"kvmem-src-{tree_key(pin, series)}.tar.xz"
    excluded = {Path(e) for e in PACK_EXCLUDES}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = Path(info.name).relative_to("src") if info.name != "src" else Path(".")
        if any(rel == e or e in rel.parents for e in excluded):
            return None
        if rel.suffix in (".gguf", ".pyc") or info.issym() or info.islnk():
            return None
        return info

    tmp = target.with_suffix(".partial")
    with tarfile.open(tmp, "w:xz", preset=6) as archive:
        archive.add(src, arcname="src", filter=keep)
    os.replace(tmp, target)
    return target


def unpack_source(pack: Path) -> Path:
    """Put a source pack where `kvmem build` looks for the patched tree; refuses another series."""
    pin = load_pin()
    with tarfile.open(pack, "r:*") as archive:
        member = archive.getmember(f"src/{TREE_MARKER}")
        handle = archive.extractfile(member)
        assert handle is not None
        marker = json.loads(handle.read())
        known = {s.hash(): s for s in (load_series(), upstream_series())}
        series = known.get(marker.get("series"))
        if marker.get("pin") != pin.sha256 or series is None:
            raise VerificationError(
                f"{pack.name} was made from another pin or patch series than this checkout",
                hint="make the pack with `kvmem vendor pack` from the same commit",
            )
        src = tree_root(pin, series) / "src"
        with atomic_directory(src, prefix=".unpack-") as staging:
            archive.extractall(staging, filter=_below_src)
    return src


def _below_src(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Extract a pack's `src/...` members into the staging directory itself (tarfile's data filter too)."""
    if member.name == "src" or not member.name.startswith("src/"):
        return None
    return tarfile.data_filter(member.replace(name=member.name.removeprefix("src/"), deep=False), dest)


# --- engine packages ---


def package_engine(engine: Engine, out_dir: Path) -> Path:
    """Tar one engine (as installed in the store) and refresh SHA256SUMS in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"kvmem-engine-{engine.key}"
    target = out_dir / f"{name}.tar.gz"
    tmp = target.with_suffix(".partial")
    with tarfile.open(tmp, "w:gz") as archive:
        archive.add(engine.path, arcname=name)
    os.replace(tmp, target)
    write_sums(out_dir)
    return target


def write_sums(out_dir: Path) -> Path:
    lines = [f"{sha256_file(p)}  {p.name}\n" for p in sorted(out_dir.glob("kvmem-engine-*.tar.gz"))]
    sums = out_dir / SUMS_FILE
    sums.write_text("".join(lines), encoding="utf-8")
    return sums


def read_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([0-9a-f]{64})\s+\*?(\S+)", line.strip())
        if match:
            sums[match.group(2)] = match.group(1)
    return sums


def _fetch(url: str, dest: Path) -> Path:
    with httpx.stream("GET", url, follow_redirects=True, timeout=60) as response:
        if response.status_code != 200:
            raise KvmemError(f"{url}: HTTP {response.status_code}")
        with open(dest, "wb") as fh:
            for chunk in response.iter_bytes(1 << 20):
                fh.write(chunk)
    return dest


def _expected_sha(tarball: Path, source: str, sums: str | None, workdir: Path) -> str:
    """The tarball's sha256 from SHA256SUMS (given, or next to the tarball / URL)."""
    if sums is None:
        sums = source.rsplit("/", 1)[0] + "/" + SUMS_FILE if "://" in source else str(Path(source).parent / SUMS_FILE)
    if "://" in sums:
        sums_path = _fetch(sums, workdir / SUMS_FILE)
    else:
        sums_path = Path(sums)
        if not sums_path.exists():
            raise VerificationError(f"no {SUMS_FILE} for {tarball.name} (looked at {sums_path})",
                                    hint="pass --sums PATH|URL; packages are never installed unverified")
    table = read_sums(sums_path.read_text(encoding="utf-8"))
    if tarball.name not in table:
        raise VerificationError(f"{sums_path} has no line for {tarball.name}")
    return table[tarball.name]


def install_engine_package(source: str, sums: str | None = None, gpu_sms: list[str] | None = None) -> Engine:
    """Verify and install an engine tarball (path or URL) into the store."""
    with tempfile.TemporaryDirectory(prefix="kvmem-install-") as tmp:
        work = Path(tmp)
        if "://" in source:
            tarball = _fetch(source, work / source.rsplit("/", 1)[1])
        else:
            tarball = Path(source)
            if not tarball.is_file():
                raise KvmemError(f"no such package: {tarball}")
        expected = _expected_sha(tarball, source, sums, work)
        got = sha256_file(tarball)
        if got != expected:
            raise VerificationError(f"{tarball.name} has sha256 {got}, SHA256SUMS says {expected}: "
                                    "the package was changed or damaged; not installed")
        unpacked = work / "unpacked"
        with tarfile.open(tarball, "r:gz") as archive:
            archive.extractall(unpacked, filter="data")
        tops = [p for p in unpacked.iterdir() if p.is_dir()]
        if len(tops) != 1 or (engine := load_engine(tops[0])) is None:
            raise VerificationError(f"{tarball.name} is not a kvmem engine package (no build-info.json)")
        for rel, digest in engine.info.get("files", {}).items():
            path = engine.path / rel
            if not path.is_file() or sha256_file(path) != digest:
                raise VerificationError(f"{tarball.name}: {rel} does not match its build-info sha256; not installed")
        if gpu_sms is None:
            gpu_sms = [gpu.sm for gpu in hardware.detect_gpus()[0] if gpu.sm]
        check_engine_for_gpus(engine, gpu_sms)

        def move_in(staging: Path) -> None:
            for item in engine.path.iterdir():
                shutil.move(str(item), staging / item.name)

        return install_engine(engine.key, move_in)
