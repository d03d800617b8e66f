"""The one place that starts and stops llama-server: a process with its log file, readiness that
means "answers correctly", the tiering self-test, stop (SIGTERM, then SIGKILL), and the log's tail.

`kvmem run` (through serving.launch), `kvmem bench`, `kvmem eval`, the tests and the GPU checks all
start their servers here:

    with start_llama_server(engine.server, model, ["-c", "4096"], log_path) as srv:
        httpx.post(srv.url + "/completion", json={"prompt": "Hello", "n_predict": 8})
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import subprocess
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

LOOPBACK = "127.0.0.1"
STOP_TIMEOUT = 15.0  # seconds between SIGTERM and SIGKILL


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


def stop_process(proc: subprocess.Popen | psutil.Process, timeout: float = STOP_TIMEOUT) -> str:
    """SIGTERM, then SIGKILL after `timeout` s. Returns "stopped", "killed" or "not running"."""
    try:
        if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
            return "not running"
        proc.terminate()
        try:
            proc.wait(timeout)
            return "stopped"
        except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
            proc.kill()
            proc.wait()
            return "killed"
    except psutil.NoSuchProcess:
        return "stopped"


# --- the tiering self-test ---

NEEDLE_FILLER = (
    "The archive room held shelves of ledgers about grain, weather and river tolls.",
    "Clerks copied each entry twice so that a flood could never erase the record.",
    "Visitors signed a book at the door and left their lanterns on a stone bench.",
    "Every autumn the council audited the tolls and argued about the bridge repairs.",
)


def self_test_prompt(budget: int, seed: int | None = None) -> tuple[str, str]:
    """(prompt, expected answer): a needle in filler about 1.5x the budget in tokens (~16 tokens a sentence)."""
    rng = random.Random(seed)
    code = str(rng.randint(1000, 9999))
    sentences = max(8, int(budget * 1.5 / 16))
    lines = [NEEDLE_FILLER[i % len(NEEDLE_FILLER)] for i in range(sentences)]
    lines.insert(max(1, sentences // 4), f"Remember this: the vault code is {code}.")
    question = "\n\nQuestion: what is the vault code? Answer with the four digits only."
    return " ".join(lines) + question, code


def check_self_test(answer: str, expected: str, log_text: str) -> tuple[bool, str]:
    """Did the needle come back, and did the engine log a retrieval (SELECT with scored blocks)?"""
    picks = kvmem_log.selects(log_text)
    state = kvmem_log.tiering_state(log_text)
    if state.startswith("disabled"):
        return False, f"the engine turned tiering off ({state.split(': ', 1)[1]})"
    if not picks:
        return False, "no `kvmem_score: SELECT` line appeared in the log for the self-test prompt"
    if expected not in answer:
        return False, f"the self-test answer {answer.strip()[:80]!r} does not contain the needle {expected}"
    last = picks[-1]
    return True, (f"needle found; SELECT n_blocks={last['n_blocks']} budget_blocks={last['budget_blocks']} "
                  f"staged_in={last['staged_in']} ms={last['ms']:g}")


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
    _follower: threading.Event | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def spawn(cls: type[Server], argv: Sequence[str], log_path: Path, *, host: str, port: int, append: bool = False,
              banner: str | None = None, env: dict[str, str] | None = None,
              on_line: Callable[[str], None] | None = None, **fields) -> Server:
        """Start `argv` in its own session, its output going to `log_path` (appended, or a new file).

        `banner` is written to the log first; `on_line` gets every line the server logs (an echo).
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab" if append else "wb") as fh:
            if banner:
                fh.write(f"{banner}\n".encode())
            offset = fh.tell()
        logfh = open(log_path, "ab")
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=logfh, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, **env} if env else None)
        except OSError as exc:
            raise KvmemError(f"cannot start {argv[0]}: {exc}", hint="rebuild the engine: kvmem build --force") from None
        finally:
            logfh.close()  # the child has its own descriptor
        server = cls(list(argv), host, port, log_path, proc, offset, **fields)
        if on_line is not None:
            _, server._follower = follow_log(log_path, on_line, offset)
        return server

    @property
    def url(self) -> str:
        host = LOOPBACK if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

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
        """SIGTERM, SIGKILL after `timeout`; returns the exit code. Safe to call twice."""
        if self._follower is not None:
            self._follower.set()
        if self.process is None:
            return None
        stop_process(self.process, timeout)
        return self.process.returncode

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
        with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as http:
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

    def _check_model(self, models: dict, expect_ctx: int | None) -> None:
        entries = models.get("data", [])
        ids = {e.get("id") for e in entries} | {a for e in entries for a in e.get("aliases", []) or []}
        if self.model_id not in ids:
            raise self.failed(f"/v1/models lists {sorted(i for i in ids if i)}, not {self.model_id!r}")
        served_ctx = next((e.get("meta", {}).get("n_ctx") for e in entries if e.get("id") == self.model_id), None)
        if expect_ctx and served_ctx and int(served_ctx) != int(expect_ctx):
            raise self.failed(f"the server runs a context of {served_ctx}, expected {expect_ctx}")
        if served_ctx:
            self.ctx = int(served_ctx)

    def _poll(self, http: httpx.Client, path: str, deadline: float) -> httpx.Response:
        last = ""
        while True:
            code = self.returncode()
            if code is not None:
                raise self.failed(f"llama-server exited with code {code} while starting")
            try:
                resp = http.get(path)
                if resp.status_code == 200:
                    return resp
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
