"""Launch llama-server the way `kvmem run` does: engine by GPU, argv from plan < profile < user
flags, a log file per server, and readiness that means "answers correctly", not "listens".

Library use (the eval harness does this):

    with start_server("smollm2", ctx=4096) as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="-").chat.completions.create(model=srv.model_id, ...)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvmem_llama import hardware, kvmem_log, planner, servers
from kvmem_llama.engine import Engine, check_engine_for_gpu, list_engines, select_engine  # noqa: F401
from kvmem_llama.errors import KvmemError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
SAMPLING_PROFILES: dict[str, dict[str, float]] = {
    # at 0.7 agents repeat a failing tool call forever; tool use wants a colder sampler
    "chat": {"--temp": 0.7, "--top-p": 0.9, "--top-k": 20, "--presence-penalty": 0.0},
    "tool": {"--temp": 0.2, "--top-p": 0.8, "--top-k": 20, "--presence-penalty": 0.05},
}
# Spellings of the flags the launcher sets itself: a user flag in the same group replaces ours.
FLAG_GROUPS: tuple[tuple[str, ...], ...] = (
    ("-m", "--model"), ("-a", "--alias"), ("--host",), ("--port",), ("-c", "--ctx-size"),
    ("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v"), ("-fa", "--flash-attn"),
    ("-ngl", "--gpu-layers", "--n-gpu-layers"), ("--temp", "--temperature"), ("--top-p",), ("--top-k",),
    ("--presence-penalty",), ("--spec-type",), ("--strict-model-id",), ("--rpc",),
    ("--kvmem-budget",), ("--kvmem-block",), ("--kvmem-gen-reserve",), ("--kvmem-host-mib",),
    ("--kvmem-sink",), ("--kvmem-recent",), ("--kvmem-refresh",), ("--kvmem-method",),
)
SWITCHES = {"--strict-model-id"}  # flags of ours that take no value
_GROUP_OF = {flag: group[0] for group in FLAG_GROUPS for flag in group}


# --- models ---


@dataclass
class ResolvedModel:
    path: Path
    alias: str
    entry: Any = None


def resolve_model(name_or_path: str | None, pull: bool = False,
                  confirm: Callable[[str], bool] | None = None) -> ResolvedModel:
    """A model name or file -> (path, model id, catalog entry). Uses kvmem_llama.models when present."""
    try:
        from kvmem_llama.models import resolve_model as catalog_resolve  # the model store and catalog
    except ImportError:
        catalog_resolve = None
    if name_or_path is None:
        if catalog_resolve is not None:
            with contextlib.suppress(KvmemError):
                got = catalog_resolve("smollm2", pull=pull, confirm=confirm)
                return ResolvedModel(Path(got.path), got.alias or "smollm2", got.entry)
        from kvmem_llama.default_model import default_model_path

        return ResolvedModel(default_model_path(), "smollm2")
    if catalog_resolve is not None:
        got = catalog_resolve(name_or_path, pull=pull, confirm=confirm)
        path = Path(got.path)
        return ResolvedModel(path, got.alias or servers.slug(path.stem), got.entry)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return ResolvedModel(path.resolve(), servers.slug(path.stem))
    from kvmem_llama.shipped import SHIPPED, shipped_model_path

    if name_or_path in SHIPPED:
        return ResolvedModel(shipped_model_path(name_or_path), name_or_path)
    raise KvmemError(f"no model file or known model named {name_or_path!r}",
                     hint=f"give a .gguf path or one of: {', '.join(SHIPPED)}")


# --- engines ---


def engine_help(engine: Engine) -> str:
    return _help_text(str(engine.server), engine.server.stat().st_mtime if engine.server.exists() else 0.0)


@functools.lru_cache(maxsize=8)
def _help_text(server: str, _mtime: float) -> str:
    try:
        out = subprocess.run([server, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KvmemError(f"cannot run {server} --help: {exc}", hint="rebuild the engine: kvmem build --force") from None
    return out.stdout + out.stderr


def supports(help_text: str, flag: str) -> bool:
    """Does `llama-server --help` list this flag (as a whole word)?"""
    import re

    return re.search(rf"(^|[\s,]){re.escape(flag)}(?=[\s,=]|$)", help_text, re.MULTILINE) is not None


# --- argv ---


def flag_key(arg: str) -> str | None:
    """The group a command-line token belongs to (`--ctx-size=4096` -> `-c`), or None for non-flags."""
    if not arg.startswith("-") or arg[1:2].isdigit():
        return None
    name = arg.split("=", 1)[0]
    return _GROUP_OF.get(name, name)


def user_flags(args: Sequence[str]) -> dict[str, str | None]:
    """{group key: value} of the flags the launcher knows in a user's llama-server arguments."""
    found: dict[str, str | None] = {}
    items = list(args)
    for i, arg in enumerate(items):
        key = flag_key(arg)
        if key is None or key not in {g[0] for g in FLAG_GROUPS}:
            continue
        if "=" in arg:
            found[key] = arg.split("=", 1)[1]
        elif key in SWITCHES:
            found[key] = None
        else:
            nxt = items[i + 1] if i + 1 < len(items) else None
            found[key] = nxt if nxt is not None and flag_key(nxt) is None else None
    return found


