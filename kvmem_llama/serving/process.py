"""The one place that starts and stops llama-server: a process with its log file, waiting until it
answers correctly (/health, /v1/models, the tiering self-test), stop (SIGTERM, a second SIGTERM, then
SIGKILL), the log's tail and following it, and how a server ended. A detached server runs under a small
monitor process (serving.monitor) that records its exit status for `kvmem ps`.

`kvmem run` (through serving.launch), `kvmem bench`, `kvmem eval`, the tests and the GPU checks all
start their servers here:

    with start_llama_server(engine.server, model, ["-c", "4096"], log_path) as srv:
        httpx.post(srv.url + "/completion", json={"prompt": "Hello", "n_predict": 8})

One module because it is the single owner of the process lifecycle: splitting spawn, waiting and stop
apart would let callers start a server without the stop and log rules again. What does not need the
process lives beside it: what an argv asks for (its API key, the context of one request) in serving.argv,
the self-test's prompt and verdict and the exposure warning in serving.readiness.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import psutil

from kvmem_llama import kvmem_log
from kvmem_llama.errors import KvmemError
from kvmem_llama.serving.argv import api_key_from, bearer_headers, slot_context
from kvmem_llama.serving.readiness import check_self_test, self_test_prompt

LOOPBACK = "127.0.0.1"
STOP_TIMEOUT = 15.0  # seconds between SIGTERM and SIGKILL
# llama-server finishes the batch it is computing before it honours SIGTERM (a 2048-token prompt batch
# can take a minute on a loaded CPU) and then waits for its open requests; a second SIGTERM makes it
# exit at once ("Received second interrupt, terminating immediately"): stop() sends it after this many s
FORCE_AFTER = 5.0


class ServerFailed(KvmemError):
    """The server exited or did not become ready; the message carries its last log lines."""

    def __init__(self, message: str, hint: str | None = None, log_path: Path | None = None):
        super().__init__(message, hint)
        self.log_path = log_path


# --- ports ---


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like the server: TIME_WAIT is fine
        try:
            sock.bind((host if host not in ("", "localhost") else LOOPBACK, port))
        except OSError:
            return True
    return False


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# --- logs ---


def tail_lines(path: Path | str, n: int = 20, start: int = 0) -> list[str]:
    """The last `n` lines of a log file from byte `start` on ([] when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-n:]


_ERROR_LINE = re.compile(r"^\S+ E (?:\S+\s+)?(?:[\w:]+\s*:\s*)?(.+)$")


def first_error(lines: Sequence[str]) -> str | None:
    """The first error llama-server logged ("error loading model: unknown model architecture: 'x'",
    "couldn't bind HTTP server socket, ..."): what a failed start is about."""
    for line in lines:
        m = _ERROR_LINE.match(line)
        if m:
            return m.group(1).strip()
    return None


def _tail_to(path: Path, start: int, on_line: Callable[[str], None], stop: threading.Event) -> None:
    """Follow the log file from `start` and hand each complete line to on_line (the console)."""
    with open(path, "rb") as fh:
        fh.seek(start)
        pending = b""
        while True:
            chunk = fh.read(65536)
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    on_line(line.decode("utf-8", errors="replace"))
                continue
            if stop.is_set():
                if pending:
                    on_line(pending.decode("utf-8", errors="replace"))
                return
            time.sleep(0.1)


def follow_log(path: Path, on_line: Callable[[str], None], start: int = 0) -> tuple[threading.Thread, threading.Event]:
    """Hand every line written to the log from `start` on to `on_line`, in a thread, until the event is set."""
    stop = threading.Event()
    thread = threading.Thread(target=_tail_to, args=(path, start, on_line, stop), daemon=True)
    thread.start()
    return thread, stop


