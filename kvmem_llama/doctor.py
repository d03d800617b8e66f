"""`kvmem doctor`: the checks that explain most failed launches, each with its fix.

Order matters: the first three (GPU architecture vs engine, model format, checksum) explain
most reports; the CPU variant ggml loads is reported next to the architecture; then paths, host RAM,
port and driver.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmem_llama import cpu_backend, hardware, models, planner
from kvmem_llama.engine import Engine, select_engine
from kvmem_llama.errors import KvmemError
from kvmem_llama.files import sha256_file
from kvmem_llama.models.gguf_info import ModelInfo, model_info
from kvmem_llama.serving.launch import DEFAULT_HOST, DEFAULT_PORT
from kvmem_llama.serving.process import port_in_use


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # numbers behind the detail, for --json

    def to_dict(self) -> dict:
        return asdict(self)


_VOCAB_ONLY_LOAD = """
import sys
from kvmem_llama.binding import ffi, load_library, recent_log
lib = load_library(sys.argv[1])
params = lib.llama_model_default_params()
params.vocab_only = True
model = lib.llama_model_load_from_file(sys.argv[2].encode(), params)
print("".join(recent_log(60)))
if model == ffi.NULL:
    sys.exit(3)
lib.llama_model_free(model)
"""


def engine_reads(engine: Engine, path: Path | str, timeout: float = 120) -> tuple[bool, str]:
    """Does this engine's libllama load the file's architecture and hyperparameters? (vocab-only load)

    Runs in a child process: libllama is bound once per process, and a failed load must not
    take the caller down. Returns (ok, the engine's error line or "").
    """
    try:
        out = subprocess.run([sys.executable, "-c", _VOCAB_ONLY_LOAD, str(engine.libllama), str(path)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"loading the vocabulary took more than {timeout:.0f} s"
    if out.returncode == 0:
        return True, ""
    lines = (out.stdout + out.stderr).splitlines()
    errors = [ln.split("error loading model: ", 1)[-1] for ln in lines if "error" in ln.lower()]
    return False, (errors[0] if errors else (lines[-1] if lines else f"exit code {out.returncode}")).strip()


def cpu_check(engine: Engine) -> Check:
    """Which CPU variant the engine runs on this machine, and that none of its libraries has the AMX matmul."""
    choice = cpu_backend.choose_variant(engine.path)
    facts = {"cpu_variant": choice.chosen, "cpu_variant_scores": choice.scores}
    amx = cpu_backend.modules_with_amx(engine.path)
    if amx:
        return Check("cpu", "fail", f"{choice.describe()}; {', '.join(p.name for p in amx)} contains ggml's AMX "
                     "matmul, which crashes on Sapphire-Rapids-class CPUs", "rebuild the engine: `kvmem build`",
                     facts=facts)
    if choice.error or (choice.scores and choice.chosen is None):
        return Check("cpu", "fail", choice.describe(), "rebuild the engine here: `kvmem build`", facts=facts)
    if not choice.scores:
        return Check("cpu", "warn", choice.describe(), "`kvmem build` makes a portable engine", facts=facts)
    return Check("cpu", "ok", choice.describe() + ", no AMX", facts=facts)


def model_facts(info: ModelInfo) -> dict[str, Any]:
    """The model's shape as the planner and `kvmem inspect` see it (one ModelInfo for all three)."""
    return {"arch": info.arch, "n_layers": info.n_layers, "n_attention_layers": info.n_attention_layers,
            "kv_bytes_per_token": info.kv_bytes_per_token}


def _non_ascii(label_paths: dict[str, str]) -> list[str]:
    return [f"{label}: {p}" for label, p in label_paths.items() if p and not p.isascii()]


def run_checks(model: str | None = None, *, port: int = DEFAULT_PORT, ctx: int | None = None,
               engine: str | None = None, host: str = DEFAULT_HOST,
               hw: hardware.Hardware | None = None) -> list[Check]:
    checks: list[Check] = []
    hw = hw or hardware.detect()

    # 1. architecture: the engine has kernels for this GPU
    chosen: Engine | None = None
    try:
        chosen = select_engine(hw, engine)
        if chosen.sms:
            gpu = hw.gpu()
            checks.append(Check("architecture", "ok", f"{gpu.name if gpu else '?'} sm_{gpu.sm if gpu else '?'}; "
                                f"engine {chosen.key} has sm_{', sm_'.join(chosen.sms)}"))
        else:
            where = "no NVIDIA GPU" if not hw.has_gpu else "forced CPU engine"
            checks.append(Check("architecture", "ok", f"{where}: CPU engine {chosen.key}"))
    except KvmemError as exc:
        checks.append(Check("architecture", "fail", str(exc), exc.hint))

    # the CPU backend variant ggml loads here (CPU engines, and the layers a CUDA engine leaves on the CPU)
    if chosen is not None:
        checks.append(cpu_check(chosen))

    # 2. format: a GGUF this engine reads
    resolved = None
    info = None
    try:
        resolved = models.resolve_model(model)
        info = model_info(resolved.path)
        readable, why = engine_reads(chosen, resolved.path) if chosen is not None else (True, "")
        if not readable:
            unknown = "unknown model architecture" in why
            checks.append(Check("format", "fail", f"GGUF v{info.gguf_version}, architecture {info.arch!r}: engine "
                                f"{chosen.key} cannot load it ({why})",
                                "update kvmem (a newer llama.cpp pin), or use a supported model" if unknown else
                                "the file is damaged or from an incompatible converter: pull it again"))
            info = None
        else:
            kv = info.kv_bytes_per_token.get("f16")
            per_token = f", KV {kv:,} B/token at f16" if kv else ""
            checks.append(Check("format", "ok", f"GGUF v{info.gguf_version}, architecture {info.arch}; "
                                f"{info.n_layers} layers, {info.n_attention_layers} with KV{per_token}",
                                facts=model_facts(info)))
    except KvmemError as exc:
        checks.append(Check("format", "fail", str(exc), exc.hint))

    # 3. checksum: the file is the one that was verified when it was stored
    if resolved is not None and resolved.path.is_file():
        expected, source = models.expected_sha256(resolved)
        if expected is None:
            checks.append(Check("checksum", "skip", "no recorded sha256 for this file",
                                "record one: `kvmem import PATH --alias NAME`, then `kvmem doctor NAME`"))
        else:
            got = sha256_file(resolved.path)
            if got == expected:
                checks.append(Check("checksum", "ok", f"sha256 {got[:16]}... matches the {source}"))
            else:
                checks.append(Check("checksum", "fail",
                                    f"sha256 {got[:16]}... but the {source} says {expected[:16]}...",
                                    f"the file is damaged or replaced: delete {resolved.path} and pull it again"))
    else:
        checks.append(Check("checksum", "skip", "no model file"))

    # 4. paths: non-ASCII characters break some tools and Windows builds of llama.cpp
    odd = _non_ascii({"model": str(resolved.path) if resolved else "", "engine": str(chosen.path) if chosen else "",
                      "cwd": os.getcwd()})
    if odd:
        bad = "fail" if platform.system() == "Windows" else "warn"
        checks.append(Check("paths", bad, "non-ASCII characters in " + "; ".join(odd),
                            "move the file/directory to a plain ASCII path (or set KVMEM_HOME to one)"))
    else:
        checks.append(Check("paths", "ok", "model, engine and working directory paths are ASCII"))

    # 5. host RAM for the plan (host KV pool on a GPU, everything on the CPU)
    if info is not None:
        plan_hw = hw if chosen is not None and chosen.sms else hardware.Hardware(
            [], hw.ram_total, hw.ram_available, hw.cpu_count)
        plan = planner.plan(info, plan_hw, ctx=ctx, label=resolved.name if resolved else None)
        prof = plan.profile
        need = prof.host_mib * planner.MiB if prof.budget else \
            info.trunk_weights_bytes + info.kv_bytes(prof.ctk, prof.ctv) * prof.ctx
        short = [w for w in plan.warnings if "RAM" in w or "lowered" in w]
        detail = f"needs ~{need / planner.GiB:.2f} GiB of {hw.ram_available / planner.GiB:.1f} GiB available " \
                 f"(ctx {prof.ctx:,}, {'host pool' if prof.budget else 'weights + KV'})"
        if plan.fixes:
            checks.append(Check("host RAM", "fail", detail + "; " + "; ".join(plan.warnings), "; ".join(plan.fixes)))
        elif short:
            checks.append(Check("host RAM", "warn", detail + "; " + "; ".join(short), "lower --ctx or the KV type"))
        else:
            checks.append(Check("host RAM", "ok", detail))
    else:
        checks.append(Check("host RAM", "skip", "no readable model"))

    # 6. port
    if port_in_use(host, port):
        checks.append(Check("port", "fail", f"port {port} on {host} is in use",
                            "kvmem run --port auto (or stop what holds it: `kvmem ps`, `kvmem stop NAME`)"))
    else:
        checks.append(Check("port", "ok", f"port {port} on {host} is free"))

    # 7. driver / CUDA
    if not hw.has_gpu:
        checks.append(Check("driver", "skip", f"no NVIDIA driver in use ({hw.nvml_error or 'no GPU'})"))
    else:
        built = (chosen.info.get("cuda") if chosen else None) or None
        detail = f"driver {hw.driver}, supports CUDA {hw.cuda_driver}"
        if built:
            detail += f"; engine built with CUDA {built}"
        try:
            too_old = built and hw.cuda_driver and int(str(built).split(".")[0]) > int(hw.cuda_driver.split(".")[0])
        except ValueError:
            too_old = False
        if too_old:
            checks.append(Check("driver", "fail", detail,
                                f"update the NVIDIA driver to one for CUDA {built} (580 or newer)"))
        else:
            checks.append(Check("driver", "ok", detail))
    return checks
