"""Configurations to compare (tiering off / a budget / a method) and the servers that run them.

`kvmem eval --run MODEL` starts one llama-server per configuration (and per length when the
budget is a fraction of it) through `kvmem_llama.launcher.start_server` when that module is
present, else through a small built-in starter for the CPU engine. Every eval server runs one
slot (`-np 1`: one request at a time, so a request's log lines are its own) and, when tiered,
`--kvmem-trace` (the resident blocks after each selection, for the answer-block hit rate).

A configuration is `[METHOD:]BUDGET[:key=value...]`; each key=value becomes `--kvmem-<key>
<value>` (`retrieval:1/8:query-tokens=128`). Method names are not checked here: the engine
refuses one it does not have, and that refusal is reported.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import httpx

from kvmem_llama.errors import KvmemError

METHODS = ("retrieval", "recency")  # what engines have had from the start; others are the engine's to accept
METHOD_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
OPTION_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class Config:
    """One configuration: `budget` is 0 (tiering off), a fraction of the length, or tokens;
    `options` are extra engine flags, (key, value) -> `--kvmem-<key> <value>`."""

    budget: Fraction | int
    method: str = "retrieval"
    options: tuple[tuple[str, str], ...] = ()

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
        if self.off:
            return "off"
        # the options are part of the name: results of different settings must never merge
        return " ".join([self.budget_text, self.method, *(f"{k}={v}" for k, v in self.options)])

    def budget_tokens(self, length: int) -> int:
        if isinstance(self.budget, Fraction):
            return max(1, int(self.budget * length))
        return int(self.budget)

    def server_args(self, length: int) -> list[str]:
        """Engine flags for this configuration; tiering off passes none (works on any llama-server)."""
        if self.off:
            return []
        args = ["--kvmem-budget", str(self.budget_tokens(length)), "--kvmem-method", self.method]
        for key, value in self.options:
            args += [f"--kvmem-{key}", value]
        return args


def parse_length(text: str) -> int:
    """`4k` = 4096, `8K`, `1500`, `0.5k` = 512."""
    t = text.strip().lower()
    try:
        if t.endswith("k"):
            return int(float(t[:-1]) * 1024)
        return int(t)
    except ValueError:
        raise KvmemError(f"bad length {text!r}", hint="lengths are tokens: 4k, 8k, 1500") from None


def check_method(name: str, context: str | None = None) -> str:
    """A method name as the engine spells them (`[a-z][a-z0-9_]*`); whether it exists is the engine's call."""
    if not METHOD_NAME.match(name):
        where = f" in {context!r}" if context else ""
        raise KvmemError(f"bad method name {name!r}{where}",
                         hint=f"lower-case letters, digits and '_', e.g. {', '.join(METHODS)}")
    return name


def _is_budget(text: str) -> bool:
    return text == "off" or bool(re.match(r"^[0-9.]", text))


def parse_budgets(spec: str, method: str = "retrieval") -> list[Config]:
    """`0,1/8,1/16,recency:1/8,2048,retrieval:1/8:query-tokens=128` -> configurations.

    An entry is `[METHOD:]BUDGET[:key=value...]`; a method prefix overrides `method` (--method).
    """
    out: list[Config] = []
    check_method(method)
    for raw in spec.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        parts = [p.strip() for p in item.split(":")]
        how = method
        if len(parts) > 1 and not _is_budget(parts[0]):
            how = check_method(parts.pop(0), raw.strip())
        item = parts.pop(0)
        options: list[tuple[str, str]] = []
        for part in parts:
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or not OPTION_KEY.match(key) or not value.strip():
                raise KvmemError(f"bad engine option {part!r} in {raw.strip()!r}",
                                 hint="options are key=value, each passed as --kvmem-<key> <value>, "
                                      "e.g. retrieval:1/8:query-tokens=128")
            if key in ("budget", "method"):
                raise KvmemError(f"{key}= in {raw.strip()!r}: the entry itself sets --kvmem-{key}",
                                 hint="write it as METHOD:BUDGET, e.g. recency:1/8")
            options.append((key, value.strip()))
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
        if budget == 0 and options:
            raise KvmemError(f"{raw.strip()!r}: tiering off takes no engine options",
                             hint="options apply to a budgeted entry, e.g. 1/8:query-tokens=128")
        config = Config(budget, how, tuple(options))
        if config not in out:
            out.append(config)
    if not out:
        raise KvmemError("no budgets given", hint="e.g. --budgets 0,1/8,1/16")
    return out


# ---------------------------------------------------------------- starting servers

@dataclass
class Served:
    """A running server as the evaluation sees it: where to ask, and the log it writes."""

    url: str
    model_id: str
    log_path: Path | None = None
    log_offset: int = 0  # this run's lines begin here (the launcher appends to a per-name log)


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


def training_context(model: str) -> int | None:
    """The model's training context (GGUF `<arch>.context_length`); None when unknown."""
    try:
        from kvmem_llama import planner

        n = planner.shape_from_gguf(resolve_model(model)).n_ctx_train
    except Exception:  # unreadable metadata: let the server decide
        return None
    return int(n) or None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_REJECTED = re.compile(r"(invalid|unknown) argument:?\s*(--kvmem[\w-]*)")
# llama.cpp's arg parser on a value its handler throws on, e.g.
#   error while handling argument "--kvmem-method": --kvmem-method must be one of retrieval, recency (got 'x')
_REFUSED_VALUE = re.compile(r'error while handling argument "(?P<flag>--kvmem[\w-]*)":\s*(?P<why>[^\n]*)')


