"""Models already in the Hugging Face hub cache are used in place (no second copy).

The cache layout is read directly (no huggingface_hub, which would bring a second HTTP stack):

    $HF_HUB_CACHE/models--OWNER--NAME/
        blobs/<sha256 for LFS files, git sha1 otherwise>
        refs/<revision>                  a file holding the commit hash (refs/main, refs/refs/pr/1)
        snapshots/<commit>/<file path>   a symlink into blobs/ on POSIX
        .no_exist/<commit>/<file path>   "this file does not exist at that commit" (empty files)

The rules follow huggingface_hub's own readers: find_file those of try_to_load_from_cache,
scan_ggufs those of scan_cache_dir (a repo it calls corrupted is skipped whole). A blob's name is
only taken as the *expected* sha256: the file is hashed before it is registered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvmem_llama.models.catalog import SHA256_RE, CatalogEntry
from kvmem_llama.models.hub import hf_home

MODEL_PREFIX = "models--"
_IGNORED = {".DS_Store", "Thumbs.db", "desktop.ini"}  # OS helper files, skipped by huggingface_hub too


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


def _repo_dir(cache: Path, repo: str) -> Path:
    return cache / (MODEL_PREFIX + repo.replace("/", "--"))


def _unsafe(filename: str) -> bool:
    # a name that would leave the snapshot folder
    return not filename or os.path.isabs(filename) or ".." in filename.replace("\\", "/").split("/")


def find_file(repo: str, filename: str, revision: str = "main", cache_dir: Path | None = None) -> CachedFile | None:
    """The cached file for repo/filename at revision (a ref such as `main`, or a commit hash), else None."""
    cache = cache_dir or hub_cache_dir()
    repo_dir = _repo_dir(cache, repo)
    if not cache.is_dir() or not repo_dir.is_dir() or _unsafe(filename):
        return None
    commit = revision
    ref_file = repo_dir / "refs" / revision
    if ref_file.is_file():
        try:
            commit = ref_file.read_text(encoding="utf-8")
        except OSError:
            return None
    if (repo_dir / ".no_exist" / commit / filename).is_file():
        return None  # the hub said the file does not exist at that commit
    snapshots = repo_dir / "snapshots"
    try:
        if commit not in os.listdir(snapshots):
            return None  # this revision is not cached; another one is never taken instead
    except OSError:
        return None
    path = snapshots / commit / filename
    if not path.is_file():
        return None
    blob = path.resolve()
    return CachedFile(repo, filename, path, blob, blob.stat().st_size, commit, (revision,))


def _first_hop(path: Path) -> Path:
    """Where a snapshot symlink points (a blob, named after its sha256), without following further links."""
    return Path(os.path.abspath(path.parent / os.readlink(path))) if path.is_symlink() else path


def _snapshot_files(revision_dir: Path) -> list[Path] | None:
    """Every file of a snapshot, or None when a link is broken (huggingface_hub then calls the repo corrupted)."""
    files: list[Path] = []
    for folder, _dirs, names in os.walk(revision_dir):  # symlinked folders are not followed, as there
        for name in names:
            path = Path(folder) / name
            if not _first_hop(path).exists():
                return None
            files.append(path)
    return sorted(files)


def _refs_by_commit(refs_dir: Path) -> dict[str, set[str]] | None:
    """{commit: ref names} from refs/ (`main`, `refs/pr/1`), or None when it cannot be read."""
    refs: dict[str, set[str]] = {}
    if not refs_dir.exists():
        return refs
    if refs_dir.is_file():
        return None
    try:
        for folder, _dirs, names in os.walk(refs_dir):
            for name in names:
                path = Path(folder) / name
                if name in _IGNORED or path.is_dir():
                    continue
                commit = path.read_text(encoding="utf-8")
                refs.setdefault(commit, set()).add(path.relative_to(refs_dir).as_posix())
    except OSError:
        return None
    return refs


def _scan_repo(repo_dir: Path) -> list[CachedFile]:
    """The GGUFs of one cached model repo, all revisions; [] for a repo huggingface_hub would call corrupted."""
    repo = repo_dir.name[len(MODEL_PREFIX):].replace("--", "/")
    snapshots = repo_dir / "snapshots"
    refs = _refs_by_commit(repo_dir / "refs")
    if not snapshots.is_dir() or refs is None:
        return []
    out: list[CachedFile] = []
    for revision_dir in sorted(snapshots.iterdir()):
        if revision_dir.name in _IGNORED:
            continue
        if revision_dir.is_file():
            return []
        files = _snapshot_files(revision_dir)
        if files is None:
            return []
        commit = revision_dir.name
        names = tuple(sorted(refs.pop(commit, set())))
        for path in files:
            rel = path.relative_to(revision_dir).as_posix()
            if rel.endswith(".gguf"):
                blob = _first_hop(path)
                out.append(CachedFile(repo, rel, path, blob, blob.stat().st_size, commit, names))
    return [] if refs else out  # a ref to a commit without a snapshot: corrupted


def scan_ggufs(cache_dir: Path | None = None) -> list[CachedFile]:
    """Every GGUF in the hub cache (all model repos and revisions), sorted by repo, commit and file."""
    cache = cache_dir or hub_cache_dir()
    if not cache.is_dir():
        return []
    cache = cache.expanduser().resolve()
    out: list[CachedFile] = []
    for repo_dir in sorted(cache.iterdir()):
        if repo_dir.name.startswith(MODEL_PREFIX) and repo_dir.is_dir():
            out += _scan_repo(repo_dir)
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
