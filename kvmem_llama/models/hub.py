"""The Hugging Face hub API subset kvmem uses: file listing, file size + LFS sha256, resolve URLs.

The endpoint comes from HF_ENDPOINT (mirrors are common), the token from HF_TOKEN or the
hub's token file. Only https is spoken, or plain http to a loopback address (tests, local
mirrors), unless the caller passes insecure=True. Every request, redirects included, goes
through that check. The content hash is the LFS sha256 from the API, never an ETag.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from kvmem_llama import __version__
from kvmem_llama.errors import KvmemError
from kvmem_llama.models.catalog import SHA256_RE, validate_repo_file
from kvmem_llama.net import is_loopback

DEFAULT_ENDPOINT = "https://huggingface.co"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hf_home() -> Path:
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface"


def token() -> str | None:
    """HF_TOKEN, else the token file huggingface-cli login writes (HF_TOKEN_PATH or $HF_HOME/token)."""
    tok = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if tok:
        return tok.strip()
    path = Path(os.environ["HF_TOKEN_PATH"]).expanduser() if os.environ.get("HF_TOKEN_PATH") else hf_home() / "token"
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return text or None


def check_url(url: httpx.URL | str, insecure: bool = False) -> None:
    url = httpx.URL(str(url))
    if url.scheme == "https" or insecure:
        return
    if url.scheme == "http" and is_loopback(url.host):
        return
    raise KvmemError(
        f"refusing to download over {url.scheme}:// from {url.host} (only https, or http to loopback)",
        hint="use an https mirror in HF_ENDPOINT, or pass --insecure if you really trust this network",
    )


def make_client(insecure: bool = False, timeout: float = 30.0, connections: int = 8) -> httpx.Client:
    """An httpx client whose every request (redirects too) must pass check_url."""

    def guard(request: httpx.Request) -> None:
        check_url(request.url, insecure)

    return httpx.Client(
        headers={"User-Agent": f"kvmem/{__version__}"},
        timeout=httpx.Timeout(timeout, connect=10.0),
        follow_redirects=True,
        limits=httpx.Limits(max_connections=connections + 2, max_keepalive_connections=connections + 2),
        event_hooks={"request": [guard]},
        # httpx drops Authorization on redirects to another origin (the hub's CDN), as it should.
    )


def auth_headers() -> dict[str, str]:
    tok = token()
    return {"Authorization": f"Bearer {tok}"} if tok else {}


@dataclass(frozen=True)
class HubFile:
    repo: str
    filename: str
    revision: str  # what was asked (branch, tag or commit)
    commit: str | None  # the commit the hub resolved it to
    size: int
    sha256: str
    url: str


def _api_error(resp: httpx.Response, what: str) -> KvmemError:
    code = resp.status_code
    if code in (401, 403):
        return KvmemError(f"{what}: the hub answered {code} (access denied)",
                          hint="gated or private repo: accept its terms on the hub and set HF_TOKEN "
                               "(or run `huggingface-cli login`)")
    if code == 404:
        return KvmemError(f"{what}: not found on {endpoint()} (404)",
                          hint="check the repository, file name and revision; `kvmem search` lists known aliases")
    return KvmemError(f"{what}: the hub answered HTTP {code}", hint="retry later, or try another HF_ENDPOINT mirror")


def resolve_url(repo: str, filename: str, revision: str) -> str:
    return f"{endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(filename)}"


class Hub:
    def __init__(self, client: httpx.Client | None = None, insecure: bool = False):
        check_url(endpoint(), insecure)
        self.insecure = insecure
        self.client = client or make_client(insecure)

    def _get_json(self, url: str, what: str, method: str = "GET", **kw) -> object:
        try:
            resp = self.client.request(method, url, headers=auth_headers(), **kw)
        except httpx.HTTPError as exc:
            raise KvmemError(f"{what}: cannot reach {endpoint()}: {exc}",
                             hint="check the network or HF_ENDPOINT; mirrors work too") from exc
        if resp.status_code != 200:
            raise _api_error(resp, what)
        try:
            return resp.json()
        except ValueError as exc:
            raise KvmemError(f"{what}: the hub answered non-JSON ({resp.headers.get('content-type')})",
                             hint="HF_ENDPOINT may point at something that is not a hub mirror") from exc

    def list_files(self, repo: str, revision: str = "main") -> tuple[str | None, list[dict]]:
        """(commit, siblings) of a model repo: each sibling has rfilename, size and lfs {sha256, size}."""
        validate_repo_file(repo, "x")
        url = f"{endpoint()}/api/models/{repo}/revision/{quote(revision, safe='')}"
        data = self._get_json(url, f"listing {repo}@{revision}", params={"blobs": "true"})
        if not isinstance(data, dict):
            raise KvmemError(f"listing {repo}: unexpected answer from the hub")
        return data.get("sha"), list(data.get("siblings") or [])

    def file_info(self, repo: str, filename: str, revision: str = "main") -> HubFile:
        """Size and LFS sha256 of one file, and the commit the revision points at (model info API)."""
        validate_repo_file(repo, filename)
        what = f"{repo}:{filename}@{revision}"
        commit, siblings = self.list_files(repo, revision)
        items = [s for s in siblings if s.get("rfilename") == filename]
        if not items:
            ggufs = [s.get("rfilename") for s in siblings if str(s.get("rfilename", "")).endswith(".gguf")]
            raise KvmemError(f"{what}: no such file in the repository",
                             hint=("GGUF files there: " + ", ".join(ggufs[:12])) if ggufs else None)
        item = items[0]
        lfs = item.get("lfs") or {}
        sha = str(lfs.get("sha256") or lfs.get("oid") or "").lower()
        if not SHA256_RE.match(sha):
            raise KvmemError(f"{what}: the hub gives no LFS sha256 for this file, so it cannot be verified",
                             hint="GGUF files on the hub are LFS objects; is this the right file?")
        size = int(lfs.get("size") or item.get("size") or 0)
        if size <= 0:
            raise KvmemError(f"{what}: the hub reports no size for this file")
        # Pin the download to the resolved commit so a branch moving mid-download cannot mix files.
        pinned = commit if commit and re.fullmatch(r"[0-9a-f]{40}", str(commit)) else revision
        return HubFile(repo, filename, revision, commit, size, sha, resolve_url(repo, filename, pinned))

    def pick_quant(self, repo: str, patterns: tuple[str, ...], revision: str = "main") -> str:
        """The repo file matching the first glob that matches anything (a quant selector)."""
        _, siblings = self.list_files(repo, revision)
        names = [s.get("rfilename", "") for s in siblings]
        ggufs = [n for n in names if n.endswith(".gguf")]
        for pat in patterns:
            hits = sorted(n for n in ggufs if fnmatch.fnmatchcase(n.rsplit("/", 1)[-1], pat))
            # split files (-00001-of-00003.gguf) are not supported yet: prefer single files
            singles = [n for n in hits if "-of-0" not in n]
            if singles:
                return singles[0]
            if hits:
                raise KvmemError(f"{repo}: the {pat} quant is split into parts ({hits[0]}, ...); "
                                 "split GGUFs are not supported by kvmem pull yet",
                                 hint="pick another quant, or download the parts and `kvmem import` the first")
        raise KvmemError(f"{repo}@{revision}: no GGUF matches {' or '.join(patterns)}",
                         hint="files there: " + ", ".join(ggufs[:12]) if ggufs else "the repo has no .gguf files")
