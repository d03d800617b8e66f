"""llama-server argv: the flag groups kvmem sets, merging layers (plan < sampling profile < user
flags), the sampling profiles, whether tiering is on, and what an engine's `--help` offers.

A user flag replaces every spelling of the same flag that an earlier layer set (`--ctx-size=4096`
replaces `-c 8192`); flags kvmem does not know pass through untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
from collections.abc import Mapping, Sequence

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
)
SWITCHES = {"--strict-model-id"}  # flags of ours that take no value
_GROUP_OF = {flag: group[0] for group in FLAG_GROUPS for flag in group}


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


def refuse_download_flags(args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Stop before the engine starts when llama-server would have to download over HTTPS (-hf, ...)."""
    env = os.environ if env is None else env
    items = list(args)
    for i, arg in enumerate(items):
        flag, eq, inline = arg.partition("=")
        value = inline if eq else (items[i + 1] if i + 1 < len(items) else "")
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


def flag_key(arg: str) -> str | None:
    """The group a command-line token belongs to (`--ctx-size=4096` -> `-c`), or None for non-flags."""
    if not arg.startswith("-") or arg[1:2].isdigit():
        return None
    name = arg.split("=", 1)[0]
    return _GROUP_OF.get(name, name)


def user_flags(args: Sequence[str]) -> dict[str, str | None]:
    """{group key: value} of the flags kvmem sets itself, found in a user's llama-server arguments."""
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

    Unknown flags pass through untouched. Values are recognised for kvmem's own flags only.
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
        if profile.gpu_type == "same" and profile.ctk not in planner.UNQUANTIZED \
                and supports(help_text, "--kvmem-gpu-type"):
            args += ["--kvmem-gpu-type", "same"]  # the plan's budget counts a quantized working set
    if profile.draft_mtp and "draft-mtp" in help_text:
        args += ["--spec-type", "draft-mtp"]
    return args


def sampling_args(mode: str) -> list[str]:
    try:
        profile = SAMPLING_PROFILES[mode]
    except KeyError:
        raise KvmemError(f"unknown mode {mode!r}", hint=f"one of: {', '.join(SAMPLING_PROFILES)}") from None
    return [item for flag, value in profile.items() for item in (flag, f"{value:g}")]


# the engine's defaults for the flags that size a tiered working set (llama-server --help)
KVMEM_DEFAULTS = {"--kvmem-block": 128, "--kvmem-sink": 128, "--kvmem-recent": 256, "--kvmem-gen-reserve": 256}
_SPELLINGS = {"-np": "--parallel"}


def _last_values(args: Sequence[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    items = list(args)
    for i, arg in enumerate(items):
        flag, eq, inline = arg.partition("=")
        flag = _SPELLINGS.get(flag, flag)
        if flag in KVMEM_DEFAULTS or flag in ("--parallel", "--kvmem-budget"):
            values[flag] = inline if eq else (items[i + 1] if i + 1 < len(items) else "")
    return values


def slots_at_once(budget: int, n_parallel: int, block: int, sink: int, recent: int, gen_reserve: int) -> int:
    """How many slots the tiered working set serves at once: the engine's llama_kvmem_max_active().

    The working set has budget + n_parallel x gen_reserve cells; each slot reading a prompt or generating keeps
    at least sink + recent + 2 blocks (its floor share) plus an open block or its generation reserve. llama-server
    lets no more slots than that work at once; further requests wait for one to finish.
    """
    blocks = lambda tokens: -(-tokens // block)  # noqa: E731
    per_slot = (blocks(sink) + blocks(recent) + 2) * block + max(block, gen_reserve)
    return max(1, (budget + n_parallel * gen_reserve) // per_slot)


def parallel_tiering_warning(args: Sequence[str], budget: int) -> str | None:
    """A warning when the tiered working set cannot serve all -np N slots at once: the server then lets only
    some slots work and further requests wait (the engine's admission rule, slots_at_once). None when all
    fit, or with one slot."""
    values = _last_values(args)
    try:
        n = int(values.get("--parallel", "-1"))
        sizes = {flag: int(values.get(flag, default)) for flag, default in KVMEM_DEFAULTS.items()}
    except ValueError:
        return None
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
