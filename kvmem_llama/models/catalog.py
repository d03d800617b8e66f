"""The catalog of model aliases: shipped JSON in the package + the user's override file.

An entry names either a hub file (repo + exact `file`, or `quant` globs matched against the
repo's file list at pull time) or a PyPI-shipped model (`shipped`, resolved through
kvmem_llama.shipped). `profiles` are the recommended launch settings per VRAM tier, plain
data for `kvmem run` (serving.launch): pick the entry's `profile_for(vram_gib)`.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvmem_llama import paths
from kvmem_llama.errors import KvmemError

ALIAS_RE = re.compile(r"^[a-z0-9][a-z0-9._:+-]{0,99}$")
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")


def user_catalog_path() -> Path:
    return paths.home() / "catalog.json"


@dataclass(frozen=True)
class CatalogEntry:
    alias: str
    description: str = ""
    repo: str | None = None
    file: str | None = None
    quant: tuple[str, ...] = ()
    revision: str = "main"
    size: int | None = None
    sha256: str | None = None
    arch: str | None = None
    native_ctx: int | None = None
    mtp: bool = False
    shipped: str | None = None
    profiles: tuple[dict[str, Any], ...] = ()
    # the vision projector (mmproj) that goes with the model: a file name or globs in the same repo, and its sha256
    mmproj: tuple[str, ...] = ()
    mmproj_sha256: str | None = None
    origin: str = "package"  # "package" or the user catalog path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        if self.shipped:
            return f"pypi:{self.shipped}"
        return f"{self.repo}:{self.file or '|'.join(self.quant)}"

    def profile_for(self, vram_gib: float) -> dict[str, Any] | None:
        """The recommended profile of the largest tier that fits `vram_gib`, or None if none does."""
        fitting = [p for p in self.profiles if float(p.get("min_vram_gib", 0)) <= vram_gib]
        return dict(max(fitting, key=lambda p: float(p.get("min_vram_gib", 0)))) if fitting else None

    def projector(self) -> CatalogEntry | None:
        """The entry of the model's vision projector (pulled with the model, recorded as ALIAS:mmproj), if any."""
        if not self.mmproj or not self.repo:
            return None
        exact = len(self.mmproj) == 1 and not any(c in self.mmproj[0] for c in "*?[")
        return CatalogEntry(alias=f"{self.alias}:mmproj", description=f"vision projector of {self.alias}",
                            repo=self.repo, file=self.mmproj[0] if exact else None,
                            quant=() if exact else self.mmproj, revision=self.revision, sha256=self.mmproj_sha256,
                            origin=self.origin)

    def matches_file(self, filename: str) -> bool:
        if self.file:
            return filename == self.file
        base = filename.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(base, pat) for pat in self.quant)

    def to_json(self) -> dict[str, Any]:
        return {
            "alias": self.alias, "description": self.description, "repo": self.repo, "file": self.file,
            "quant": list(self.quant), "revision": self.revision, "size": self.size, "sha256": self.sha256,
            "arch": self.arch, "native_ctx": self.native_ctx, "mtp": self.mtp, "shipped": self.shipped,
            "profiles": [dict(p) for p in self.profiles], "mmproj": list(self.mmproj),
            "mmproj_sha256": self.mmproj_sha256, "origin": self.origin,
        }


def validate_repo_file(repo: str, filename: str) -> None:
    """Reject names that could escape the store or the URL path (../, absolute, backslashes)."""
    if not REPO_RE.match(repo) or ".." in repo:
        raise KvmemError(f"invalid hub repository name {repo!r}",
                         hint="expected OWNER/NAME, e.g. unsloth/Qwen3.8-27B-GGUF")
    parts = filename.split("/")
    if (not filename or filename.startswith("/") or "\\" in filename or "\x00" in filename
            or any(p in ("", ".", "..") for p in parts)):
        raise KvmemError(f"invalid file name {filename!r} (path traversal or empty path part)",
                         hint="a file name inside the repository, like Model-Q4_K_M.gguf or Q4_K_M/Model.gguf")


def check_alias(alias: str, where: str = "") -> str:
    """An alias as the catalog and the store spell them, or a KvmemError saying what is allowed."""
    if not ALIAS_RE.match(alias):
        raise KvmemError(f"{where}invalid alias {alias!r}", hint="aliases are lower-case letters, digits and . _ : + -")
    return alias