def follow_log_while(path: Path, on_line: Callable[[str], None], start: int, running: Callable[[], bool],
                     poll: float = 0.3) -> None:
    """follow_log until `running()` says the server is gone (or the caller is interrupted)."""
    thread, stop = follow_log(path, on_line, start)
    try:
        while running():
            time.sleep(poll)
    finally:
        stop.set()
        thread.join(2)


# --- stopping ---


def stop_process(proc: subprocess.Popen | psutil.Process, timeout: float = STOP_TIMEOUT,
                 force_after: float | None = None) -> str:
    """SIGTERM; with `force_after`, a second SIGTERM after that many s (llama-server then exits at once);
    SIGKILL after `timeout` s in all. Returns "stopped", "forced" (it took the second SIGTERM), "killed"
    or "not running"."""
    try:
        if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
            return "not running"
        proc.terminate()
        first = timeout if force_after is None else min(force_after, timeout)
        try:
            proc.wait(first)
            return "stopped"
        except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
            pass
        if force_after is not None and timeout > first:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout - first)
                return "forced"
            except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
                pass
        proc.kill()
        proc.wait()
        return "killed"
    except psutil.NoSuchProcess:
        return "stopped"


def describe_stop(result: str | None, force_after: float = FORCE_AFTER) -> str:
    """What stop_process did, in words: "stopped", or why it took more than one SIGTERM."""
    return {
        "forced": f"stopped with a second SIGTERM (still busy {force_after:g} s after the first; "
                  "open requests were cut)",
        "killed": "killed with SIGKILL (it did not exit on SIGTERM)",
    }.get(result or "", result or "not running")


def signal_name(code: int) -> str | None:
    """SIGKILL for -9 (how Popen reports a death by signal), else None."""
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int | None) -> str:
    """How a server ended, as `kvmem ps` and `kvmem run` say it."""
    if code is None:
        return "exited (exit code unknown)"
    if code == 0:
        return "exited (code 0)"
    name = signal_name(code)
    return f"crashed (exit code {code}, {name})" if name else f"crashed (exit code {code})"


# --- the process ---

Server = TypeVar("Server", bound="ServerProcess")


