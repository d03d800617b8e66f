"""Segmented, resumable, verified downloads.

The file is split into segments fetched by N parallel Range requests into a preallocated
(sparse) partial file with pwrite. A state file records, per segment, how many bytes are
on disk; it is written only after an fsync of the data, so it never claims bytes that a
crash could lose. Every ranged answer must be 206 with exactly the Content-Range asked
for: a 200 (a server or proxy ignoring Range, or an error page) or any other range is an
error and nothing of it is written. At the end: size, sha256 (the hub's LFS hash), GGUF
magic/version, then an atomic rename. A hash mismatch deletes the partial file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.files import sha256_file

MIN_SEGMENT = 512 * 1024
SEGMENTS_PER_CONNECTION = 4
STATE_EVERY_S = 0.5
DISK_MARGIN = 64 * 1024 * 1024
_SPACE_ERRORS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
                 errno.EFBIG: "file too large for this filesystem"}
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class DownloadInterrupted(KvmemError):
    exit_code = 130


class Progress:
    """Callbacks for a progress display; the CLI renders them with rich. All no-ops here."""

    def start(self, total: int, done: int, label: str) -> None: ...

    def advance(self, n: int) -> None: ...

    def phase(self, text: str, total: int) -> None: ...

    def connections(self, active: int) -> None: ...


class _Fatal(Exception):
    """A failure that retrying cannot fix (wrong status, wrong range, disk full)."""

    def __init__(self, error: KvmemError):
        super().__init__(str(error))
        self.error = error


@dataclass
class Download:
    url: str
    size: int
    sha256: str
    label: str = ""


def partial_paths(partial_dir: Path, sha256: str) -> tuple[Path, Path, Path]:
    return (partial_dir / f"{sha256}.gguf.part", partial_dir / f"{sha256}.state.json", partial_dir / f"{sha256}.lock")


def read_state(state_path: Path) -> dict | None:
    try:
        return json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_state(state_path: Path, state: dict) -> None:
    tmp = state_path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, state_path)


class SegmentedDownloader:
    def __init__(self, client: httpx.Client, job: Download, part: Path, state_path: Path, *,
                 connections: int = 8, headers: dict[str, str] | None = None, max_retries: int = 6,
                 backoff: float = 0.5, progress: Progress | None = None):
        self.client, self.job, self.part, self.state_path = client, job, part, state_path
        self.connections = max(1, connections)
        self.headers = headers or {}
        self.max_retries, self.backoff = max_retries, backoff
        self.progress = progress or Progress()
        self.stop = threading.Event()
        self.fatal: KvmemError | None = None
        self._lock = threading.Lock()
        self._queue: list[int] = []
        self._active = 0
        self.segment_size = 0
        self.done: list[int] = []

    # -- state ---------------------------------------------------------------------------
    def _plan(self) -> None:
        size = self.job.size
        state = read_state(self.state_path)
        if (state and state.get("size") == size and state.get("sha256") == self.job.sha256
                and self.part.exists() and self.part.stat().st_size == size):
            self.segment_size = int(state["segment_size"])
            self.done = [int(x) for x in state["done"]]
            n = -(-size // self.segment_size)
            if len(self.done) == n and all(0 <= d <= self._seg_len(i) for i, d in enumerate(self.done)):
                return
        seg = max(MIN_SEGMENT, -(-size // (self.connections * SEGMENTS_PER_CONNECTION)))
        self.segment_size = seg
        self.done = [0] * (-(-size // seg))
        try:
            with open(self.part, "wb") as fh:  # sparse: blocks are allocated as segments arrive
                fh.truncate(size)
            self._save(None)
        except OSError as exc:
            if exc.errno in _SPACE_ERRORS:
                raise KvmemError(f"{_SPACE_ERRORS[exc.errno]}: cannot create the {size}-byte file {self.part}",
                                 hint="the store needs a filesystem that holds files this big with room "
                                      "to spare; set KVMEM_HOME elsewhere") from exc
            raise

    def _seg_len(self, i: int) -> int:
        return min(self.job.size, (i + 1) * self.segment_size) - i * self.segment_size

    def _save(self, fd: int | None) -> None:
        snapshot = list(self.done)  # taken before the fsync: every byte it counts is already written
        if fd is not None:
            os.fsync(fd)
        _write_state(self.state_path, {
            "version": 1, "url": self.job.url, "size": self.job.size, "sha256": self.job.sha256,
            "segment_size": self.segment_size, "done": snapshot, "updated": time.time(),
        })

    @property
    def bytes_done(self) -> int:
        return sum(self.done)

    # -- workers -------------------------------------------------------------------------
    def _next(self) -> int | None:
        with self._lock:
            return self._queue.pop(0) if self._queue else None

    def _worker(self, fd: int) -> None:
        with self._lock:
            self._active += 1
        try:
            while not self.stop.is_set():
                i = self._next()
                if i is None:
                    return
                self._segment(fd, i)
        except _Fatal as exc:
            with self._lock:
                if self.fatal is None:
                    self.fatal = exc.error
            self.stop.set()
        except Exception as exc:  # a bug or an unexpected failure: stop everyone, report it
            with self._lock:
                if self.fatal is None:
                    self.fatal = KvmemError(f"download failed: {type(exc).__name__}: {exc}")
            self.stop.set()
        finally:
            with self._lock:
                self._active -= 1

    def _segment(self, fd: int, i: int) -> None:
        seg_start = i * self.segment_size
        seg_len = self._seg_len(i)
        failures = 0
        while self.done[i] < seg_len and not self.stop.is_set():
            before = self.done[i]
            try:
                self._fetch(fd, i, seg_start, seg_len)
                if self.done[i] < seg_len and not self.stop.is_set():
                    raise httpx.RemoteProtocolError("body ended early")
            except (httpx.TransportError, _Transient) as exc:
                failures = 0 if self.done[i] > before else failures + 1
                if failures > self.max_retries:
                    raise _Fatal(KvmemError(
                        f"download of {self.job.label or self.job.url} keeps failing: {exc}",
                        hint="the partial download is kept; run the same command again to resume")) from exc
                delay = min(self.backoff * (2 ** max(failures - 1, 0)), 15.0) * (0.5 + random.random())
                self.stop.wait(delay)

    def _fetch(self, fd: int, i: int, seg_start: int, seg_len: int) -> None:
        first = seg_start + self.done[i]
        last = seg_start + seg_len - 1
        headers = {**self.headers, "Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"}
        with self.client.stream("GET", self.job.url, headers=headers) as resp:
            code = resp.status_code
            if code == 200:
                raise _Fatal(KvmemError(
                    f"the server answered a Range request for bytes {first}-{last} with 200 (the whole body or "
                    f"an error page); nothing of it was written",
                    hint="this server or proxy ignores Range requests: set HF_ENDPOINT to another mirror, or "
                         "bypass the proxy; the partial download is kept"))
            if code in (408, 429) or code >= 500:
                raise _Transient(f"HTTP {code}")
            if code != 206:
                raise _Fatal(KvmemError(f"the server answered HTTP {code} to a Range request ({self.job.url})",
                                        hint="401/403: set HF_TOKEN; 404/416: the file changed on the hub, "
                                             "remove the partial download with `kvmem rm --partials`"))
            got = resp.headers.get("content-range", "")
            m = CONTENT_RANGE.match(got.strip())
            total = str(self.job.size)
            if not m or int(m.group(1)) != first or int(m.group(2)) != last or m.group(3) not in (total, "*"):
                raise _Fatal(KvmemError(
                    f"the server answered bytes {first}-{last}/{total} with Content-Range {got!r}; "
                    "nothing of it was written",
                    hint="the file on the server is not the one the hub API describes (changed mid-download?); "
                         "run the command again, or `kvmem rm --partials` to start over"))
            for chunk in resp.iter_bytes():
                if self.stop.is_set():
                    return
                pos = seg_start + self.done[i]
                if pos + len(chunk) > last + 1:
                    raise _Fatal(KvmemError(f"the server sent more than the {seg_len} bytes of range {first}-{last}"))
                try:
                    written = 0
                    while written < len(chunk):  # pwrite may write less (a filling disk): count only what landed
                        n = os.pwrite(fd, memoryview(chunk)[written:], pos + written)
                        written += n
                        self.done[i] += n
                        self.progress.advance(n)
                except OSError as exc:
                    if exc.errno in _SPACE_ERRORS:
                        raise _Fatal(KvmemError(
                            f"{_SPACE_ERRORS[exc.errno]} while writing {self.part} "
                            f"({self.bytes_done} of {self.job.size} bytes kept)",
                            hint="free some space (or set KVMEM_HOME to a bigger disk) and run the same command "
                                 "again to resume")) from exc
                    raise

    # -- driver --------------------------------------------------------------------------
    def run(self) -> None:
        """Fetch every missing byte; raise DownloadInterrupted on Ctrl-C (state saved)."""
        self._plan()
        missing = self.job.size - self.bytes_done
        free = shutil.disk_usage(self.part.parent).free
        if missing + DISK_MARGIN > free:
            raise KvmemError(
                f"not enough disk space in {self.part.parent}: {missing} more bytes needed, {free} free",
                hint="free some space, or set KVMEM_HOME to a directory on a bigger disk")
        self.progress.start(self.job.size, self.bytes_done, self.job.label)
        self._queue = [i for i in range(len(self.done)) if self.done[i] < self._seg_len(i)]
        if not self._queue:
            return
        fd = os.open(self.part, os.O_WRONLY)
        threads = [threading.Thread(target=self._worker, args=(fd,), daemon=True, name=f"kvmem-dl-{k}")
                   for k in range(min(self.connections, len(self._queue)))]
        interrupted = False
        try:
            for t in threads:
                t.start()
            last_save = time.monotonic()
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(timeout=0.1)
                self.progress.connections(self._active)
                if time.monotonic() - last_save >= STATE_EVERY_S:
                    with contextlib.suppress(OSError):  # a full disk: the older state stays valid
                        self._save(fd)
                    last_save = time.monotonic()
        except KeyboardInterrupt:
            interrupted = True
            self.stop.set()
            for t in threads:
                t.join(timeout=5)
        finally:
            self.stop.set()
            try:
                self._save(fd)
            except OSError:  # e.g. the disk is full: the previous state file is still valid (it only lags)
                pass
            os.close(fd)
        if interrupted:
            raise DownloadInterrupted(
                f"interrupted; {self.bytes_done} of {self.job.size} bytes kept in {self.part}",
                hint="run the same command again to resume")
        if self.fatal is not None:
            raise self.fatal
        if self.bytes_done != self.job.size:
            raise KvmemError(f"download incomplete ({self.bytes_done} of {self.job.size} bytes)",
                             hint="run the same command again to resume")


class _Transient(Exception):
    pass


def download_verified(client: httpx.Client, job: Download, target: Path, partial_dir: Path, *,
                      connections: int = 8, headers: dict[str, str] | None = None, max_retries: int = 6,
                      backoff: float = 0.5, progress: Progress | None = None,
                      before_rename: Callable[[Path], None] | None = None) -> Path:
    """Download `job` into `target`: resume if possible, verify size + sha256 + GGUF, rename atomically."""
    from kvmem_llama.models.gguf_header import GGUFFormatError, check_gguf  # numpy-heavy: import when needed

    progress = progress or Progress()
    partial_dir.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    part, state_path, lock_path = partial_paths(partial_dir, job.sha256)
    with _download_lock(lock_path, job.label or job.sha256):
        if _already_there(target, job):  # another process finished this file while we waited for the hub
            return target
        SegmentedDownloader(client, job, part, state_path, connections=connections, headers=headers,
                            max_retries=max_retries, backoff=backoff, progress=progress).run()
        size = part.stat().st_size
        if size != job.size:  # cannot happen with a sane filesystem; checked anyway
            raise VerificationError(f"{job.label}: size {size}, expected {job.size}")
        progress.phase("verifying sha256", job.size)
        got = sha256_file(part, progress)
        if got != job.sha256:
            _discard(part, state_path)
            raise VerificationError(
                f"{job.label or job.url}: sha256 mismatch: expected {job.sha256}, got {got}; nothing was kept",
                hint="run the same command again to download it afresh; if it repeats, the mirror (HF_ENDPOINT) "
                     "serves a different file than the hub API describes")
        try:
            check_gguf(part)
        except GGUFFormatError as exc:
            _discard(part, state_path)
            raise GGUFFormatError(f"{job.label}: hash matches the hub, but {exc}", hint=exc.hint) from exc
        if before_rename:
            before_rename(part)
        os.replace(part, target)
        with contextlib.suppress(OSError):
            dfd = os.open(target.parent, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)
        _discard(None, state_path)
    return target


def _lock_holder(fd: int, wait_s: float = 2.0) -> str:
    """The pid in a held lock file. The holder writes it just after taking the lock: a loser that looks in
    between finds the file empty, so it looks again for a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if holder or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