def rejected_flag(log: str) -> str | None:
    """The kvmem flag llama-server does not know, if that is why it stopped."""
    m = _REJECTED.search(log)
    return m.group(2) if m else None


def refused_value(log: str) -> tuple[str, str] | None:
    """(flag, the engine's reason) when llama-server stopped on a bad value of a kvmem flag."""
    m = _REFUSED_VALUE.search(log)
    return (m["flag"], m["why"].strip()) if m else None


def _rejection_error(flag: str) -> KvmemError:
    return KvmemError(f"this engine's llama-server does not know {flag}: it was built without KV tiering",
                      hint="rebuild the engine with the tiering patch series (`kvmem build`), "
                           "or compare tiering off only with --budgets 0")


def _refusal_error(flag: str, why: str) -> KvmemError:
    hint = "change that configuration in --budgets"
    if flag == "--kvmem-method":
        hint = "this engine build does not have that method: pick one it lists, or rebuild it (`kvmem build`)"
    return KvmemError(f"the engine refused {flag}: {why}", hint=hint)


def engine_refusal(log: str) -> KvmemError | None:
    """The error to report when a server's log says it refused one of our kvmem flags."""
    value = refused_value(log)
    if value:
        return _refusal_error(*value)
    flag = rejected_flag(log)
    return _rejection_error(flag) if flag else None


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
            refusal = engine_refusal(log)
            if refusal:
                raise refusal
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


def _has_flag(args: list[str], *names: str) -> bool:
    return any(a in names or a.split("=", 1)[0] in names for a in args)


def eval_args(config: Config, length: int, extra_args: list[str] | None = None) -> list[str]:
    """Every server flag of one eval server: the configuration's, ours, then the user's."""
    extra = list(extra_args or [])
    args = config.server_args(length)
    if not config.off and not _has_flag(extra, "--kvmem-trace"):
        args.append("--kvmem-trace")  # resident blocks per selection: the answer-block hit rate
    if not config.off and not _has_flag(extra, "-lv", "--verbosity", "--log-verbosity"):
        # the engine's kvmem_trace lines are libllama INFO, which llama-server shows from verbosity 4
        args += ["-lv", "4"]
    if not _has_flag(extra, "-np", "--parallel"):
        args += ["-np", "1"]  # one request at a time: a request's log lines are its own
    return [*args, *extra]


def _copy_log(src: Path, start: int, dest: Path) -> None:
    # the launcher logs under its own state folder; keep this run's part next to the results
    with contextlib.suppress(OSError):
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as fin, open(dest, "ab") as fout:
            fin.seek(start)
            while chunk := fin.read(1 << 20):
                fout.write(chunk)


@contextlib.contextmanager
def serve(model: str, config: Config, length: int, ctx: int, log_path: Path,
          extra_args: list[str] | None = None, ready_timeout: float = 300.0,
          name: str | None = None, on_start: Callable[[Callable[[], None]], None] | None = None,
          engine: str | None = None) -> Iterator[Served]:
    """Start a server for `config` at `length`; yields a `Served`; stops it afterwards.

    With the launcher the server logs under the launcher's state folder (under `name`, which
    must be unique among servers running at once); its lines are copied to `log_path` at the end.
    `on_start` receives a function that stops the server (for stopping it from another thread).
    `engine` picks the launcher's engine (a key of `kvmem engines`, "cpu" or "gpu"; default: by GPU).
    """
    args = eval_args(config, length, extra_args)
    try:
        from kvmem_llama.launcher import start_server  # the real launcher, once present
    except ImportError:
        start_server = None
    if start_server is None:
        if engine not in (None, "cpu"):
            raise KvmemError(f"--engine {engine} needs kvmem's launcher; the built-in starter runs the CPU engine only")
        started = _fallback_start(model, extra_args=args, ctx=ctx, log_path=log_path, ready_timeout=ready_timeout)
        if on_start is not None:
            on_start(started.stop)
        try:
            yield Served(started.url, started.model_id, started.log_path, 0)
        finally:
            started.stop()
        return

    options: dict = {}
    if _accepts(start_server, "self_test"):
        # the launcher's readiness self-test costs a request and adds SELECT lines; recency-only
        # is meant to miss its needle; here the evaluation itself measures recall
        options["self_test"] = False
    if name and _accepts(start_server, "name"):
        options["name"] = name
    if engine:
        options["engine"] = engine

    def start(flags: list[str]):
        try:
            return start_server(model, extra_args=flags, ctx=ctx, ready_timeout=ready_timeout, **options)
        except Exception as exc:  # the launcher's own errors, refined when a kvmem flag was refused
            refusal = engine_refusal(str(exc))
            if refusal is None:
                log = getattr(exc, "log_path", None)
                if log is None and getattr(exc, "hint", None) and "full log: " in str(exc.hint):
                    log = str(exc.hint).split("full log: ", 1)[1].strip()
                if log:
                    with contextlib.suppress(OSError):
                        refusal = engine_refusal(Path(log).read_text("utf-8", errors="replace")[-20000:])
            if refusal:
                raise refusal from None
            raise

    handle = start(args)
    if config.off and getattr(handle, "budget", 0):
        # the launcher's plan turned tiering on by itself; "off" must mean off
        handle.stop()
        handle = start(["--kvmem-budget", "0", *args])
    if on_start is not None:
        on_start(handle.stop)
    try:
        with handle:
            yield Served(handle.url, handle.model_id, Path(handle.log_path), int(getattr(handle, "log_offset", 0)))
    finally:
        if Path(handle.log_path) != log_path:
            _copy_log(Path(handle.log_path), int(getattr(handle, "log_offset", 0)), log_path)