@dataclass
class ServerProcess:
    """A running llama-server: its argv, where it listens, and its log file (stdout + stderr).

    With `model_id` set, readiness also checks that /v1/models serves that id (and `ctx`); the
    tiering self-test runs a needle prompt longer than `budget` tokens.
    """

    argv: list[str]
    host: str
    port: int
    log_path: Path
    process: subprocess.Popen | None
    log_offset: int = 0  # where this run's lines begin in the (appended) log file
    model_id: str | None = None
    ctx: int | None = None
    budget: int = 0
    self_test: str | None = None  # what the self-test found, once it passed
    api_key: str | None = None  # sent as a bearer token by the readiness checks (from --api-key)
    server_pid: int | None = None  # under a monitor (detached): the server's pid; `process` is the monitor
    ready: bool = False  # wait_ready() passed
    stop_result: str | None = None  # what stop() had to do: stopped, forced, killed, not running
    _follower: threading.Event | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def spawn(cls: type[Server], argv: Sequence[str], log_path: Path, *, host: str, port: int, append: bool = False,
              banner: str | None = None, env: dict[str, str] | None = None,
              on_line: Callable[[str], None] | None = None, monitor_record: Path | None = None,
              **fields) -> Server:
        """Start `argv` in its own session, its output going to `log_path` (appended, or a new file).

        `banner` is written to the log first; `on_line` gets every line the server logs (an echo).
        With `monitor_record` (a registry record path) the server runs under serving.monitor, which
        outlives this process and writes the server's exit status into that record.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab" if append else "wb") as fh:
            if banner:
                fh.write(f"{banner}\n".encode())
            offset = fh.tell()
        full_env = {**os.environ, **env} if env else None
        command, pass_fds, pid_read = list(argv), (), None
        if monitor_record is not None:
            pid_read, pid_write = os.pipe()
            command = [sys.executable, "-m", "kvmem_llama.serving.monitor", "--record", str(monitor_record),
                       "--pid-fd", str(pid_write), "--", *argv]
            pass_fds = (pid_write,)
        logfh = open(log_path, "ab")
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=logfh, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=full_env, pass_fds=pass_fds)
        except OSError as exc:
            raise KvmemError(f"cannot start {argv[0]}: {exc}", hint="rebuild the engine: kvmem build --force") from None
        finally:
            logfh.close()  # the child has its own descriptor
            for fd in pass_fds:
                os.close(fd)
        server_pid = None
        if pid_read is not None:
            server_pid = _read_monitor_pid(pid_read, proc, argv[0])
        key = api_key_from(argv, full_env)
        server = cls(list(argv), host, port, log_path, proc, offset, **fields)
        server.api_key, server.server_pid = key, server_pid
        if on_line is not None:
            _, server._follower = follow_log(log_path, on_line, offset)
        return server

    @property
    def url(self) -> str:
        host = LOOPBACK if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid (not its monitor's)."""
        if self.server_pid is not None:
            return self.server_pid
        return self.process.pid if self.process else None

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this server sends: the bearer token when it was started with --api-key."""
        return bearer_headers(self.api_key)

    def log_text(self) -> str:
        """Everything this run logged so far."""
        return "\n".join(tail_lines(self.log_path, 10**9, self.log_offset))

    def tail(self, n: int = 20) -> list[str]:
        return tail_lines(self.log_path, n, self.log_offset)

    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM, a second SIGTERM after FORCE_AFTER s, SIGKILL after `timeout`; returns the exit code
        (under a monitor: the server's, which the monitor mirrors). Safe to call twice."""
        if self._follower is not None:
            self._follower.set()
        if self.process is None:
            return None
        if self.server_pid is None:
            self.stop_result = stop_process(self.process, timeout, FORCE_AFTER)
            return self.process.returncode
        if self.process.poll() is None:  # the monitor has not seen the server exit yet
            try:
                self.stop_result = stop_process(psutil.Process(self.server_pid), timeout, FORCE_AFTER)
            except psutil.NoSuchProcess:
                self.stop_result = "not running"
        try:
            return self.process.wait(10)
        except subprocess.TimeoutExpired:  # a stuck monitor: the server is gone, do not wait for it
            self.process.kill()
            return self.process.wait()

    def __enter__(self: Server) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def failed(self, message: str) -> ServerFailed:
        """The error to raise: the message, then the server's last log lines."""
        lines = "\n".join(self.tail(25))
        return ServerFailed(f"{message}\n--- last lines of {self.log_path} ---\n{lines}",
                            hint=f"full log: {self.log_path}", log_path=self.log_path)

    def wait_ready(self, timeout: float = 120.0, expect_ctx: int | None = None, self_test: bool = False,
                   on_status: Callable[[str], None] | None = None) -> None:
        """/health ok -> /v1/models lists our id (and context) -> tiering self-test. Raises ServerFailed."""
        deadline = time.monotonic() + timeout
        say = on_status or (lambda _msg: None)
        with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False, headers=self.headers) as http:
            say("waiting for /health")
            self._poll(http, "/health", deadline)
            if self.model_id is not None:
                say("checking /v1/models")
                self._check_model(self._poll(http, "/v1/models", deadline).json(), expect_ctx)
            if self_test:
                disabled = [d for line in self.tail(10**9) if (d := kvmem_log.parse_disabled(line))]
                if disabled:  # the engine fell back to untiered KV: the planned context would not fit the GPU
                    raise self.failed(
                        f"the engine disabled KV tiering ({disabled[-1]['reason']}), so the whole context needs "
                        "VRAM: lower the context (--ctx) or run a model the engine can tier")
                say("running the tiering self-test")
                self.self_test = self._run_self_test(http, deadline)
        self.ready = True

    def _check_model(self, models: dict, expect_ctx: int | None) -> None:
        entries = models.get("data", [])
        ids = {e.get("id") for e in entries} | {a for e in entries for a in e.get("aliases", []) or []}
        if self.model_id not in ids:
            raise self.failed(f"/v1/models lists {sorted(i for i in ids if i)}, not {self.model_id!r}")
        meta = next((e.get("meta", {}) for e in entries if e.get("id") == self.model_id), {})
        served_ctx = meta.get("n_ctx")
        want = slot_context(int(expect_ctx), self.argv, meta.get("n_ctx_train")) if expect_ctx else None
        if want and served_ctx and int(served_ctx) != want:
            shared = f" (-c {expect_ctx} over the parallel slots)" if want != int(expect_ctx) else ""
            raise self.failed(f"the server runs a context of {served_ctx}, expected {want}{shared}")
        if served_ctx:
            self.ctx = int(served_ctx)

    def _poll(self, http: httpx.Client, path: str, deadline: float) -> httpx.Response:
        last = ""
        while True:
            code = self.returncode()
            if code is not None:
                why = first_error(self.tail(200))
                raise self.failed(f"llama-server exited with code {code} while starting" + (f": {why}" if why else ""))
            try:
                resp = http.get(path)
                if resp.status_code == 200:
                    return resp
                if resp.status_code == 401:
                    raise self.failed(f"{path} answered 401 (invalid API key): the server was started with an API "
                                      "key that kvmem could not read from --api-key/--api-key-file")
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if time.monotonic() > deadline:
                raise self.failed(f"not ready: {path} did not answer 200 in time (last: {last})")
            time.sleep(0.25)

    def _run_self_test(self, http: httpx.Client, deadline: float) -> str:
        prompt, expected = self_test_prompt(self.budget)
        start = self.log_path.stat().st_size
        remaining = max(10.0, deadline - time.monotonic())
        try:
            resp = http.post("/v1/chat/completions", timeout=remaining, json={
                "model": self.model_id, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 16, "temperature": 0})
            resp.raise_for_status()
            answer = resp.json()["choices"][0]["message"].get("content") or ""
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise self.failed(f"the self-test request failed: {exc}") from None
        time.sleep(0.2)  # the log line is written by the server thread; let it land
        ok, why = check_self_test(answer, expected, "\n".join(tail_lines(self.log_path, 10**9, start)))
        if not ok:
            raise self.failed(f"tiering self-test failed: {why}")
        return why


