"""Building engines: the pinned llama.cpp plus our series, compiled for the CPU or for CUDA SMs.

pipeline: verified upstream tree -> patched tree (cached by pin + series hash)
          -> cmake build dir per target (incremental, ccache) -> engine store entry (kvmem_llama.engine).

~420 lines: the steps of one pipeline over one BuildPlan (fetch, patch, configure, compile, install);
the web UI's npm build is apart in kvmem_llama/webui.py.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmem_llama import __version__, cpu_backend, paths, webui
from kvmem_llama.engine import (
    INSTALLED_BINARIES,
    Engine,
    engine_file_hashes,
    install_engine,
    load_engine,
    matrix_sms,
    tree_key,
)
from kvmem_llama.errors import BuildError
from kvmem_llama.files import atomic_directory
from kvmem_llama.patching import Series, apply_series, load_series
from kvmem_llama.serving.process import stop_process
from kvmem_llama.vendor import Pin, load_pin
from kvmem_llama.vendor.fetch import upstream_tree

BUILD_TARGETS = ("llama-server", "llama-cli", "llama-bench", "ggml-rpc-server", "llama")
UNIT_TESTS = "test-kvmem"  # the engine's C++ unit tests (patches/overlay/tests), built with the CPU engine
HEADERS = ("include/llama.h", "ggml/include/ggml.h", "ggml/include/ggml-backend.h",
           "ggml/include/ggml-alloc.h", "ggml/include/ggml-cpu.h", "ggml/include/ggml-opt.h",
           "ggml/include/gguf.h")
TREE_MARKER = ".kvmem-tree.json"
PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def parse_sms(spec: str) -> tuple[str, ...]:
    """`90`, `120` (= 120a), `86,89`, `all` -> normalised SM names from the matrix."""
    known = matrix_sms()
    if spec.strip().lower() == "all":
        return known
    out: list[str] = []
    for raw in spec.split(","):
        sm = raw.strip().lower().removeprefix("sm_").removeprefix("sm")
        if sm == "120":
            sm = "120a"  # consumer Blackwell needs the arch-specific target
        if sm not in known:
            older = sm.isdigit() and int(sm) < 75
            why = " (CUDA 13 dropped sm_70 and older)" if older else ""
            raise BuildError(
                f"unknown SM {raw.strip()!r}{why}",
                hint=f"choose from {', '.join(known)}, a comma list, or `all`",
            )
        if sm not in out:
            out.append(sm)
    return tuple(out)


@dataclass(frozen=True)
class BuildTarget:
    sms: tuple[str, ...] = ()  # empty = CPU

    @property
    def is_cuda(self) -> bool:
        return bool(self.sms)

    @property
    def name(self) -> str:
        return "cpu" if not self.sms else "cuda-sm" + "-".join(self.sms)

    @property
    def cuda_architectures(self) -> str:
        return ";".join(f"{sm}-real" for sm in self.sms)


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def find_compiler() -> tuple[str, str | None]:
    """The C++ compiler for the engine ($CXX first) and, when one was passed over, why.

    The engine is several shared libraries that hand C++ objects to each other, so they need one C++ runtime per
    process. A toolchain that links it statically (seen on the GPU host: CXX=/opt/gcc/bin/g++ ships only
    libstdc++.a) gives every library its own copy: a static std::regex of one library is then destroyed with
    another copy's std::locale, and every program aborted at exit with `free(): invalid pointer`."""
    candidates: list[str] = []
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(name) if name else None
        if path and path not in candidates:
            candidates.append(path)
    if not candidates:
        raise BuildError("no C++ compiler found", hint="install one: apt-get install build-essential")
    static: list[str] = []  # probed in order until one will do ($CXX first, also when the probe cannot tell)
    for compiler in candidates:
        if links_shared_cxx_runtime(compiler) is False:
            static.append(compiler)
            continue
        note = (f"{', '.join(static)} links the C++ runtime statically (every library would carry its own copy); "
                f"using {compiler}") if static else None
        return compiler, note
    raise BuildError(f"{', '.join(static)} link(s) the C++ runtime statically: every library of the engine would "
                     "carry its own copy, and its programs abort at exit (free(): invalid pointer)",
                     hint="install g++ with its shared runtime (apt-get install g++) or point CXX at one")


