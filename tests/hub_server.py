"""A fake Hugging Face hub on 127.0.0.1: a real HTTP/1.1 server thread for tests and benchmarks.

Implements the subset kvmem uses (and HEAD, answered as the real hub answers it):
    GET  /api/models/OWNER/NAME[/revision/REV]   model info; siblings with size + lfs.sha256
    HEAD /OWNER/NAME/resolve/REV/PATH            X-Repo-Commit, X-Linked-Etag, X-Linked-Size
    GET  /OWNER/NAME/resolve/REV/PATH            the body, honouring Range (206 + Content-Range)
The ETag is deliberately *not* the sha256 (as for real LFS files behind a CDN), so a client
that takes it for a content hash fails. `Behavior` switches make it misbehave.

Run standalone (benchmarks): python tests/hub_server.py FILE [--repo OWNER/NAME] [--rate BYTES_PER_S]
prints the endpoint URL on stdout, serves until killed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

CHUNK = 64 * 1024


@dataclass
class Behavior:
    ignore_range: bool = False  # answer Range requests with 200 and the whole body
    wrong_range: bool = False  # answer 206 but with a Content-Range shifted by one byte
    truncate_after: int | None = None  # every body stops after N bytes (full Content-Length announced)
    drop_first: int = 0  # the first N body GETs drop the connection after drop_after bytes
    drop_after: int = 100_000
    wrong_hash: bool = False  # the API reports a sha256 that is not the file's
    rate: float | None = None  # bytes per second per connection
    require_token: str | None = None  # 401 unless "Authorization: Bearer <token>"
    status: int | None = None  # answer every file GET with this status (e.g. 503)


@dataclass
class Served:
    method: str
    path: str
    range: str | None
    status: int
    nbytes: int
    t: float


@dataclass
class HubFileData:
    data: bytes | mmap.mmap
    sha256: str


@dataclass
class FakeHub:
    behavior: Behavior = field(default_factory=Behavior)
    files: dict[tuple[str, str], HubFileData] = field(default_factory=dict)
    commits: dict[str, str] = field(default_factory=dict)
    log: list[Served] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._drops = 0
        self.active = 0  # file bodies being sent right now
        self.max_active = 0
        self._server: ThreadingHTTPServer | None = None

    # -- content ---------------------------------------------------------------------------
    def add_file(self, repo: str, path: str, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.files[(repo, path)] = HubFileData(data, sha)
        self.commits.setdefault(repo, hashlib.sha1(repo.encode()).hexdigest())
        return sha

    def add_path(self, repo: str, path: str, file: Path, sha256: str) -> None:
        """Serve a file from disk (mapped, not read: a sparse 15 GB file costs nothing) with the LFS
        sha256 the API should claim for it (hashing such a file would take longer than the test)."""
        with open(file, "rb") as fh:
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.files[(repo, path)] = HubFileData(data, sha256)
        self.commits.setdefault(repo, hashlib.sha1(repo.encode()).hexdigest())

    @property
    def bytes_served(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.log if s.method == "GET" and "/resolve/" in s.path)

    def file_gets(self) -> list[Served]:
        with self._lock:
            return [s for s in self.log if s.method == "GET" and "/resolve/" in s.path]

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no body is being sent (a killed client's server threads finish writing)."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.02)

    def reset_stats(self) -> None:
        self.wait_idle()
        with self._lock:
            self.log.clear()
            self._drops = 0
            self.max_active = 0

    # -- server ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True, name="fake-hub").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _record(self, s: Served) -> None:
        with self._lock:
            self.log.append(s)

    def _take_drop(self) -> bool:
        with self._lock:
            if self._drops < self.behavior.drop_first:
                self._drops += 1
                return True
            return False


_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?/?$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _send_json(self, obj: object, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        # recorded before the answer leaves: a client that got it may look at the log (or reset it) at once
        self.hub._record(Served(self.command, self.path, None, status, 0, time.monotonic()))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send_json({"error": message}, status)

    def _authorized(self) -> bool:
        tok = self.hub.behavior.require_token
        return tok is None or self.headers.get("Authorization") == f"Bearer {tok}"

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        path = urlparse(self.path).path
        if not self._authorized():
            return self._error(401, "Invalid credentials")
        m = _INFO.match(path)
        if m and self.command == "GET":
            return self._info(m.group(1), unquote(m.group(2) or "main"))
        m = _RESOLVE.match(path)
        if m:
            return self._resolve(m.group(1), unquote(m.group(2)), unquote(m.group(3)))
        return self._error(404, "Not Found")

    def _info(self, repo: str, revision: str) -> None:
        hub = self.hub
        if repo not in hub.commits or revision not in ("main", hub.commits[repo]):
            return self._error(404, f"Repository {repo} not found")
        siblings = []
        for (r, p), f in hub.files.items():
            if r != repo:
                continue
            sha = hashlib.sha256(f.sha256.encode()).hexdigest() if hub.behavior.wrong_hash else f.sha256
            siblings.append({"rfilename": p, "size": len(f.data), "blobId": hashlib.sha1(f.data[:64]).hexdigest(),
                             "lfs": {"sha256": sha, "size": len(f.data), "pointerSize": 134}})
        self._send_json({"id": repo, "modelId": repo, "sha": hub.commits[repo], "siblings": siblings})

    def _resolve(self, repo: str, revision: str, filename: str) -> None:
        hub, b = self.hub, self.hub.behavior
        f = hub.files.get((repo, filename))
        if f is None or revision not in ("main", hub.commits.get(repo)):
            return self._error(404, "Entry not found")
        if b.status and self.command == "GET":
            return self._error(b.status, "injected failure")
        size = len(f.data)
        rng = self.headers.get("Range")
        start, end, status = 0, size - 1, 200
        if rng and not b.ignore_range:
            m = _RANGE.match(rng.strip())
            if not m or int(m.group(1)) >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return self.hub._record(Served(self.command, self.path, rng, 416, 0, time.monotonic()))
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{hashlib.sha1(f.data[:1024]).hexdigest()}"')  # not the content hash
        self.send_header("X-Linked-Etag", f'"{f.sha256}"')
        self.send_header("X-Linked-Size", str(size))
        self.send_header("X-Repo-Commit", hub.commits[repo])
        if status == 206:
            shift = 1 if b.wrong_range else 0
            self.send_header("Content-Range", f"bytes {start + shift}-{end + shift}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return hub._record(Served("HEAD", self.path, rng, status, 0, time.monotonic()))
        limit = end - start + 1
        if b.truncate_after is not None:
            limit = min(limit, b.truncate_after)
        if hub._take_drop():
            limit = min(limit, b.drop_after)
        sent = 0
        t0 = time.monotonic()
        view = memoryview(f.data)
        with hub._lock:
            hub.active += 1
            hub.max_active = max(hub.max_active, hub.active)
        try:
            while sent < limit:
                n = min(CHUNK, limit - sent)
                self.wfile.write(view[start + sent:start + sent + n])
                sent += n
                if b.rate:
                    ahead = sent / b.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with hub._lock:
                hub.active -= 1
            hub._record(Served("GET", self.path, rng, status, sent, time.monotonic()))
        if sent < end - start + 1:
            self.close_connection = True  # the client sees a short body


def make_gguf(path: Path, n_bytes: int = 4 << 20, arch: str = "llama", seed: int = 0,
              kv: dict[str, object] | None = None) -> Path:
    """A small but well-formed GGUF (one F32 tensor of random data) written with gguf.GGUFWriter."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"test {arch} model")
    values = {"block_count": 2, "context_length": 4096, "embedding_length": 64, "attention.head_count": 4,
              "attention.head_count_kv": 2, **(kv or {})}
    for key, value in values.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, list):
            writer.add_array(full, value)
        else:
            writer.add_string(full, str(value))
    data = np.random.default_rng(seed).random(max(n_bytes // 4, 8), dtype=np.float32)
    writer.add_tensor("blob.weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def isolate_env(monkeypatch, tmp_path: Path, hub: FakeHub | None = None) -> Path:
    """Point kvmem and its HF cache lookups at temp dirs (and the fake hub); keep the shared shipped-model cache."""
    from kvmem_llama import paths

    shipped_cache = paths.cache_dir()
    home = tmp_path / "kvmem-home"
    monkeypatch.setenv("KVMEM_HOME", str(home))
    monkeypatch.setenv("KVMEM_CACHE", str(shipped_cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url if hub else "http://127.0.0.1:9")
    return home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--repo", default="bench/model-GGUF")
    ap.add_argument("--rate", type=float, default=None, help="bytes/s per connection")
    args = ap.parse_args()
    hub = FakeHub(Behavior(rate=args.rate))
    hub.add_file(args.repo, args.file.name, args.file.read_bytes())
    hub.start()
    print(hub.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        hub.stop()
        sys.exit(0)


if __name__ == "__main__":
    main()