def _read_monitor_pid(fd: int, monitor: subprocess.Popen, program: str, timeout: float = 30.0) -> int:
    """The server pid that serving.monitor writes to `fd` once it started the server ("error: ..." if it could not)."""
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(fd)
    text = data.decode("utf-8", errors="replace").strip()
    if text.isdigit():
        return int(text)
    if monitor.poll() is None:
        stop_process(monitor, 5)
    why = text.removeprefix("error: ") or f"the monitor exited with code {monitor.poll()} before starting it"
    raise KvmemError(f"cannot start {program}: {why}", hint="rebuild the engine: kvmem build --force")


def llama_server_argv(server: Path | str, model: Path | str, args: Sequence[str], host: str, port: int) -> list[str]:
    return [str(server), "-m", str(model), "--host", host, "--port", str(port), *args]


def start_llama_server(server: Path | str, model: Path | str, args: Sequence[str], log_path: Path, *,
                       port: int | None = None, host: str = LOOPBACK, timeout: float = 120.0,
                       kind: type[Server] = ServerProcess) -> Server:  # type: ignore[assignment]
    """Start an engine's llama-server on `model` with `args` (a free port by default) and wait for /health.

    The process is stopped again if it is not ready in `timeout` s (ServerFailed with its log).
    """
    port = port or free_port(host)
    srv = kind.spawn(llama_server_argv(server, model, args, host, port), log_path, host=host, port=port)
    try:
        srv.wait_ready(timeout)
    except BaseException:
        srv.stop()
        raise
    return srv
