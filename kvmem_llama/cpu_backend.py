"""The CPU side of an engine: ggml's CPU backend variants, of which one is loaded at run time.

Engines are portable: they are built with ggml's runtime CPU dispatch (GGML_BACKEND_DL +
GGML_CPU_ALL_VARIANTS, narrowed by our GGML_CPU_VARIANTS hook, patches/0007), never with
`-march=native`. The CPU backend is then one module per instruction-set level,
`bin/libggml-cpu-<tag>.so` next to the binaries (where ggml's loader looks), and ggml loads the
one whose `ggml_backend_score()` is highest on the running CPU. CUDA engines get the same modules
for the layers left on the CPU (`-ngl` below all).

No variant has AMX: ggml's AMX matmul (`ggml_backend_amx_mul_mat`) crashes on Sapphire-Rapids-class
CPUs (ggml-org/llama.cpp#20824); those CPUs run the `zen4` variant (AVX-512 VBMI/VNNI/BF16).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# tag -> the instruction sets it is compiled for (upstream's x86 variant table, minus AMX and the rare
# ivybridge/piledriver/cannonlake/cooperlake levels, whose CPUs run the variant below them)
CPU_VARIANTS: dict[str, str] = {
    "x64": "x86-64 baseline (SSE2)",
    "sse42": "SSE4.2",
    "sandybridge": "AVX",
    "haswell": "AVX2 FMA F16C BMI2",
    "alderlake": "AVX2 FMA F16C BMI2 AVX-VNNI",
    "skylakex": "AVX-512",
    "cascadelake": "AVX-512 VNNI",
    "icelake": "AVX-512 VBMI VNNI",
    "zen4": "AVX-512 VBMI VNNI BF16",
}

MODULE_PREFIX = "libggml-cpu-"
# the symbol of the AMX matmul that crashes: no module of an engine may contain it
AMX_KERNEL_SYMBOL = b"ggml_backend_amx_mul_mat"


def cmake_flags() -> list[str]:
    """The CMake flags of a portable CPU backend (CPU and CUDA engines alike)."""
    return ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON",
            f"-DGGML_CPU_VARIANTS={';'.join(CPU_VARIANTS)}"]


def is_backend_module(path: Path) -> bool:
    """A ggml backend module (`libggml-cpu-haswell.so`, `libggml-cuda.so`, `libggml-rpc.so`): ggml's loader
    finds these next to the binaries. Shared libraries (`libggml-base.so` -> `.so.0`) are symlink chains."""
    return path.name.startswith("libggml-") and path.suffix == ".so" and not path.is_symlink() and path.is_file()


def variant_modules(engine_dir: Path) -> dict[str, Path]:
    """{tag: module} of the CPU variants an engine holds ({} for an engine built before they existed)."""
    found = sorted((engine_dir / "bin").glob(f"{MODULE_PREFIX}*.so"))
    return {p.name[len(MODULE_PREFIX):-len(".so")]: p for p in found}


def modules_with_amx(engine_dir: Path) -> list[Path]:
    """Libraries of an engine that contain ggml's AMX matmul (must be none)."""
    libs = [p for sub in ("bin", "lib") for p in sorted((engine_dir / sub).glob("*.so*")) if not p.is_symlink()]
    return [p for p in libs if AMX_KERNEL_SYMBOL in p.read_bytes()]


@dataclass(frozen=True)
class VariantChoice:
    """Which CPU variant ggml loads on this machine, by ggml's own rule (the highest score)."""

    chosen: str | None  # None: no module scored above 0 (or the engine has none)
    scores: dict[str, int]
    error: str = ""

    @property
    def features(self) -> str:
        return CPU_VARIANTS.get(self.chosen or "", "")

    def describe(self) -> str:
        if self.error:
            return f"CPU variant unknown ({self.error})"
        if not self.scores:
            return "CPU backend built into libggml (an engine from before the portable build: rebuild it)"
        if self.chosen is None:
            return f"no CPU variant of {', '.join(self.scores)} runs on this CPU"
        return f"CPU variant {self.chosen} ({self.features}) of {len(self.scores)}"


# scores each module in a child process: loading a module runs its initializers, and a crash there must say
# what it is instead of taking the caller down
_SCORE = """
import ctypes, json, sys
out = {}
for path in sys.argv[1:]:
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    fn = getattr(lib, "ggml_backend_score", None)
    if fn is not None:
        fn.restype = ctypes.c_int
        out[path] = int(fn())
print(json.dumps(out))
"""


def choose_variant(engine_dir: Path, timeout: float = 60) -> VariantChoice:
    modules = variant_modules(engine_dir)
    if not modules:
        return VariantChoice(None, {})
    try:
        out = subprocess.run([sys.executable, "-c", _SCORE, *map(str, modules.values())],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return VariantChoice(None, {}, "scoring the CPU variants timed out")
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return VariantChoice(None, {}, f"loading a CPU variant failed: {why}")
    by_path = json.loads(out.stdout)
    scores = {tag: by_path.get(str(path), 0) for tag, path in modules.items()}
    best = max(scores, key=lambda t: scores[t])
    return VariantChoice(best if scores[best] > 0 else None, scores)
