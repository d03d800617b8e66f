"""Models already in the Hugging Face hub cache are used in place (no second copy).

The cache layout (models--OWNER--NAME/{blobs,refs,snapshots}) is read with huggingface_hub
itself. LFS blobs are named after their sha256 there; that name is only taken as the
*expected* hash: the file is hashed before it is registered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvmem_llama.models.catalog import SHA256_RE, CatalogEntry
from kvmem_llama.models.hub import hf_home


def hub_cache_dir() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    return hf_home() / "hub"


@dataclass(frozen=True)
class CachedFile:
    repo: str
    filename: str
    path: Path  # the snapshot path (a symlink to the blob on POSIX)
    blob: Path
    size: int
    commit: str
    refs: tuple[str, ...]

    @property
    def blob_sha256(self) -> str | None:
        name = self.blob.name
        return name if SHA256_RE.match(name) else None


def find_file(repo: str, filename: str, revision: str = "main", cache_dir: Path | None = None) -> CachedFile | None:
    """The cached file for repo/filename at revision, via huggingface_hub.try_to_load_from_cache."""
    from huggingface_hub import try_to_load_from_cache

    cache = cache_dir or hub_cache_dir()
    if not cache.is_dir():
        return None
    found = try_to_load_from_cache(repo, filename, cache_dir=str(cache), revision=revision)
    if not isinstance(found, str) or not os.path.isfile(found):
        return None
    path = Path(found)
    blob = path.resolve()
    commit = path.relative_to(cache).parts[2] if path.is_relative_to(cache) else ""
    return CachedFile(repo, filename, path, blob, blob.stat().st_size, commit, (revision,))


def scan_ggufs(cache_dir: Path | None = None) -> list[CachedFile]:
    """Every GGUF in the hub cache (all repos and revisions), via huggingface_hub.scan_cache_dir."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = cache_dir or hub_cache_dir()
    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    out: list[CachedFile] = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            for f in rev.files:
                if f.file_name.endswith(".gguf"):
                    rel = f.file_path.relative_to(rev.snapshot_path).as_posix()
                    out.append(CachedFile(repo.repo_id, rel, f.file_path, f.blob_path, f.size_on_disk,
                                          rev.commit_hash, tuple(sorted(rev.refs))))
    return out


def find_for_entry(entry: CatalogEntry, cache_dir: Path | None = None) -> CachedFile | None:
    """A cached file that satisfies a catalog entry (exact file, or a quant glob), offline."""
    if not entry.repo:
        return None
    if entry.file:
        hit = find_file(entry.repo, entry.file, entry.revision, cache_dir)
        if hit is not None:
            return hit
    candidates = [c for c in scan_ggufs(cache_dir) if c.repo == entry.repo and entry.matches_file(c.filename)
                  and "-of-0" not in c.filename]
    if entry.sha256:
        candidates = [c for c in candidates if c.blob_sha256 in (None, entry.sha256)]
    # prefer the revision the entry names, then the first glob that matches
    candidates.sort(key=lambda c: (entry.revision not in c.refs and entry.revision != c.commit, c.filename))
    return candidates[0] if candidates else None