@functools.cache
def links_shared_cxx_runtime(compiler: str) -> bool | None:
    """Whether a shared library that `compiler` builds loads the C++ runtime as a shared library (libstdc++.so,
    libc++.so); None when that cannot be told (the probe did not build, or no readelf to read it)."""
    readelf = shutil.which("readelf")
    if not readelf:
        return None
    with tempfile.TemporaryDirectory(prefix="kvmem-cxx-") as tmp:
        src, lib = Path(tmp, "probe.cpp"), Path(tmp, "libprobe.so")
        src.write_text("#include <string>\nstd::string kvmem_probe(int n) { return std::string(n, 'x'); }\n")
        built = subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True)
        if built.returncode != 0 or not lib.exists():
            return None
        dynamic = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True).stdout
    return bool(re.search(r"\(NEEDED\).*\[lib(stdc\+\+|c\+\+)\.so", dynamic))


def nvcc_version() -> str | None:
    if not shutil.which("nvcc"):
        return None
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release ([\d.]+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


@dataclass
class Toolchain:
    compiler: str
    compiler_version: str
    cmake: str
    generator: str
    ccache: str | None
    cuda: str | None
    note: str | None = None  # why $CXX was passed over (find_compiler)

    def key(self) -> str:
        blob = f"{self.compiler_version}|{self.cuda}|{self.generator}"
        return hashlib.sha256(blob.encode()).hexdigest()[:6]


def detect_toolchain(target: BuildTarget, require_cuda: bool = True) -> Toolchain:
    """Find the tools; `require_cuda=False` lets a dry run print CUDA commands without nvcc."""
    cmake = shutil.which("cmake")
    if not cmake:
        raise BuildError("cmake is not installed", hint="apt-get install cmake (3.14 or newer)")
    compiler, compiler_note = find_compiler()
    cuda = None
    if target.is_cuda:
        cuda = nvcc_version()
        if cuda is None and require_cuda:
            raise BuildError(
                f"--sm {','.join(target.sms)} needs the CUDA toolkit, but nvcc is not on PATH",
                hint="install CUDA 13.x (nvcc) or build the CPU engine with plain `kvmem build`",
            )
    return Toolchain(
        compiler=compiler,
        compiler_version=_first_line([compiler, "--version"]) or "unknown",
        cmake=cmake,
        generator="Ninja" if shutil.which("ninja") else "Unix Makefiles",
        ccache=shutil.which("ccache"),
        cuda=cuda,
        note=compiler_note,
    )


# The flash-attention K/V pairs a CUDA engine compiles (`kvmem build --fa-quants`). `engine`, the default: the pairs
# the engine attends with: f16 (the tiered working set, and untiered f16 caches), q8_0 and q5_0 (the planner's
# quantized caches, untiered or with `--kvmem-gpu-type same`), bf16 and q4_0 (upstream's own set, for users' -ctk/-ctv).
# A mixed pair (-ctk q8_0 -ctv q5_0) needs `all`. `default` is upstream's set without q5_0.
FA_QUANT_SETS = {
    "engine": "f16-f16,bf16-bf16,q8_0-q8_0,q5_0-q5_0,q4_0-q4_0",
    "default": "f16-f16,bf16-bf16,q8_0-q8_0,q4_0-q4_0",
}
FA_TYPES = ("f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1")
DEFAULT_FA_QUANTS = "engine"


def fa_pairs(fa_quants: str) -> list[str] | None:
    """The K-V pairs of a `--fa-quants` value (`engine`, `default`, `all` or a comma list such as `q8_0-q5_0`);
    None for all of them. A wrong value is a BuildError that says what is allowed."""
    spec = FA_QUANT_SETS.get(fa_quants, fa_quants)
    if spec == "all":
        return None
    pairs = [p.strip().lower() for p in spec.split(",") if p.strip()]
    for pair in pairs:
        k, _, v = pair.partition("-")
        if k not in FA_TYPES or v not in FA_TYPES:
            raise BuildError(f"--fa-quants: {pair!r} is not a K-V pair of {', '.join(FA_TYPES)}",
                             hint=f"use {', '.join(FA_QUANT_SETS)}, all, or pairs like q8_0-q5_0,f16-f16")
    if not pairs:
        raise BuildError("--fa-quants is empty", hint=f"use {', '.join(FA_QUANT_SETS)} or all")
    return sorted(set(pairs) | {"f16-f16"})  # the pin always compiles f16-f16


def fa_quants_label(fa_quants: str) -> str:
    """A short name for build folders: the set's name, or a hash of an explicit list."""
    if fa_quants in FA_QUANT_SETS or fa_quants == "all":
        return fa_quants
    return "x" + hashlib.sha256(",".join(fa_pairs(fa_quants) or []).encode()).hexdigest()[:8]


def cmake_configure_args(target: BuildTarget, toolchain: Toolchain, src: Path, build: Path,
                         fa_quants: str = DEFAULT_FA_QUANTS, ui: bool = False) -> list[str]:
    args = [
        toolchain.cmake, "-S", str(src), "-B", str(build), "-G", toolchain.generator,
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DCMAKE_CXX_COMPILER={toolchain.compiler}",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # no downloads at build time
        # ON: embed the UI that kvmem_llama.webui built with npm and staged in the build dir
        f"-DLLAMA_BUILD_UI={'ON' if ui else 'OFF'}",
        "-DGGML_RPC=ON",
        # portable: ggml picks the best CPU variant at load (no -march=native, no AMX: kvmem_llama/cpu_backend.py)
        *cpu_backend.cmake_flags(),
        # binaries find their libraries next to them or in ../lib, wherever the engine lives
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN/../lib;$ORIGIN",
    ]
    if toolchain.ccache:
        args += [f"-DCMAKE_C_COMPILER_LAUNCHER={toolchain.ccache}",
                 f"-DCMAKE_CXX_COMPILER_LAUNCHER={toolchain.ccache}"]
    if not target.is_cuda:
        args.append("-DKVMEM_BUILD_TESTS=ON")
    if target.is_cuda:
        args += [
            "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={target.cuda_architectures}",
            # the vector kernels' K/V pairs (the tile/MMA kernels convert quantized K/V to f16 whatever the list)
            f"-DGGML_CUDA_FA_QUANTS={','.join(fa_pairs(fa_quants) or ['all'])}",
        ]
        if toolchain.ccache:
            args.append(f"-DCMAKE_CUDA_COMPILER_LAUNCHER={toolchain.ccache}")
    return args


def cmake_build_args(toolchain: Toolchain, build: Path, jobs: int, unit_tests: bool = False) -> list[str]:
    targets = (*BUILD_TARGETS, UNIT_TESTS) if unit_tests else BUILD_TARGETS
    return [toolchain.cmake, "--build", str(build), "-j", str(jobs), "--target", *targets]


# --- the patched tree ---


def upstream_series() -> Series:
    """The empty series: the pin exactly as upstream ships it (A/B baselines)."""
    return Series(Path("(none: upstream)"), [])


def tree_root(pin: Pin, series: Series) -> Path:
    """The cache slot of one (pin, series): the patched tree in src/, build dirs and logs beside it."""
    return paths.cache_dir() / "trees" / tree_key(pin, series)


def patched_tree(pin: Pin, series: Series, log: Callable[[str], None] = print) -> Path:
    """Upstream + our series, applied once per (pin, series hash) and cached."""
    src = tree_root(pin, series) / "src"
    if (src / TREE_MARKER).exists():
        return src
    upstream = upstream_tree(paths.cache_dir(), pin, log)
    with atomic_directory(src, prefix=".src-") as staging:
        shutil.copytree(upstream, staging, dirs_exist_ok=True)
        log(f"applying {len(series.names)} patch(es) + {len(series.overlay_files())} overlay file(s)")
        apply_series(staging, series)
        if Series(series.directory, list(series.names)).hash() != series.hash():  # the files as they are now
            raise BuildError(f"the patch series in {series.directory} changed while the tree was being patched",
                             hint="run the build again once the files are saved")
        marker = {"pin": pin.sha256, "series": series.hash(), "patches": series.names}
        (staging / TREE_MARKER).write_text(json.dumps(marker, indent=2), encoding="utf-8")
    return src


def engine_key(target: BuildTarget, pin: Pin, series: Series, toolchain: Toolchain, fa_quants: str = DEFAULT_FA_QUANTS,
               ui: bool = False) -> str:
    """Everything that changes the binaries: target, pin, series, toolchain and our cmake flags (the UI
    is a function of the tree, so ON/OFF says which UI)."""
    flags = cmake_configure_args(target, toolchain, Path("src"), Path("build"), fa_quants, ui)
    digest = hashlib.sha256(f"{toolchain.key()}|{flags}".encode()).hexdigest()[:6]
    return f"{target.name}-{tree_key(pin, series)}-{digest}"


CUDA_LIBRARY = "libggml-cuda.so"
# cuobjdump's listings: "ELF file    1: libggml-cuda.1.sm_90.cubin", "PTX file    1: libggml-cuda.1.sm_90.ptx"
LISTED_ARCH = re.compile(r"^(ELF|PTX) file\s+\d+:.*?\b((?:sm|compute)_\d+[a-z]?)\b", re.MULTILINE)


def parse_cuobjdump(elf_listing: str, ptx_listing: str) -> dict[str, list[str]]:
    """The SMs of the machine code (`cuobjdump --list-elf`) and of the PTX (`--list-ptx`) in a binary."""
    def archs(listing: str, kind: str) -> list[str]:
        return sorted({arch for what, arch in LISTED_ARCH.findall(listing) if what == kind})
    return {"elf": archs(elf_listing, "ELF"), "ptx": archs(ptx_listing, "PTX")}


def check_machine_code(found: dict[str, list[str]], target: BuildTarget) -> None:
    """An engine for sm_NN carries machine code for exactly sm_NN and no PTX (the `-real` targets): a wrong or
    missing target would reach a user as a "no kernel image" failure at start."""
    want = sorted(f"sm_{sm}" for sm in target.sms)
    if found["elf"] != want or found["ptx"]:
        raise BuildError(f"{CUDA_LIBRARY} holds machine code for {', '.join(found['elf']) or 'nothing'}"
                         f"{' and PTX for ' + ', '.join(found['ptx']) if found['ptx'] else ''}; "
                         f"{target.name} must hold {', '.join(want)} only",
                         hint="check CMAKE_CUDA_ARCHITECTURES in the build log (kvmem build --dry-run shows it)")


def cuda_machine_code(build: Path, target: BuildTarget) -> dict[str, list[str]] | dict[str, str] | None:
    """What `cuobjdump` (beside nvcc) finds in the built CUDA library, checked against the target; None when the
    toolkit has no cuobjdump (recorded as unknown, not guessed)."""
    nvcc = shutil.which("nvcc")
    tool = Path(nvcc).parent / "cuobjdump" if nvcc else None
    if tool is None or not tool.exists():
        found_tool = shutil.which("cuobjdump")
        if not found_tool:
            return None
        tool = Path(found_tool)
    lib = build / "bin" / CUDA_LIBRARY
    listings = [subprocess.run([str(tool), flag, str(lib)], capture_output=True, text=True)
                for flag in ("--list-elf", "--list-ptx")]
    if listings[0].returncode != 0:  # the tool, not the build, failed: say so in the build-info
        return {"error": f"cuobjdump --list-elf failed: {listings[0].stderr.strip()[-300:]}"}
    found = parse_cuobjdump(listings[0].stdout, listings[1].stdout)
    check_machine_code(found, target)
    return found


def _install(build: Path, src: Path, key: str, info: dict) -> Engine:
    """Copy binaries, libraries, headers and licenses into the engine store, all or nothing."""

    def fill(staging: Path) -> None:
        for sub in ("bin", "lib", "include", "licenses"):
            (staging / sub).mkdir()
        built_bin = build / "bin"
        for installed, built in INSTALLED_BINARIES.items():
            shutil.copy2(built_bin / built, staging / "bin" / installed)
        for lib in sorted(built_bin.glob("*.so*")):
            # backend modules next to the binaries, where ggml's loader looks; shared libraries in lib/
            sub = "bin" if cpu_backend.is_backend_module(lib) else "lib"
            shutil.copy2(lib, staging / sub / lib.name, follow_symlinks=False)  # keep .so symlinks
        info["cpu_variants"] = sorted(cpu_backend.variant_modules(staging))
        for header in HEADERS:
            if (src / header).exists():
                shutil.copy2(src / header, staging / "include" / Path(header).name)
        shutil.copy2(src / "LICENSE", staging / "licenses" / "LICENSE-llama.cpp")
        repo_root = Path(__file__).resolve().parent.parent
        for ours in ("LICENSE", "NOTICE"):
            if (repo_root / ours).exists():
                shutil.copy2(repo_root / ours, staging / "licenses" / f"{ours}-kvmem-llama")
        info["files"] = engine_file_hashes(staging)
        (staging / "build-info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    return install_engine(key, fill)


@dataclass
class BuildPlan:
    target: BuildTarget
    pin: Pin
    series: Series
    toolchain: Toolchain
    jobs: int
    upstream: bool = False  # the pin without our series, for A/B benchmarks
    fa_quants: str = DEFAULT_FA_QUANTS
    ui: bool = False  # embed the web UI (built with npm); run_build turns it off if npm fails
    ui_skipped: str | None = None  # why the UI is not embedded

    @property
    def key(self) -> str:
        key = engine_key(self.target, self.pin, self.series, self.toolchain, self.fa_quants, self.ui)
        return f"upstream-{key}" if self.upstream else key

    @property
    def tree_root(self) -> Path:
        return tree_root(self.pin, self.series)

    @property
    def src(self) -> Path:
        return self.tree_root / "src"

    @property
    def build_dir(self) -> Path:
        suffix = "" if not self.target.is_cuda else f"-fa-{fa_quants_label(self.fa_quants)}"
        return self.tree_root / f"build-{self.target.name}{suffix}"

    def configure_args(self) -> list[str]:
        return cmake_configure_args(self.target, self.toolchain, self.src, self.build_dir, self.fa_quants, self.ui)

    def build_args(self) -> list[str]:
        return cmake_build_args(self.toolchain, self.build_dir, self.jobs, unit_tests=not self.target.is_cuda)

    def log_file(self) -> Path:
        return self.tree_root / f"build-{self.target.name}.log"


def _ui_choice(want: bool, pin: Pin, series: Series) -> tuple[bool, str | None]:
    """(embed the UI?, why not): npm can build it, or this tree's UI is already built and cached."""
    if not want:
        return False, "--no-ui"
    why = webui.npm_missing()
    if why is None:
        return True, None
    ui_dir = tree_root(pin, series) / "src" / webui.UI_SUBDIR
    if ui_dir.is_dir() and webui.cached_dist(webui.source_hash(ui_dir)):
        return True, None
    return False, (f"{why}; install Node.js {webui.MIN_NODE[0]}.{webui.MIN_NODE[1]}+ with npm and run "
                   "`kvmem build` again to embed it")


def plan_build(sm: str | None = None, jobs: int | None = None, dry_run: bool = False,
               upstream: bool = False, fa_quants: str = DEFAULT_FA_QUANTS, ui: bool = True) -> BuildPlan:
    target = BuildTarget(parse_sms(sm) if sm else ())
    toolchain = detect_toolchain(target, require_cuda=not dry_run)
    series = upstream_series() if upstream else load_series()
    pin = load_pin()
    with_ui, skipped = _ui_choice(ui, pin, series)
    return BuildPlan(target, pin, series, toolchain, jobs or os.cpu_count() or 2, upstream, fa_quants,
                     with_ui, skipped)


def _installed(plan: BuildPlan) -> Engine | None:
    existing = load_engine(paths.engines_dir() / plan.key)
    if existing and all(existing.binary(b).exists() for b in INSTALLED_BINARIES):
        return existing
    return None


def _provide_ui(plan: BuildPlan, log: Callable[[str], None]) -> str | None:
    """Build or reuse the web UI and stage it for CMake; if it cannot be had, turn the plan's UI off.
    Returns the UI's source hash."""
    ui = webui.provide_ui(plan.src, log) if plan.ui else webui.WebUI(None, None, plan.ui_skipped)
    if plan.ui and not ui.available:
        plan.ui, plan.ui_skipped = False, ui.reason
    if not plan.ui:
        log(f"web UI skipped: {plan.ui_skipped}")
    webui.stage_for_cmake(ui, plan.build_dir)
    return ui.source_hash


def _ccache_env(plan: BuildPlan) -> dict[str, str]:
    env = dict(os.environ)
    # One shared cache; basedir makes hits across trees of different patch hashes.
    env.setdefault("CCACHE_DIR", str(paths.cache_dir() / "ccache"))
    env.setdefault("CCACHE_BASEDIR", str(plan.tree_root.parent))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    env.setdefault("CCACHE_MAXSIZE", "5G")
    return env


def _run_logged(cmd: list[str], log, env: dict[str, str],
                on_line: Callable[[str], None] | None = None) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, bufsize=1, errors="replace")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if on_line:
                on_line(line)
        return proc.wait()
    except BaseException:  # Ctrl-C: stop the compiler, keep the build dir for next time
        stop_process(proc, timeout=10)
        raise


def _error_lines(log_file: Path, limit: int = 15) -> str:
    lines = log_file.read_text(encoding="utf-8", errors="replace").splitlines()
    errors = [ln for ln in lines if re.search(r"error|Error|FAILED|fatal", ln)]
    return "\n".join((errors or lines)[-limit:])


def run_build(plan: BuildPlan, log: Callable[[str], None] = print,
              progress: Callable[[int, int, str], None] | None = None, force: bool = False) -> tuple[Engine, bool]:
    """Build and install an engine; returns (engine, was_cached)."""
    if not force and (existing := _installed(plan)):
        return existing, True
    started = time.monotonic()
    if plan.toolchain.note:
        log(plan.toolchain.note)
    patched_tree(plan.pin, plan.series, log)
    plan.build_dir.mkdir(parents=True, exist_ok=True)
    ui_source = _provide_ui(plan, log)
    if not force and (existing := _installed(plan)):  # npm failed: the engine without the UI may exist
        return existing, True
    env = _ccache_env(plan)
    log_path = plan.log_file()
    configure = plan.configure_args()
    args_file = plan.build_dir / ".kvmem-configure-args.json"
    with open(log_path, "w", encoding="utf-8") as logfh:
        if not args_file.exists() or json.loads(args_file.read_text()) != configure:
            log(f"configuring {plan.target.name} ({plan.toolchain.generator})")
            if (plan.build_dir / "CMakeCache.txt").exists():
                (plan.build_dir / "CMakeCache.txt").unlink()
            if _run_logged(configure, logfh, env) != 0:
                raise BuildError(f"cmake configure failed; full log: {log_path}\n{_error_lines(log_path)}")
            args_file.write_text(json.dumps(configure))

        def on_line(line: str) -> None:
            match = PROGRESS.match(line)
            if match and progress:
                progress(int(match.group(1)), int(match.group(2)), line[match.end():].strip())

        log(f"building {', '.join(BUILD_TARGETS)} with {plan.jobs} job(s); log: {log_path}")
        if _run_logged(plan.build_args(), logfh, env, on_line) != 0:
            raise BuildError(f"build failed; full log: {log_path}\n{_error_lines(log_path)}")
    assets = webui.embedded_assets(plan.build_dir) or 0
    if plan.ui and not assets:
        raise BuildError(f"the web UI was built but the server embeds no UI files; full log: {log_path}",
                         hint="`kvmem build --no-ui` builds without it")
    info = {
        "kvmem_version": __version__,
        "key": plan.key,
        "upstream": plan.upstream,
        "target": plan.target.name,
        "sms": list(plan.target.sms),
        "cuda_architectures": plan.target.cuda_architectures or None,
        "pin": {"package": plan.pin.requirement, "sha256": plan.pin.sha256,
                "upstream_version": plan.pin.upstream_version, "upstream_commit": plan.pin.upstream_commit},
        "tree_key": tree_key(plan.pin, plan.series),
        "series_hash": plan.series.hash(),
        "patches": plan.series.names,
        "compiler": plan.toolchain.compiler_version,
        "cuda": plan.toolchain.cuda,
        "generator": plan.toolchain.generator,
        "ccache": bool(plan.toolchain.ccache),
        "cmake_configure": configure,
        "fa_quants": (fa_pairs(plan.fa_quants) or ["all"]) if plan.target.is_cuda else None,
        "machine_code": cuda_machine_code(plan.build_dir, plan.target) if plan.target.is_cuda else None,
        "build_dir": str(plan.build_dir),  # holds the C++ unit tests (ctest) of a CPU build
        "ui": {"embedded": bool(assets), "files": assets, "source_hash": ui_source,
               "skipped": None if assets else plan.ui_skipped},
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(time.monotonic() - started, 1),
    }
    return _install(plan.build_dir, plan.src, plan.key, info), False


