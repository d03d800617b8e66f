"""llama-server argv: the one scanner of its flags and values (scan_flags), the flag groups kvmem
sets, merging layers (plan < sampling profile < user flags), the sampling profiles, whether tiering
is on, what an argv asks for (API key, download flags, the context of one request), and what an
engine's `--help` offers.

A user flag replaces every spelling of the same flag that an earlier layer set (`--ctx-size=4096`
replaces `-c 8192`); flags kvmem does not know pass through untouched. Every reading of an argv
goes through scan_flags, so `-np 4`, `--parallel=4` and a switch mean the same everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from kvmem_llama import planner
from kvmem_llama.engine import Engine
from kvmem_llama.errors import KvmemError

SAMPLING_PROFILES: dict[str, dict[str, float]] = {
    # at 0.7 agents repeat a failing tool call forever; tool use wants a colder sampler
    "chat": {"--temp": 0.7, "--top-p": 0.9, "--top-k": 20, "--presence-penalty": 0.0},
    "tool": {"--temp": 0.2, "--top-p": 0.8, "--top-k": 20, "--presence-penalty": 0.05},
}
# Spellings of the flags kvmem sets itself: a user flag in the same group replaces ours.
FLAG_GROUPS: tuple[tuple[str, ...], ...] = (
    ("-m", "--model"), ("-a", "--alias"), ("--host",), ("--port",), ("-c", "--ctx-size"),
    ("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v"), ("-fa", "--flash-attn"),
    ("-ngl", "--gpu-layers", "--n-gpu-layers"), ("--temp", "--temperature"), ("--top-p",), ("--top-k",),
    ("--presence-penalty",), ("--spec-type",), ("--strict-model-id",), ("--rpc",),
    ("--kvmem-budget",), ("--kvmem-block",), ("--kvmem-gen-reserve",), ("--kvmem-host-mib",),
    ("--kvmem-sink",), ("--kvmem-recent",), ("--kvmem-refresh",), ("--kvmem-method",),
    ("--kvmem-disk-path",), ("--kvmem-disk-mib",), ("-mm", "--mmproj"), ("--no-mmproj-offload",),
)
SWITCHES = {"--strict-model-id", "--kvmem-lazy-restore", "--no-mmproj-offload"}  # flags we read that take no value
_GROUP_OF = {flag: group[0] for group in FLAG_GROUPS for flag in group}
_GROUP_KEYS = {group[0] for group in FLAG_GROUPS}


# llama-server flags (and env twins) that download a model themselves, always over HTTPS: the engine
# is built without OpenSSL, so they fail late with "HTTPS is not supported"; kvmem pull does it instead.
DOWNLOAD_FLAGS: dict[str, str] = {
    "-hf": "LLAMA_ARG_HF_REPO", "-hfr": "LLAMA_ARG_HF_REPO", "--hf-repo": "LLAMA_ARG_HF_REPO",
    "-hfd": "LLAMA_ARG_SPEC_DRAFT_HF_REPO", "-hfrd": "LLAMA_ARG_SPEC_DRAFT_HF_REPO",
    "--hf-repo-draft": "LLAMA_ARG_SPEC_DRAFT_HF_REPO", "--spec-draft-hf": "LLAMA_ARG_SPEC_DRAFT_HF_REPO",
    "-dr": "LLAMA_ARG_DOCKER_REPO", "--docker-repo": "LLAMA_ARG_DOCKER_REPO",
}
URL_FLAGS: dict[str, str] = {"-mu": "LLAMA_ARG_MODEL_URL", "--model-url": "LLAMA_ARG_MODEL_URL",
                             "-mmu": "LLAMA_ARG_MMPROJ_URL", "--mmproj-url": "LLAMA_ARG_MMPROJ_URL"}
# Flags whose value is the next argument whatever it looks like, as llama-server reads it: an API key may
# begin with "-", and a refusal quotes what would have been downloaded.
_ANY_VALUE = {"--api-key", "--api-key-file", *DOWNLOAD_FLAGS, *URL_FLAGS}


class FlagUse(NamedTuple):
    """One flag of an argv: its key (flag_key), its value (None: a switch, or none given), its tokens."""

    flag: str
    value: str | None
    start: int  # index of the flag's token
    stop: int  # one past its last token: start + 2 when the value is the next token


def flag_key(arg: str) -> str | None:
    """The key of a command-line token: its group (`--ctx-size=4096` -> `-c`), its long spelling
    (`-np` -> `--parallel`), else its name; None for non-flags (values, negative numbers)."""
    if not arg.startswith("-") or arg[1:2].isdigit():
        return None
    name = arg.split("=", 1)[0]
    return _GROUP_OF.get(name) or _SPELLINGS.get(name, name)


def scan_flags(args: Sequence[str]) -> Iterator[FlagUse]:
    """Every flag of a llama-server argv with its value: `--flag=value`, `--flag value` (the next token,
    when it is not itself a flag), None for a switch (SWITCHES) or a flag with no value after it.

    kvmem does not know the arity of every llama-server flag, so a flag of unknown arity takes a following
    non-flag token as its value; a flag of _ANY_VALUE takes the next token even when it looks like a flag,
    and that token is then scanned as a flag too (the readers of those flags never look at other flags).
    """
    items = list(args)
    for i, arg in enumerate(items):
        key = flag_key(arg)
        if key is None:
            continue
        _, eq, inline = arg.partition("=")
        nxt = items[i + 1] if i + 1 < len(items) else None
        if eq:
            yield FlagUse(key, inline, i, i + 1)
        elif key in SWITCHES or nxt is None or (key not in _ANY_VALUE and flag_key(nxt) is not None):
            yield FlagUse(key, None, i, i + 1)
        else:
            yield FlagUse(key, nxt, i, i + 2)


def refuse_download_flags(args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Stop before the engine starts when llama-server would have to download over HTTPS (-hf, ...)."""
    env = os.environ if env is None else env
    for use in scan_flags(args):
        flag, value = use.flag, use.value or ""
        if flag in DOWNLOAD_FLAGS or (flag in URL_FLAGS and value.lower().startswith("https:")):
            _refuse(flag, value)
    for flag, var in {**DOWNLOAD_FLAGS, **URL_FLAGS}.items():
        value = env.get(var, "")
        if value and (flag in DOWNLOAD_FLAGS or value.lower().startswith("https:")):
            _refuse(f"{var} (env twin of {flag})", value)


