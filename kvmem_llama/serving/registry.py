"""Registry of servers started by kvmem: one JSON record + one log file per name in servers_dir().

A record is trusted only while its pid is alive *and* has the same start time, so a reused
pid is never mistaken for (or killed as) our server. A server that ended without `kvmem stop` keeps
its record with its exit code (written by serving.monitor for a detached server, by the launching
process for a foreground one): `kvmem ps` shows it as crashed until `kvmem stop NAME` forgets it.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from kvmem_llama import hardware, paths
from kvmem_llama.errors import KvmemError
from kvmem_llama.files import atomic_write_text
from kvmem_llama.serving.process import FORCE_AFTER, describe_exit, stop_process

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class ServerRecord:
    name: str
    pid: int
    host: str
    port: int
    model_id: str
    model_path: str
    ctx: int | None
    budget: int
    log_path: str
    argv: list[str]
    engine: str
    detached: bool
    started_at: float = field(default_factory=time.time)
    create_time: float | None = None  # psutil's process start time, guards against pid reuse
    monitor_pid: int | None = None  # the serving.monitor parent of a detached server
    exit_code: int | None = None  # how it ended, when it ended without `kvmem stop` (Popen style: -9 = SIGKILL)
    ended_at: float | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def process(self) -> psutil.Process | None:
        """The live server process, or None when it is gone (or the pid now belongs to another process)."""
        try:
            proc = psutil.Process(self.pid)
            if self.create_time is not None and abs(proc.create_time() - self.create_time) > 1.0:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    @property
    def alive(self) -> bool:
        return self.process() is not None


def process_start_time(pid: int) -> float | None:
    """What a record keeps to recognise its process later (None when it is already gone)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise KvmemError(f"invalid server name {name!r}",
                         hint="use letters, digits, '.', '_' or '-' (up to 64 characters)")
    return name


def slug(text: str) -> str:
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "server"
    return out[:48]


def root() -> Path:
    """paths.servers_dir(), or $KVMEM_SERVERS_DIR (tests and several independent setups)."""
    override = os.environ.get("KVMEM_SERVERS_DIR")
    return Path(override).expanduser() if override else paths.servers_dir()


def record_path(name: str) -> Path:
    return root() / f"{name}.json"


def log_path(name: str) -> Path:
    return root() / f"{name}.log"


def save(record: ServerRecord) -> Path:
    return atomic_write_text(record_path(record.name), json.dumps(asdict(record), indent=2) + "\n")


def load(name: str) -> ServerRecord | None:
    path = record_path(name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ServerRecord(**data)
    except (OSError, json.JSONDecodeError, TypeError):
        return None


def remove(name: str) -> None:
    try:
        record_path(name).unlink()
    except FileNotFoundError:
        pass


def list_records() -> list[ServerRecord]:
    folder = root()
    if not folder.is_dir():
        return []
    records = [r for p in sorted(folder.glob("*.json")) if (r := load(p.stem))]
    return sorted(records, key=lambda r: r.started_at)


def require(name: str) -> ServerRecord:
    record = load(name)
    if record is None:
        known = ", ".join(r.name for r in list_records()) or "none"
        raise KvmemError(f"no server named {name!r}", hint=f"known servers: {known} (see `kvmem ps`)")
    return record


def log_file(name: str) -> Path:
    """A server's log, also after its record is gone (a stopped server keeps its log)."""
    record = load(name)
    path = log_path(name) if record is None else Path(record.log_path)
    if not path.exists():
        raise KvmemError(f"no log for {name!r}", hint="see `kvmem ps` for server names")
    return path


def unique_name(base: str) -> str:
    """`base`, or `base-2`, `base-3`, ... when a live server already has that name."""
    base = slug(base)
    name, n = base, 1
    while (rec := load(name)) is not None and rec.alive:
        n += 1
        name = f"{base}-{n}"
    return name


def owner_of_port(port: int) -> str | None:
    """The name of the live kvmem server on `port`, if one is."""
    return next((r.name for r in list_records() if r.port == port and r.alive), None)


def stop(record: ServerRecord, timeout: float = 15.0) -> str:
    """SIGTERM, a second SIGTERM after FORCE_AFTER s (llama-server then exits at once), SIGKILL after
    `timeout` s; then the record is forgotten. Returns "stopped", "forced", "killed" or "not running"."""
    proc = record.process()
    result = "not running" if proc is None else stop_process(proc, timeout, FORCE_AFTER)
    _wait_for_monitor(record)
    remove(record.name)
    return result


def _wait_for_monitor(record: ServerRecord, timeout: float = 10.0) -> None:
    """Let a detached server's monitor write its last word before the record is removed."""
    if record.monitor_pid is None:
        return
    try:
        monitor = psutil.Process(record.monitor_pid)
        if "kvmem_llama.serving.monitor" in " ".join(monitor.cmdline()):
            monitor.wait(timeout)
    except (psutil.Error, psutil.TimeoutExpired):
        pass


def mark_exited(name: str, pid: int, code: int | None) -> ServerRecord | None:
    """Keep the record of a server that ended on its own, with how it ended (if it is still this pid's)."""
    record = load(name)
    if record is None or record.pid != pid:
        return None
    if record.exit_code is None:  # the monitor may have written it already
        record.exit_code, record.ended_at = code, time.time()
        save(record)
    return record


@dataclass
class ServerStatus:
    """One server as `kvmem ps` sees it."""

    name: str
    pid: int
    port: int
    model: str
    ctx: int | None
    budget: int
    alive: bool
    uptime_s: float | None
    rss: int | None
    vram: int | None
    detached: bool
    url: str
    log: str
    state: str = "running"  # running, exited (code 0 or unknown) or crashed
    exit_code: int | None = None
    status: str = "running"  # what `kvmem ps` prints: "running", "crashed (exit code -9, SIGKILL)", ...


def statuses() -> list[ServerStatus]:
    """The registered servers, live or ended. A server that ended shows how (its exit code, when the
    monitor or the launching process saw it); records of foreground runs that died without a word
    (with their terminal) are dropped on the way: nobody is left to stop them."""
    records = list_records()
    vram = hardware.process_vram([r.pid for r in records])
    out = []
    for record in records:
        proc = record.process()
        if proc is None and not record.detached and record.exit_code is None:
            remove(record.name)
            continue
        rss = None
        if proc is not None:
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                pass
        if proc is not None:
            state, status = "running", "running"
        else:
            status = describe_exit(record.exit_code)
            state = status.split(" ", 1)[0]
        out.append(ServerStatus(
            record.name, record.pid, record.port, record.model_id, record.ctx, record.budget, proc is not None,
            time.time() - record.started_at if proc is not None else None, rss, vram.get(record.pid),
            record.detached, record.url, record.log_path, state, record.exit_code, status))
    return out
