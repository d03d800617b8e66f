"""Configurations to compare (tiering off / a budget / a method) and the servers that run them.

`kvmem eval --run MODEL` starts one llama-server per configuration (and per length when the
budget is a fraction of it) through `kvmem_llama.launcher.start_server` when that module is
present, else through a small built-in starter for the CPU engine.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import httpx

from kvmem_llama.errors import KvmemError

METHODS = ("retrieval", "recency")


@dataclass(frozen=True)
class Config:
    """One configuration: `budget` is 0 (tiering off), a fraction of the length, or tokens."""

    budget: Fraction | int
    method: str = "retrieval"

    @property
    def off(self) -> bool:
        return self.budget == 0

    @property
    def per_length(self) -> bool:
        return isinstance(self.budget, Fraction)

    @property
    def budget_text(self) -> str:
        if self.off:
            return "0"
        if isinstance(self.budget, Fraction):
            return f"{self.budget.numerator}/{self.budget.denominator}"
        return str(self.budget)

    @property
    def label(self) -> str:
        return "off" if self.off else f"{self.budget_text} {self.method}"

    def budget_tokens(self, length: int) -> int:
        if isinstance(self.budget, Fraction):
            return max(1, int(self.budget * length))
        return int(self.budget)

    def server_args(self, length: int) -> list[str]:
        """Engine flags for this configuration; tiering off passes none (works on any llama-server)."""
        if self.off:
            return []
        return ["--kvmem-budget", str(self.budget_tokens(length)), "--kvmem-method", self.method]


def parse_length(text: str) -> int:
    """`4k` = 4096, `8K`, `1500`, `0.5k` = 512."""
    t = text.strip().lower()
    try:
        if t.endswith("k"):
            return int(float(t[:-1]) * 1024)
        return int(t)
    except ValueError:
        raise KvmemError(f"bad length {text!r}", hint="lengths are tokens: 4k, 8k, 1500") from None


def parse_budgets(spec: str, method: str = "retrieval") -> list[Config]:
    """`0,1/8,1/16,recency:1/8,2048` -> configurations (a `method:` prefix overrides --method)."""
    out: list[Config] = []
    for raw in spec.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        how = method
        if ":" in item:
            how, item = (p.strip() for p in item.split(":", 1))
        if how not in METHODS:
            raise KvmemError(f"unknown method {how!r} in {raw.strip()!r}", hint=f"methods: {', '.join(METHODS)}")
        if item in ("0", "off"):
            budget: Fraction | int = 0
        elif "/" in item or "." in item:
            try:
                budget = Fraction(item)
            except (ValueError, ZeroDivisionError):
                raise KvmemError(f"bad budget {raw.strip()!r}", hint="e.g. 1/8, 0.125, 2048, 4k or 0") from None
            if not 0 < budget <= 1:
                raise KvmemError(f"budget fraction {raw.strip()!r} is not in (0, 1]")
        else:
            budget = parse_length(item)
        config = Config(budget, how)
        if config not in out:
            out.append(config)
    if not out:
        raise KvmemError("no budgets given", hint="e.g. --budgets 0,1/8,1/16")
    return out


# ---------------------------------------------------------------- starting servers

@dataclass
class _Started:
    url: str
    model_id: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def resolve_model(model: str) -> Path:
    """A GGUF path, or the name of a shipped model (smollm2, qwen2.5-coder:0.5b, ...)."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    from kvmem_llama.shipped import SHIPPED, shipped_model_path

    if model in SHIPPED:
        return shipped_model_path(model)
    raise KvmemError(f"no model {model!r}", hint=f"a GGUF file or one of: {', '.join(SHIPPED)}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_REJECTED = re.compile(r"(invalid|unknown) argument:?\s*(--kvmem[\w-]*)")


def rejected_flag(log: str) -> str | None:
    """The kvmem flag llama-server refused, if that is why it stopped."""
    m = _REJECTED.search(log)
    return m.group(2) if m else None


def _rejection_error(flag: str) -> KvmemError:
    return KvmemError(f"this engine's llama-server does not know {flag}: it was built without KV tiering",
                      hint="rebuild the engine with the tiering patch series (`kvmem build`), "
                           "or compare tiering off only with --budgets 0")


def _fallback_start(model: str, *, extra_args: list[str], ctx: int | None, log_path: Path,
                    ready_timeout: float) -> _Started:
    from kvmem_llama.engine import require_engine

    engine = require_engine("cpu")
    path = resolve_model(model)
    port = _free_port()
    cmd = [str(engine.server), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(os.cpu_count() or 2), "-np", "1"]
    if ctx:
        cmd += ["-c", str(ctx)]
    cmd += extra_args
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as logfh:
        proc = subprocess.Popen(cmd, stdout=logfh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    started = _Started(f"http://127.0.0.1:{port}", path.name, proc, log_path)
    deadline = time.monotonic() + ready_timeout
    while True:
        if proc.poll() is not None:
            log = log_path.read_text("utf-8", errors="replace")
            flag = rejected_flag(log)
            if flag:
                raise _rejection_error(flag)
            raise KvmemError(f"llama-server exited with code {proc.returncode}:\n{log[-1500:]}",
                             hint=f"full log: {log_path}")
        try:
            if httpx.get(f"{started.url}/health", timeout=2).status_code == 200:
                return started
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            started.stop()
            raise KvmemError(f"llama-server was not ready after {ready_timeout:.0f}s", hint=f"log: {log_path}")
        time.sleep(0.25)


def _accepts(func, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@contextlib.contextmanager
def serve(model: str, config: Config, length: int, ctx: int, log_path: Path,
          extra_args: list[str] | None = None, ready_timeout: float = 300.0) -> Iterator[tuple[str, str]]:
    """Start a server for `config` at `length`; yields (url, model id); stops it afterwards."""
    args = [*config.server_args(length), *(extra_args or [])]
    try:
        from kvmem_llama.launcher import start_server  # the real launcher, once present
    except ImportError:
        start_server = None
    if start_server is None:
        started = _fallback_start(model, extra_args=args, ctx=ctx, log_path=log_path, ready_timeout=ready_timeout)
        try:
            yield started.url, started.model_id
        finally:
            started.stop()
        return

    options: dict = {}
    if config.method == "recency" and not config.off and _accepts(start_server, "self_test"):
        # the launcher's readiness self-test asks for a needle beyond the recent window: recency-only
        # is meant to miss it; here the evaluation itself measures recall
        options["self_test"] = False

    def start(flags: list[str]):
        try:
            return start_server(model, extra_args=flags, ctx=ctx, ready_timeout=ready_timeout, **options)
        except Exception as exc:  # the launcher's own errors, refined when a kvmem flag was refused
            flag = rejected_flag(str(exc))
            if flag:
                raise _rejection_error(flag) from None
            raise

    handle = start(args)
    if config.off and getattr(handle, "budget", 0):
        # the launcher's plan turned tiering on by itself; "off" must mean off
        handle.stop()
        handle = start(["--kvmem-budget", "0", *args])
    with handle:
        yield handle.url, handle.model_id
