"""The engine store: built or installed engines (`engines/<key>/{bin,lib,include,licenses}` +
build-info.json), which one runs on this machine, and the one rule for CUDA compatibility.

Which GPUs a CUDA engine runs on (kvmem_llama/data/sm_matrix.json lists the targets we build):
- a target `NN` is compiled as `NN-real`: machine code (SASS) for compute capability N.N and no
  PTX. CUDA runs such code on a GPU of the same major version with an equal or newer minor, so
  `86` runs on 8.6, 8.7 and 8.9, but not on 8.0 (older minor) or 9.0 (another major);
- a target with an `a` suffix (`120a`, consumer Blackwell) is arch-specific: it runs on exactly
  that compute capability (12.0), not on 12.1;
- anything else fails at the first kernel with "no kernel image is available for execution on
  the device", which is why an engine is refused before it starts.
`kvmem engines install` and `kvmem run` both ask `check_engine_for_gpus`, so they accept and
refuse the same engines; each matrix target's `runs_on` list says the same in data.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvmem_llama import hardware, paths
from kvmem_llama.errors import KvmemError
from kvmem_llama.files import atomic_directory, sha256_file
from kvmem_llama.patching import Series, load_series
from kvmem_llama.vendor import Pin, load_pin

# installed name -> name in the build's bin/
INSTALLED_BINARIES = {
    "llama-server": "llama-server",
    "llama-cli": "llama-cli",
    "llama-bench": "llama-bench",
    "rpc-server": "ggml-rpc-server",
}


# --- the CUDA targets and the compatibility rule ---


def sm_matrix() -> list[dict]:
    """The targets of the prebuilt matrix: sm, cmake arch, cards, minimum driver, runs_on."""
    data = json.loads(resources.files("kvmem_llama").joinpath("data/sm_matrix.json").read_text("utf-8"))
    return data["targets"]


def matrix_sms() -> tuple[str, ...]:
    return tuple(t["sm"] for t in sm_matrix())


def _compute_capability(sm: str) -> tuple[int, int, bool]:
    """`86` -> (8, 6, False); `120a` -> (12, 0, True): major, minor, arch-specific."""
    name = sm.strip().lower().removeprefix("sm_")
    arch_specific = name.endswith("a")
    number = int(name.rstrip("af"))  # `f` (family) code follows the plain rule
    return number // 10, number % 10, arch_specific


def sm_runs_on(engine_sm: str, gpu_sm: str | None) -> bool:
    """Does machine code built for `engine_sm` (`86`, `120a`) run on a GPU of `gpu_sm` (`89`, `120`)?"""
    if not gpu_sm:
        return False
    major, minor, arch_specific = _compute_capability(engine_sm)
    gpu_major, gpu_minor, _ = _compute_capability(gpu_sm)
    if arch_specific:
        return (major, minor) == (gpu_major, gpu_minor)
    return major == gpu_major and minor <= gpu_minor


def build_sm_flag(gpu_sm: str) -> str:
    """The `kvmem build --sm` value for a GPU."""
    return "120" if gpu_sm.startswith("12") else gpu_sm


def _sm_list(sms: Sequence[str]) -> str:
    return "sm_" + ", sm_".join(sms)


# --- engines in the store ---


@dataclass
class Engine:
    path: Path
    info: dict

    @property
    def key(self) -> str:
        return self.info.get("key") or self.path.name

    @property
    def target(self) -> str:
        return self.info.get("target", "?")

    @property
    def sms(self) -> list[str]:
        return list(self.info.get("sms", []))

    @property
    def upstream_only(self) -> bool:
        """Built from the bare pin, without our series (an A/B baseline)."""
        return bool(self.info.get("upstream"))

    def binary(self, name: str) -> Path:
        return self.path / "bin" / name

    @property
    def server(self) -> Path:
        return self.binary("llama-server")

    @property
    def libllama(self) -> Path:
        return self.path / "lib" / "libllama.so"

    @property
    def include_dir(self) -> Path:
        return self.path / "include"

    def runs_on(self, gpu_sm: str | None) -> bool:
        """A CPU engine runs anywhere; a CUDA engine where one of its SMs runs on the GPU."""
        return not self.sms or any(sm_runs_on(sm, gpu_sm) for sm in self.sms)


def load_engine(path: Path) -> Engine | None:
    info_file = path / "build-info.json"
    if not info_file.exists():
        return None
    try:
        return Engine(path, json.loads(info_file.read_text(encoding="utf-8")))
    except json.JSONDecodeError:
        return None


def list_engines() -> list[Engine]:
    root = paths.engines_dir()
    if not root.is_dir():
        return []
    engines = [e for p in sorted(root.iterdir()) if p.is_dir() and (e := load_engine(p))]
    return sorted(engines, key=lambda e: e.info.get("built_at", ""), reverse=True)


def lookup_engine(spec: str) -> Engine:
    """An engine by key, target (`cuda-sm90`), engine directory, or key prefix (the newest that matches)."""
    engines = list_engines()
    found = next((e for e in engines if spec in (e.key, e.target)), None)
    if found is None and Path(spec).is_dir():
        found = load_engine(Path(spec))
    if found is None:
        found = next((e for e in engines if e.key.startswith(spec)), None)
    if found is None:
        raise KvmemError(f"no engine {spec!r}",
                         hint="give an engine key from `kvmem engines` (or its start), or an engine directory")
    return found


def tree_key(pin: Pin, series: Series) -> str:
    """Which source an engine is built from: the pin's bytes and the series' hash."""
    return f"{pin.short[:8]}-{series.hash()[:10]}"


def current_tree_key() -> str:
    return tree_key(load_pin(), load_series())


def is_current(engine: Engine) -> bool:
    """Built from this checkout's pin + series (and not an upstream baseline)?"""
    return not engine.upstream_only and engine.info.get("tree_key") == current_tree_key()