@contextlib.contextmanager
def _download_lock(lock_path: Path, label: str) -> Iterator[int]:
    """An exclusive flock on the download's lock file, or KvmemError naming the process that holds it.

    The holder unlinks the lock file when the block ends without an error, while still holding it; a
    process that opened the old file then finds the path gone (or another inode) after locking and starts
    over on the current one, so two processes never both hold "the" lock.
    """
    for _ in range(50):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _lock_holder(fd)
                who = f" (pid {holder})" if holder.isdigit() else ""
                raise KvmemError(f"another kvmem process{who} is downloading {label} into the same store",
                                 hint="wait for it to finish (then this command has nothing left to fetch), "
                                      "or stop it: its partial download is kept and resumed") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                continue  # the previous holder finished and removed it: lock the current file
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield fd
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
            return
        finally:
            os.close(fd)
    raise KvmemError(f"could not lock {lock_path}", hint="is another kvmem process pulling the same file in a loop?")


def _already_there(target: Path, job: Download) -> bool:
    """Is `target` already this download, complete (a concurrent pull of the same file finished it)?"""
    try:
        if target.stat().st_size != job.size:
            return False
    except OSError:
        return False
    return sha256_file(target) == job.sha256


def _discard(part: Path | None, state_path: Path) -> None:
    for p in (part, state_path):
        if p is not None:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