def _entry(alias: str, raw: dict[str, Any], origin: str) -> CatalogEntry:
    check_alias(alias, f"catalog {origin}: ")
    known = {"description", "repo", "file", "quant", "revision", "size", "sha256", "arch", "native_ctx", "mtp",
             "shipped", "profiles", "mmproj", "mmproj_sha256"}
    quant = raw.get("quant") or ()
    if isinstance(quant, str):
        quant = (quant,)
    mmproj = raw.get("mmproj") or ()
    if isinstance(mmproj, str):
        mmproj = (mmproj,)
    sha, mmproj_sha = raw.get("sha256"), raw.get("mmproj_sha256")
    for key, value in (("sha256", sha), ("mmproj_sha256", mmproj_sha)):
        if value is not None and not SHA256_RE.match(str(value).lower()):
            raise KvmemError(f"catalog {origin}: {alias}: {key} must be 64 hex digits")
    entry = CatalogEntry(
        alias=alias, description=str(raw.get("description", "")), repo=raw.get("repo"), file=raw.get("file"),
        quant=tuple(quant), revision=str(raw.get("revision") or "main"), size=raw.get("size"),
        sha256=sha.lower() if sha else None, arch=raw.get("arch"), native_ctx=raw.get("native_ctx"),
        mtp=bool(raw.get("mtp", False)), shipped=raw.get("shipped"),
        profiles=tuple(dict(p) for p in raw.get("profiles", ())), mmproj=tuple(mmproj),
        mmproj_sha256=mmproj_sha.lower() if mmproj_sha else None, origin=origin,
        extra={k: v for k, v in raw.items() if k not in known},
    )
    if not entry.shipped:
        if not entry.repo or not (entry.file or entry.quant):
            raise KvmemError(f"catalog {origin}: {alias} needs `repo` and `file` (or `quant` globs), or `shipped`")
        validate_repo_file(entry.repo, entry.file or "x.gguf")
        for name in (entry.file, *entry.mmproj):
            if name:
                validate_repo_file(entry.repo, name)
        if not REVISION_RE.match(entry.revision) or ".." in entry.revision:
            raise KvmemError(f"catalog {origin}: {alias}: invalid revision {entry.revision!r}")
    return entry


def _load_models(data: dict[str, Any], origin: str) -> dict[str, CatalogEntry]:
    models = data.get("models")
    if not isinstance(models, dict):
        raise KvmemError(f"catalog {origin}: expected an object with a `models` mapping")
    out: dict[str, CatalogEntry] = {}
    pending = dict(models)
    for alias, raw in models.items():  # plain entries first, then `same_as` references
        if not isinstance(raw, dict):
            raise KvmemError(f"catalog {origin}: entry {alias!r} must be an object")
        if "same_as" not in raw:
            out[alias.lower()] = _entry(alias.lower(), raw, origin)
            pending.pop(alias)
    for alias, raw in pending.items():
        target = out.get(str(raw["same_as"]).lower())
        if target is None:
            raise KvmemError(f"catalog {origin}: {alias} is same_as unknown alias {raw['same_as']!r}")
        merged = {**target.to_json(), **{k: v for k, v in raw.items() if k != "same_as"}}
        out[alias.lower()] = _entry(alias.lower(), merged, origin)
    return out


def load_catalog() -> dict[str, CatalogEntry]:
    """Package catalog, overridden entry by entry by $KVMEM_HOME/catalog.json (user data dir)."""
    text = resources.files("kvmem_llama").joinpath("data/catalog.json").read_text(encoding="utf-8")
    catalog = _load_models(json.loads(text), "package")
    user = user_catalog_path()
    if user.is_file():
        try:
            data = json.loads(user.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise KvmemError(f"cannot read the user catalog {user}: {exc}", hint="fix or remove that file") from exc
        catalog.update(_load_models(data, str(user)))
    return catalog


def suggestions(name: str, catalog: dict[str, CatalogEntry], n: int = 4) -> list[str]:
    name = name.lower()
    close = difflib.get_close_matches(name, list(catalog), n=n, cutoff=0.5)
    prefix = [a for a in catalog if a.startswith(name.split(":")[0]) and a not in close]
    return (close + prefix)[:n]


def lookup(name: str, catalog: dict[str, CatalogEntry] | None = None) -> CatalogEntry | None:
    catalog = load_catalog() if catalog is None else catalog
    return catalog.get(name.lower())


def search(text: str, catalog: dict[str, CatalogEntry] | None = None) -> list[CatalogEntry]:
    """Entries whose alias, repo, description, arch or file mention every word of `text`."""
    catalog = load_catalog() if catalog is None else catalog
    words = text.lower().split()
    out = []
    for entry in catalog.values():
        hay = " ".join(str(x) for x in (entry.alias, entry.repo, entry.description, entry.arch, entry.file,
                                        " ".join(entry.quant), entry.shipped) if x).lower()
        if all(w in hay for w in words):
            out.append(entry)
    return out