def find_engine(target: str = "cpu", current_only: bool = True) -> Engine | None:
    """The newest engine for `target`; with current_only, only one built from today's pin + series."""
    wanted = current_tree_key()
    for engine in list_engines():
        if engine.target != target or engine.upstream_only:
            continue
        if current_only and engine.info.get("tree_key") != wanted:
            continue
        return engine
    return None


def require_engine(target: str = "cpu") -> Engine:
    engine = find_engine(target)
    if engine is None:
        stale = find_engine(target, current_only=False)
        why = " (the installed one was built from another pin or patch series)" if stale else ""
        flag = "" if target == "cpu" else f" --sm {target.removeprefix('cuda-sm').replace('-', ',')}"
        raise KvmemError(f"no {target} engine is built{why}", hint=f"run `kvmem build{flag}`")
    return engine


def engine_file_hashes(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file of an engine directory (what build-info records)."""
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def install_engine(key: str, fill: Callable[[Path], None]) -> Engine:
    """Put an engine into the store as engines/<key>, all or nothing: `fill(staging)` writes its files."""
    final = paths.engines_dir() / key
    with atomic_directory(final, prefix=f".{key}-") as staging:
        fill(staging)
    engine = load_engine(final)
    if engine is None:
        raise KvmemError(f"{final} has no build-info.json after the install")
    return engine


def remove_engines(keys: list[str], stale: bool = False) -> list[str]:
    """Delete engines by key; `stale`: also every engine of ours that is not the newest current one of its target."""
    current = current_tree_key()
    keep: dict[str, str] = {}
    for engine in list_engines():  # newest first
        if engine.info.get("tree_key") == current and not engine.upstream_only:
            keep.setdefault(engine.target, engine.key)
    removed = []
    for engine in list_engines():
        old = stale and not engine.upstream_only and keep.get(engine.target) != engine.key
        if engine.key in keys or old:
            shutil.rmtree(engine.path)
            removed.append(engine.key)
    missing = set(keys) - set(removed)
    if missing:
        raise KvmemError(f"no such engine: {', '.join(sorted(missing))}", hint="see `kvmem engines`")
    return removed


def engine_size(engine: Engine) -> int:
    return sum(p.stat().st_size for p in engine.path.rglob("*") if p.is_file() and not p.is_symlink())


# --- which engine runs here ---


def _closest(engine: Engine, gpu_sm: str | None) -> int:
    """The highest of the engine's SMs that runs on the GPU, as a number (86 for 8.6)."""
    ccs = [_compute_capability(sm) for sm in engine.sms if sm_runs_on(sm, gpu_sm)]
    return max((major * 10 + minor for major, minor, _ in ccs), default=-1)


def check_engine_for_gpus(engine: Engine, gpu_sms: Sequence[str], gpu_name: str = "this GPU") -> None:
    """Refuse a CUDA engine with no machine code for any of these GPUs: it would die with 'no kernel image'."""
    if not engine.sms:
        return  # a CPU engine runs anywhere
    if not gpu_sms:
        raise KvmemError(f"engine {engine.key} is a CUDA engine ({_sm_list(engine.sms)}), but no NVIDIA GPU "
                         "is visible here",
                         hint="use the CPU engine (`kvmem build`, `--engine cpu`), or check the driver with nvidia-smi")
    if not any(engine.runs_on(sm) for sm in gpu_sms):
        raise KvmemError(
            f"engine {engine.key} holds machine code for {_sm_list(engine.sms)}, but {gpu_name} is "
            f"{_sm_list(gpu_sms)}: CUDA would fail with 'no kernel image is available for execution on the device'",
            hint=f"kvmem build --sm {build_sm_flag(gpu_sms[0])}   (or install the package built for that SM)")


def check_engine_for_gpu(engine: Engine, hw: hardware.Hardware) -> None:
    """The same check for the GPU a server will run on."""
    gpu = hw.gpu()
    sms = [gpu.sm] if gpu is not None and gpu.sm else []
    check_engine_for_gpus(engine, sms, f"your {gpu.name}" if gpu is not None else "this GPU")


def select_engine(hw: hardware.Hardware, engine: str | None = None) -> Engine:
    """The engine for this machine: `engine` (a key, "cpu" or "gpu") or the one whose SMs run on the GPU.

    Among the engines that run on the GPU the one built for the nearest SM wins (its own SM first),
    the newest among equals.
    """
    if engine and engine not in ("cpu", "gpu", "auto"):
        chosen = lookup_engine(engine)
        check_engine_for_gpu(chosen, hw)
        return chosen
    if engine == "cpu" or not hw.has_gpu:
        if engine == "gpu":
            raise KvmemError("--engine gpu, but no NVIDIA GPU was found" +
                             (f" ({hw.nvml_error})" if hw.nvml_error else ""),
                             hint="check `nvidia-smi`, or run on the CPU engine")
        return require_engine("cpu")
    gpu = hw.gpu()
    assert gpu is not None
    engines = list_engines()
    fitting = [e for e in engines if e.sms and e.runs_on(gpu.sm)]
    fitting.sort(key=lambda e: -_closest(e, gpu.sm))  # the GPU's own SM first, then the nearest older minor
    for candidate in fitting:
        current = find_engine(candidate.target)
        if current is not None:
            return current
    others = sorted({sm for e in engines for sm in e.sms})
    why = f"; the installed CUDA engines are for {_sm_list(others)}" if others else ""
    raise KvmemError(f"no engine for your {gpu.name} (sm_{gpu.sm}){why}",
                     hint=f"kvmem build --sm {build_sm_flag(gpu.sm or '?')}   (or run on the CPU with --engine cpu)")