def merge_args(*layers: Sequence[str]) -> list[str]:
    """Concatenate argument layers (plan, profile, user); a later layer's flag drops earlier ones of its group.

    Unknown flags pass through untouched. Values are recognised for the launcher's own flags only.
    """
    out: list[str] = []
    for layer in layers:
        overridden = set(user_flags(layer))
        if overridden:
            kept: list[str] = []
            skip_value = False
            for arg in out:
                if skip_value:
                    skip_value = False
                    if flag_key(arg) is None:
                        continue
                key = flag_key(arg)
                if key in overridden:
                    skip_value = "=" not in arg and key not in SWITCHES
                    continue
                kept.append(arg)
            out = kept
        out.extend(layer)
    return out


def profile_args(profile: planner.Profile, help_text: str, tiering: bool, has_gpu: bool) -> list[str]:
    """The plan's flags, for what this engine supports."""
    args = ["-c", str(profile.ctx), "-ctk", profile.ctk, "-ctv", profile.ctv]
    if profile.ctv not in ("f16", "bf16", "f32"):
        args += ["-fa", "on"]  # a quantized V cache needs flash attention
    if has_gpu:
        args += ["-ngl", str(profile.n_gpu_layers if profile.n_gpu_layers is not None else 999)]
    if tiering and profile.budget > 0:
        args += ["--kvmem-budget", str(profile.budget), "--kvmem-block", str(profile.block),
                 "--kvmem-gen-reserve", str(profile.gen_reserve)]
        if profile.host_mib and supports(help_text, "--kvmem-host-mib"):
            args += ["--kvmem-host-mib", str(profile.host_mib)]
    if profile.draft_mtp and "draft-mtp" in help_text:
        args += ["--spec-type", "draft-mtp"]
    return args


def sampling_args(mode: str) -> list[str]:
    try:
        profile = SAMPLING_PROFILES[mode]
    except KeyError:
        raise KvmemError(f"unknown mode {mode!r}", hint=f"one of: {', '.join(SAMPLING_PROFILES)}") from None
    return [item for flag, value in profile.items() for item in (flag, f"{value:g}")]


# --- ports ---


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like the server: TIME_WAIT is fine
        try:
            sock.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        except OSError:
            return True
    return False


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pick_port(host: str, port: int | str | None) -> int:
    if port in (None, ""):
        port = DEFAULT_PORT
    if str(port) == "auto":
        return free_port(host)
    try:
        number = int(port)
    except ValueError:
        raise KvmemError(f"invalid port {port!r}", hint="a number, or --port auto") from None
    if port_in_use(host, number):
        owner = next((r.name for r in servers.list_records() if r.port == number and r.alive), None)
        who = f" by kvmem server {owner!r}" if owner else ""
        hint = f"kvmem stop {owner}, or " if owner else ""
        raise KvmemError(f"port {number} on {host} is already in use{who}", hint=f"{hint}pass --port auto or --port N")
    return number


