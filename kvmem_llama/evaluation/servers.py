"""Configurations to compare (tiering off / a budget / a method) and the servers that run them.

`kvmem eval --run MODEL` starts one llama-server per configuration (and per length when the
budget is a fraction of it) through `kvmem_llama.serving.launch.start_server`, as `kvmem run`
does. Every eval server runs one slot (`-np 1`: one request at a time, so a request's log lines
are its own) and, when tiered, `--kvmem-trace` (the resident blocks after each selection, for the
answer-block hit rate).

A configuration is `[METHOD:]BUDGET[:key=value...]`; each key=value becomes `--kvmem-<key>
<value>` (`retrieval:1/8:query-tokens=128`). Method names are not checked here: the engine
refuses one it does not have, and that refusal is reported.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from kvmem_llama.errors import KvmemError
from kvmem_llama.models import resolve_model
from kvmem_llama.models.gguf_info import model_info
from kvmem_llama.serving import argv
from kvmem_llama.serving.launch import ServerHandle, start_server
from kvmem_llama.serving.process import ServerFailed

METHODS = ("retrieval", "recency")  # what engines have had from the start; others are the engine's to accept
METHOD_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
OPTION_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


# the engine's defaults for --kvmem-block, --kvmem-sink and --kvmem-recent (llama-kvmem-params.h)
ENGINE_BLOCK, ENGINE_SINK, ENGINE_RECENT = 128, 128, 256


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

    def min_budget(self) -> int:
        """The smallest budget the engine takes with these options (argv.floor_budget)."""
        opts = dict(self.options)
        try:
            block, sink, recent = (int(opts.get(k, d)) for k, d in
                                   (("block", ENGINE_BLOCK), ("sink", ENGINE_SINK), ("recent", ENGINE_RECENT)))
        except ValueError:
            return 0  # not numbers: the engine's own check says so
        return argv.floor_budget(block, sink, recent) if block > 0 else 0

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
    log_offset: int = 0  # this run's lines begin here (a registered server appends to its per-name log)


def training_context(model: str) -> int | None:
    """The model's training context (GGUF `<arch>.context_length`); None when the header does not say."""
    return model_info(resolve_model(model).path).native_ctx or None


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


def _has_flag(args: list[str], *names: str) -> bool:
    keys = {argv.flag_key(name) for name in names}
    return any(use.flag in keys for use in argv.scan_flags(args))


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
    # registered servers log under the registry's folder; keep this run's part next to the results
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

    The server logs under the server registry's folder (under `name`, which must be unique among
    servers running at once); its lines are copied to `log_path` at the end.
    `on_start` receives a function that stops the server (for stopping it from another thread).
    `engine` picks the engine (a key of `kvmem engines`, "cpu" or "gpu"; default: the one for this GPU).
    """
    args = eval_args(config, length, extra_args)

    def start(flags: list[str]) -> ServerHandle:
        # no readiness self-test: it costs a request and adds SELECT lines, and recency-only is meant
        # to miss its needle; here the evaluation itself measures recall
        try:
            return start_server(model, extra_args=flags, ctx=ctx, ready_timeout=ready_timeout, self_test=False,
                                name=name, engine=engine)
        except ServerFailed as exc:  # refined when the engine refused one of our kvmem flags
            log = exc.log_path.read_text("utf-8", errors="replace")[-20000:] if exc.log_path else ""
            refusal = engine_refusal(str(exc)) or engine_refusal(log)
            if refusal:
                raise refusal from None
            raise

    handle = start(args)
    if config.off and handle.budget:
        # the plan turned tiering on by itself (the KV does not fit the GPU); "off" must mean off
        handle.stop()
        handle = start(["--kvmem-budget", "0", *args])
    if on_start is not None:
        on_start(handle.stop)
    try:
        with handle:
            yield Served(handle.url, handle.model_id, handle.log_path, handle.log_offset)
    finally:
        if handle.log_path != log_path:
            _copy_log(handle.log_path, handle.log_offset, log_path)