def _refuse(what: str, value: str) -> None:
    repo = value.split(":", 1)[0] if "/" in value and "://" not in value else "OWNER/REPO"
    raise KvmemError(f"{what} {value}: llama-server would download over HTTPS, which kvmem's engines are built "
                     "without (no OpenSSL)",
                     hint=f"kvmem pull {repo}:FILE.gguf (or an alias from `kvmem search`), then "
                          f"`kvmem run {repo}:FILE.gguf` or `kvmem serve -m PATH`")


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """What a client of a server started with --api-key sends (nothing without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def api_key_from(args: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """The (first) API key a llama-server started with `args` asks for: --api-key K1,K2 or --api-key-file
    (one key a line, # comments), else their env twins LLAMA_API_KEY / LLAMA_ARG_API_KEY_FILE."""
    env = os.environ if env is None else env
    key = key_file = None
    for use in scan_flags(args):
        if use.flag == "--api-key":
            key = use.value or ""
        elif use.flag == "--api-key-file":
            key_file = use.value or ""
    if key is None and key_file is None:
        key, key_file = env.get("LLAMA_API_KEY"), env.get("LLAMA_ARG_API_KEY_FILE")
    if key:
        return key.split(",")[0].strip() or None
    if key_file:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError:
            return None
        return next((line.strip() for line in lines if line.strip() and not line.startswith("#")), None)
    return None


def slot_context(ctx: int, args: Sequence[str], n_ctx_train: int | None = None) -> int:
    """The context of one request (what /v1/models reports as n_ctx) of llama-server -c `ctx` with `args`:
    -np N (N > 1) splits it N ways unless the KV cache is unified (--kv-unified), and caps each slot at the
    model's training context. One slot, or -np auto (4 unified slots), keeps `ctx`: a context beyond the
    training one, which llama-server caps, is then refused by the readiness check, not served silently."""
    slots, unified = -1, None
    for use in scan_flags(args):
        if use.flag == "--parallel":  # -np too (flag_key)
            value = use.value or ""
            slots = int(value) if value.lstrip("-").isdigit() else slots
        elif use.flag in ("--kv-unified", "-kvu"):
            unified = True
        elif use.flag in ("--no-kv-unified", "-no-kvu"):
            unified = False
    if slots <= 1:
        return ctx
    share = ctx if unified else ctx // slots
    return min(share, n_ctx_train) if n_ctx_train else share


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
    return re.search(rf"(^|[\s,]){re.escape(flag)}(?=[\s,=]|$)", help_text, re.MULTILINE) is not None


def user_flags(args: Sequence[str]) -> dict[str, str | None]:
    """{group key: value} of the flags kvmem sets itself, found in a user's llama-server arguments (the last wins)."""
    return {use.flag: use.value for use in scan_flags(args) if use.flag in _GROUP_KEYS}


def merge_args(*layers: Sequence[str]) -> list[str]:
    """Concatenate argument layers (plan, profile, user); a later layer's flag drops earlier ones of its group.

    Unknown flags pass through untouched. Values are recognised for kvmem's own flags only.
    """
    out: list[str] = []
    for layer in layers:
        overridden = set(user_flags(layer))
        if overridden:
            dropped = {i for use in scan_flags(out) if use.flag in overridden for i in range(use.start, use.stop)}
            out = [arg for i, arg in enumerate(out) if i not in dropped]
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
        if profile.gpu_type == "same" and profile.ctk not in planner.UNQUANTIZED \
                and supports(help_text, "--kvmem-gpu-type"):
            args += ["--kvmem-gpu-type", "same"]  # the plan's budget counts a quantized working set
        if profile.score_on == "host" and supports(help_text, "--kvmem-score-on"):
            args += ["--kvmem-score-on", "host"]  # the plan gave the summaries' VRAM to the working set
    if profile.draft_mtp and "draft-mtp" in help_text:
        args += ["--spec-type", "draft-mtp"]
    return args


def attended_kv_pair(command: Sequence[str], tiering: bool) -> str:
    """The K-V type pair flash attention reads on the GPU for this server command: the cache types, or f16 where a
    tiered working set stands in for a quantized pool (--kvmem-gpu-type f16, the default)."""
    flags = user_flags(command)
    k, v = str(flags.get("-ctk") or "f16"), str(flags.get("-ctv") or "f16")
    same = any(use.flag == "--kvmem-gpu-type" and use.value == "same" for use in scan_flags(command))
    if tiering and not same:
        k, v = planner.working_type(k, "f16"), planner.working_type(v, "f16")
    return f"{k}-{v}"


def missing_fa_kernels(engine_fa_quants: Sequence[str] | None, command: Sequence[str], tiering: bool) -> str | None:
    """Why this GPU engine would attend on the CPU: its build has no flash-attention kernel for the pair the
    command attends with (build-info's fa_quants; None or ["all"]: every pair). None when it has one."""
    if not engine_fa_quants or "all" in engine_fa_quants:
        return None
    pair = attended_kv_pair(command, tiering)
    if pair in engine_fa_quants or pair.replace("f32", "f16") in engine_fa_quants:
        return None
    return (f"this engine has no GPU flash-attention kernel for K/V {pair.replace('-', '/')} (it was built with "
            f"{', '.join(engine_fa_quants)}): attention would run on the CPU")


# the disk tier kvmem run gives a capped host pool: this many times the pool, within this share of the free space
DISK_TIER_POOLS = 2
DISK_TIER_FREE_SHARE = 0.5
DISK_TIER_MIN_MIB = 1024


def disk_tier_args(host_mib: int, folder: Path, free_bytes: int) -> tuple[list[str], str]:
    """The disk tier under a capped host pool (--kvmem-host-mib): idle conversations wait there instead of being
    dropped when the pool is full. The flags, and a note when the disk has too little room for one."""
    if host_mib <= 0:
        return [], ""  # a pool sized for the whole context is never full
    mib = min(DISK_TIER_POOLS * host_mib, int(free_bytes * DISK_TIER_FREE_SHARE) // 2**20)
    if mib < DISK_TIER_MIN_MIB:
        return [], (f"no disk tier: {folder} has {free_bytes / 2**30:.1f} GiB free; idle conversations are dropped "
                    "when the host KV pool is full")
    return ["--kvmem-disk-path", str(folder), "--kvmem-disk-mib", str(mib)], ""


def sampling_args(mode: str) -> list[str]:
    try:
        profile = SAMPLING_PROFILES[mode]
    except KeyError:
        raise KvmemError(f"unknown mode {mode!r}", hint=f"one of: {', '.join(SAMPLING_PROFILES)}") from None
    return [item for flag, value in profile.items() for item in (flag, f"{value:g}")]


# the engine's defaults for the flags that size a tiered working set (llama-server --help)
KVMEM_SIZE_FLAGS = ("--kvmem-block", "--kvmem-sink", "--kvmem-recent", "--kvmem-gen-reserve")


def kvmem_defaults(help_text: str) -> dict[str, int]:
    """The engine's defaults of its --kvmem-* flags, as its --help prints them ("(default: 128)"): the engine is
    the one place they are set (llama-kvmem-params.h), and these are what a server started without the flag uses."""
    out: dict[str, int] = {}
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^\s*(-{1,2}[\w-]+)", help_text, re.M)]
    for (start, flag), (end, _) in zip(starts, [*starts[1:], (len(help_text), "")], strict=True):
        found = re.search(r"\(default:\s*(-?\d+)", help_text[start:end])
        if flag.startswith("--kvmem-") and found:
            out[flag] = int(found.group(1))
    return out
_SPELLINGS = {"-np": "--parallel"}


def floor_budget(block: int, sink: int, recent: int) -> int:
    """The smallest budget the engine takes (kvmem_min_budget): the sink and the recent window in whole blocks, one
    retrieved block and the partial tail; also each busy slot's floor share of the working set."""
    blocks = lambda tokens: -(-tokens // block)  # noqa: E731
    return (blocks(sink) + blocks(recent) + 2) * block


def slots_at_once(budget: int, n_parallel: int, block: int, sink: int, recent: int, gen_reserve: int) -> int:
    """How many slots the tiered working set serves at once: the engine's llama_kvmem_max_active().

    The working set has budget + n_parallel x gen_reserve cells; each slot reading a prompt or generating keeps
    at least sink + recent + 2 blocks (its floor share) plus an open block or its generation reserve. llama-server
    lets no more slots than that work at once; further requests wait for one to finish.
    """
    per_slot = floor_budget(block, sink, recent) + max(block, gen_reserve)
    return max(1, (budget + n_parallel * gen_reserve) // per_slot)


def parallel_tiering_warning(args: Sequence[str], budget: int, defaults: dict[str, int]) -> str | None:
    """A warning when the tiered working set cannot serve all -np N slots at once: the server then lets only
    some slots work and further requests wait (the engine's admission rule, slots_at_once). None when all
    fit, or with one slot. defaults: the engine's (kvmem_defaults)."""
    values = {use.flag: use.value or "" for use in scan_flags(args)}  # the last of each flag wins
    try:
        n = int(values.get("--parallel", "-1"))
        sizes = {flag: int(values.get(flag, defaults[flag])) for flag in KVMEM_SIZE_FLAGS}
    except (ValueError, KeyError):
        return None
    if sizes["--kvmem-block"] <= 0:
        return None  # the engine refuses it at startup with its own message
    slots = f"-np {n}"
    if n < 0:  # llama-server's auto: 4 slots over one unified KV cache
        n, slots = 4, "-np auto (4 slots)"
    if n <= 1 or budget <= 0:
        return None
    block, sink, recent, reserve = (sizes["--kvmem-block"], sizes["--kvmem-sink"], sizes["--kvmem-recent"],
                                    sizes["--kvmem-gen-reserve"])
    served = slots_at_once(budget, n, block, sink, recent, reserve)
    if served >= n:
        return None
    need = budget
    while slots_at_once(need, n, block, sink, recent, reserve) < n:
        need += block
    return (f"{slots} with --kvmem-budget {budget}: the GPU working set serves {served} slot"
            f"{'s' if served > 1 else ''} at once (each keeps at least sink + recent + 2 blocks and an open block "
            f"or its --kvmem-gen-reserve), so further requests wait until one finishes; use --kvmem-budget {need} "
            f"to serve all {n} at once")


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