# --- readiness ---


class ServerFailed(KvmemError):
    """The server exited or did not become ready; the message carries its last log lines."""


def tail_lines(path: Path | str, n: int = 20, start: int = 0) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-n:]


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


@dataclass
class ServerHandle:
    name: str
    host: str
    port: int
    model_id: str
    model_path: Path
    ctx: int | None
    budget: int
    log_path: Path
    argv: list[str]
    engine: Engine
    process: subprocess.Popen | None
    detached: bool = False
    log_offset: int = 0  # where this run's lines begin in the (appended) log file
    self_test: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    _tail_stop: threading.Event | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def log_text(self) -> str:
        return "\n".join(tail_lines(self.log_path, 10**9, self.log_offset))

    def tail(self, n: int = 20) -> list[str]:
        return tail_lines(self.log_path, n, self.log_offset)

    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, SIGKILL after `timeout`; returns the exit code. Safe to call twice."""
        if self._tail_stop is not None:
            self._tail_stop.set()
        proc = self.process
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            code = proc.returncode
        record = servers.load(self.name)
        if record is not None and record.pid == self.pid:
            servers.remove(self.name)
        return code

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 120.0, expect_ctx: int | None = None, self_test: bool = False,
                   on_status: Callable[[str], None] | None = None) -> None:
        """/health ok -> /v1/models lists our id (and context) -> tiering self-test. Raises ServerFailed."""
        deadline = time.monotonic() + timeout
        say = on_status or (lambda _msg: None)
        with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as http:
            say("waiting for /health")
            self._poll(http, "/health", deadline, "health")
            say("checking /v1/models")
            models = self._poll(http, "/v1/models", deadline, "models").json()
            entries = models.get("data", [])
            ids = {e.get("id") for e in entries} | {a for e in entries for a in e.get("aliases", []) or []}
            if self.model_id not in ids:
                raise self._failed(f"/v1/models lists {sorted(i for i in ids if i)}, not {self.model_id!r}")
            served_ctx = next((e.get("meta", {}).get("n_ctx") for e in entries if e.get("id") == self.model_id), None)
            if expect_ctx and served_ctx and int(served_ctx) != int(expect_ctx):
                raise self._failed(f"the server runs a context of {served_ctx}, expected {expect_ctx}")
            if served_ctx:
                self.ctx = int(served_ctx)
            if self_test:
                disabled = [d for line in tail_lines(self.log_path, 10**9) if (d := kvmem_log.parse_disabled(line))]
                if disabled:  # the engine fell back to untiered KV: the planned context would not fit the GPU
                    raise self._failed(
                        f"the engine disabled KV tiering ({disabled[-1]['reason']}), so the whole context needs "
                        "VRAM: lower the context (--ctx) or run a model the engine can tier")
                say("running the tiering self-test")
                self.self_test = self._run_self_test(http, deadline)

    def _poll(self, http: httpx.Client, path: str, deadline: float, what: str) -> httpx.Response:
        last = ""
        while True:
            code = self.returncode()
            if code is not None:
                raise self._failed(f"llama-server exited with code {code} while starting")
            try:
                resp = http.get(path)
                if resp.status_code == 200:
                    return resp
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if time.monotonic() > deadline:
                raise self._failed(f"not ready: {path} did not answer 200 in time (last: {last})")
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
            raise self._failed(f"the self-test request failed: {exc}") from None
        time.sleep(0.2)  # the log line is written by the server thread; let it land
        ok, why = check_self_test(answer, expected, "\n".join(tail_lines(self.log_path, 10**9, start)))
        if not ok:
            raise self._failed(f"tiering self-test failed: {why}")
        return why

    def _failed(self, message: str) -> ServerFailed:
        lines = "\n".join(self.tail(25))
        return ServerFailed(f"{message}\n--- last lines of {self.log_path} ---\n{lines}",
                            hint=f"full log: {self.log_path}")


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
    stop = threading.Event()
    thread = threading.Thread(target=_tail_to, args=(path, start, on_line, stop), daemon=True)
    thread.start()
    return thread, stop


def decide_tiering(profile: planner.Profile, help_text: str,
                   given: dict[str, str | None]) -> tuple[planner.Profile, bool, int, list[str]]:
    """(profile to launch, tiering on?, budget in tokens, notes) for this engine and the user's flags.

    Tiering is on when the plan wants a budget and the engine lists --kvmem-budget, or when the
    user passes a non-zero --kvmem-budget. Without engine support the context shrinks to what fits.
    """
    notes: list[str] = []
    tiering = profile.budget > 0 and supports(help_text, "--kvmem-budget")
    if profile.budget > 0 and not tiering:
        fitted = profile.budget + profile.gen_reserve
        notes.append(f"this engine has no --kvmem-budget (KV tiering): context lowered from {profile.ctx} to {fitted}")
        profile = dataclasses.replace(profile, ctx=fitted, budget=0, gen_reserve=0, host_mib=0)
    budget = profile.budget if tiering else 0
    if "--kvmem-budget" in given:  # the user's own tiering settings win
        value = str(given["--kvmem-budget"] or "")
        tiering = value.isdigit() and int(value) > 0
        budget = int(value) if tiering else 0
    return profile, tiering, budget, notes


@dataclass
class LaunchPlan:
    """Everything decided before the process starts (what `kvmem run --dry-run` prints)."""

    model: ResolvedModel
    engine: Engine
    hardware: hardware.Hardware
    plan: planner.Plan
    argv: list[str]
    host: str
    port: int
    model_id: str
    ctx: int | None
    budget: int
    tiering: bool
    self_test: bool
    notes: list[str]


def prepare(model: str | None = None, *, extra_args: Sequence[str] = (), ctx: int | None = None,
            port: int | str | None = None, host: str = DEFAULT_HOST, mode: str = "chat",
            ctk: str | None = None, ctv: str | None = None, engine: str | None = None,
            rpc: str | None = None, hw: hardware.Hardware | None = None, pull: bool = False,
            confirm: Callable[[str], bool] | None = None, self_test: bool = True,
            draft_mtp: bool | None = None) -> LaunchPlan:
    """Resolve model + engine, plan memory and build the argv: plan < profile < user flags."""
    resolved = resolve_model(model, pull=pull, confirm=confirm)
    hw = hw or hardware.detect()
    chosen = select_engine(hw, engine)
    if not chosen.server.exists():
        raise KvmemError(f"engine {chosen.key} has no llama-server binary", hint="kvmem build --force")
    help_text = engine_help(chosen)
    on_gpu = bool(chosen.sms)
    plan_hw = hw if on_gpu else dataclasses.replace(hw, gpus=[])
    shape = planner.shape_from_gguf(resolved.path, name=resolved.alias)
    notes: list[str] = []
    gpu = plan_hw.gpu()
    recommended = None
    if gpu is not None and resolved.entry is not None and hasattr(resolved.entry, "profile_for"):
        recommended = resolved.entry.profile_for(gpu.vram_total / planner.GiB)
    if recommended and not (ctk or ctv):  # the catalog's tested KV types for this VRAM tier
        ctk, ctv = recommended.get("ctk"), recommended.get("ctv")
        notes.append(f"catalog profile for {recommended.get('min_vram_gib')}+ GiB: -ctk {ctk} -ctv {ctv}")
    plan = planner.plan(shape, plan_hw, ctx=ctx, ctk=ctk, ctv=ctv, draft_mtp=draft_mtp)
    profile = plan.profile
    notes += plan.warnings
    user = list(extra_args)
    given = user_flags(user)
    profile, tiering, budget, why = decide_tiering(profile, help_text, given)
    notes += why
    host = str(given.get("--host") or host)
    port_num = pick_port(host, given.get("--port") or port)
    model_id = (given.get("-a") or resolved.alias).split(",")[0].strip()
    base = profile_args(profile, help_text, tiering, on_gpu or bool(rpc))  # with --rpc, layers go to the RPC devices
    ours = ["-m", str(resolved.path), "--alias", model_id, "--host", host, "--port", str(port_num)]
    if supports(help_text, "--strict-model-id"):
        ours.append("--strict-model-id")
    if rpc:
        ours += ["--rpc", rpc]
    argv = [str(chosen.server), *merge_args(base + ours, sampling_args(mode), user)]
    user_ctx = given.get("-c")
    run_ctx = int(user_ctx) if user_ctx and str(user_ctx).isdigit() else profile.ctx
    if run_ctx == 0:
        run_ctx = None  # "0 = from the model": take what the server reports
    return LaunchPlan(resolved, chosen, hw, plan, argv, host, port_num, model_id, run_ctx, budget, tiering,
                      self_test and tiering and budget > 0, notes)


def launch(lp: LaunchPlan, *, name: str | None = None, detach: bool = False,
           on_line: Callable[[str], None] | None = None, env: dict[str, str] | None = None) -> ServerHandle:
    """Start the planned server with its output going to its log file (appended, never lost)."""
    name = servers.check_name(name) if name else servers.unique_name(lp.model_id)
    existing = servers.load(name)
    if existing is not None and existing.alive:
        raise KvmemError(f"a server named {name!r} is already running (pid {existing.pid}, port {existing.port})",
                         hint=f"kvmem stop {name}, or pick another --name")
    log_path = servers.log_path(name)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as fh:
        fh.write(f"=== kvmem: starting {name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                 f"{' '.join(lp.argv)}\n".encode())
        offset = fh.tell()
    logfh = open(log_path, "ab")
    try:
        proc = subprocess.Popen(lp.argv, stdin=subprocess.DEVNULL, stdout=logfh, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
    except OSError as exc:
        raise KvmemError(f"cannot start {lp.argv[0]}: {exc}", hint="rebuild the engine: kvmem build --force") from None
    finally:
        logfh.close()  # the child has its own descriptor
    handle = ServerHandle(name, lp.host, lp.port, lp.model_id, lp.model.path, lp.ctx, lp.budget, log_path,
                          lp.argv, lp.engine, proc, detach, offset, notes=list(lp.notes))
    create_time = None
    with contextlib.suppress(Exception):
        import psutil

        create_time = psutil.Process(proc.pid).create_time()
    servers.save(servers.ServerRecord(name, proc.pid, lp.host, lp.port, lp.model_id, str(lp.model.path), lp.ctx,
                                      lp.budget, str(log_path), lp.argv, lp.engine.key, detach,
                                      create_time=create_time))
    if on_line is not None:
        _, handle._tail_stop = follow_log(log_path, on_line, offset)
    return handle


def start_server(model: str | None = None, *, extra_args: Sequence[str] = (), ctx: int | None = None,
                 port: int | str | None = None, ready_timeout: float = 120.0, name: str | None = None,
                 mode: str = "chat", host: str = DEFAULT_HOST, detach: bool = False,
                 on_line: Callable[[str], None] | None = None, **prepare_kw) -> ServerHandle:
    """Start a ready llama-server (library API). Stop it with `.stop()` or use it as a context manager.

    `port` None picks a free one. Raises ServerFailed (with the last log lines) if the server exits
    or is not ready within `ready_timeout` seconds; the process is stopped then. `prepare_kw` goes to
    prepare(): ctk, ctv, engine, rpc, hw, pull, confirm, self_test (False skips the tiering needle test).
    """
    lp = prepare(model, extra_args=extra_args, ctx=ctx, port="auto" if port is None else port, host=host,
                 mode=mode, **prepare_kw)
    handle = launch(lp, name=name, detach=detach, on_line=on_line)
    try:
        handle.wait_ready(ready_timeout, expect_ctx=lp.ctx, self_test=lp.self_test)
    except BaseException:
        handle.stop()
        raise
    return handle


def attach(name: str) -> servers.ServerRecord:
    return servers.require(name)
