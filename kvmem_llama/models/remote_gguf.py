"""A hub GGUF's header without the file: HTTP Range requests for the header bytes only, cached.

`kvmem plan` uses it for a model that is not downloaded yet. The parser (gguf_header.parse_header)
walks the header and asks for more bytes whenever the next length it reads (a string, an array,
the tensor table) runs past what was fetched; each Range request reaches that point or at least
CHUNK bytes further (the step doubles up to MAX_CHUNK, so a 10 MB tokenizer takes about ten
requests). Nothing past the tensor table is requested: the tensor data is never read. Every answer
must be a 206 with exactly the range asked for, as for downloads. The header bytes are cached under
the kvmem cache by the file's LFS sha256, so a moved branch never returns another file's header.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvmem_llama import paths
from kvmem_llama.errors import KvmemError
from kvmem_llama.models.download import CONTENT_RANGE
from kvmem_llama.models.gguf_header import GGUFHeader, parse_header
from kvmem_llama.models.hub import HubFile

FIRST_CHUNK = 256 * 1024
MAX_CHUNK = 2 << 20
MAX_HEADER = 256 << 20  # no real header is near this; a corrupt length must not make us fetch the model
RETRIES = 3


@dataclass
class RemoteHeader:
    """The header of a hub file that is not downloaded, and what reading it cost."""

    header: GGUFHeader
    repo: str
    file: str
    commit: str | None
    size: int  # the whole file
    sha256: str
    header_bytes: int  # bytes of the header (what is cached)
    fetched_bytes: int  # bytes this call took from the network (0: from the cache)
    requests: int

    @property
    def cached(self) -> bool:
        return self.fetched_bytes == 0

    def summary(self) -> dict:
        data = asdict(self)
        del data["header"]
        data["cached"] = self.cached
        return data


def cache_dir() -> Path:
    return paths.cache_dir() / "gguf-headers"


def _label(file: HubFile) -> Path:
    return Path(f"{file.repo}:{file.filename}")


class _RangeReader:
    """A growing prefix of a remote file, extended by exact Range requests."""

    def __init__(self, client: httpx.Client, file: HubFile, headers: dict[str, str]):
        self.client, self.file, self.headers = client, file, headers
        self.buf = bytearray()
        self.chunk = FIRST_CHUNK
        self.requests = 0

    def more(self, end: int) -> None:
        if end > MAX_HEADER:
            raise KvmemError(f"{self.file.repo}:{self.file.filename}: the GGUF header claims more than "
                             f"{MAX_HEADER >> 20} MiB (needs byte {end}); not reading further",
                             hint="the file is corrupt or not a GGUF model; check the repository")
        first = len(self.buf)
        last = min(max(end, first + self.chunk), self.file.size) - 1
        self.chunk = min(self.chunk * 2, MAX_CHUNK)
        self.buf += self._get(first, last)

    def _get(self, first: int, last: int) -> bytes:
        label = f"{self.file.repo}:{self.file.filename}"
        for attempt in range(RETRIES):
            try:
                return self._get_once(first, last, label)
            except (httpx.TransportError, _Transient) as exc:
                if attempt == RETRIES - 1:
                    raise KvmemError(f"{label}: reading bytes {first}-{last} of the header failed: {exc}",
                                     hint="check the network or HF_ENDPOINT, and try again") from exc
                time.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _get_once(self, first: int, last: int, label: str) -> bytes:
        headers = {**self.headers, "Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"}
        self.requests += 1
        with self.client.stream("GET", self.file.url, headers=headers) as resp:
            code = resp.status_code
            if code in (408, 429) or code >= 500:
                raise _Transient(f"HTTP {code}")
            if code == 200:  # the whole file would follow: close without reading it
                raise KvmemError(f"{label}: the server ignores Range requests (200 for bytes {first}-{last}), so "
                                 "the header cannot be read without downloading the whole file",
                                 hint=f"download it first: kvmem pull {label}, or set HF_ENDPOINT to another mirror")
            if code != 206:
                raise KvmemError(f"{label}: the server answered HTTP {code} to a Range request for the header",
                                 hint="401/403: set HF_TOKEN; 404: the file changed on the hub")
            got = resp.headers.get("content-range", "").strip()
            m = CONTENT_RANGE.match(got)
            if not m or int(m.group(1)) != first or int(m.group(2)) != last or m.group(3) not in (
                    str(self.file.size), "*"):
                raise KvmemError(f"{label}: asked for bytes {first}-{last}/{self.file.size}, the server answered "
                                 f"Content-Range {got!r}", hint="the file on the server is not the one the hub "
                                 "API describes; try again later")
            body = bytearray()
            for part in resp.iter_bytes():
                body += part
                if len(body) > last - first + 1:
                    break
            if len(body) != last - first + 1:
                raise _Transient(f"got {len(body)} bytes for a range of {last - first + 1}")
            return bytes(body)


class _Transient(Exception):
    pass


def _cache_paths(sha256: str) -> tuple[Path, Path]:
    return cache_dir() / f"{sha256}.head", cache_dir() / f"{sha256}.json"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _from_cache(file: HubFile) -> RemoteHeader | None:
    head, meta = _cache_paths(file.sha256)
    try:
        data = head.read_bytes()
        info = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if info.get("size") != file.size:
        return None
    try:
        header = parse_header(data, _label(file), file.size)
    except KvmemError:
        return None  # damaged: read it again
    return RemoteHeader(header, file.repo, file.filename, file.commit, file.size, file.sha256, len(data), 0, 0)


def read_remote_header(client: httpx.Client, file: HubFile, headers: dict[str, str] | None = None) -> RemoteHeader:
    """The GGUF header of a hub file (from the cache, else read over Range requests and cached)."""
    cached = _from_cache(file)
    if cached is not None:
        return cached
    reader = _RangeReader(client, file, headers or {})
    reader.more(min(64, file.size))
    header = parse_header(reader.buf, _label(file), file.size, reader.more)
    end = header.data_offset
    fetched = len(reader.buf)
    head, meta = _cache_paths(file.sha256)
    kept = bytes(reader.buf[:min(end, fetched)])
    _write_atomic(head, kept)
    _write_atomic(meta, json.dumps({"repo": file.repo, "file": file.filename, "revision": file.revision,
                                    "commit": file.commit, "size": file.size, "sha256": file.sha256,
                                    "header_bytes": len(kept), "read_at": time.time()}, indent=2).encode())
    return RemoteHeader(header, file.repo, file.filename, file.commit, file.size, file.sha256, len(kept), fetched,
                        reader.requests)
