"""The engines run on every x86-64 CPU (issue 22): ggml's runtime CPU dispatch, no AMX, no -march=native.

On a CPU with AMX (Sapphire Rapids and newer Xeons) an engine built with GGML_NATIVE=ON compiled ggml's
AMX matmul in and crashed at the first decode (the README's first command exited 139). These tests fail
there on such an engine and pass on a portable one; on a CPU without AMX they still check that no AMX
kernel is in the engine and that the variant ggml loads is the one `kvmem doctor` reports.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_readme import ROOT, readme_commands

from kvmem_llama import cpu_backend, doctor
from kvmem_llama.build import BuildTarget, Toolchain, cmake_configure_args
from kvmem_llama.engine import Engine

pytestmark = pytest.mark.engine


def test_readme_first_command_answers(cpu_engine: Engine) -> None:
    """The README's first command, verbatim (the engine is already built: `kvmem build` is a cache hit)."""
    install = readme_commands()[0]
    out = subprocess.run(["bash", "-c", install], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, f"exit code {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    answer = out.stdout.split("The capital of France is", 1)[-1]
    assert "Paris" in answer, out.stdout[-2000:]


def test_engine_is_portable_and_has_no_amx_kernel(cpu_engine: Engine) -> None:
    assert cpu_backend.modules_with_amx(cpu_engine.path) == []
    assert sorted(cpu_backend.variant_modules(cpu_engine.path)) == sorted(cpu_backend.CPU_VARIANTS)
    assert cpu_engine.info["cpu_variants"] == sorted(cpu_backend.CPU_VARIANTS)
    configure = cpu_engine.info["cmake_configure"]
    assert "-DGGML_NATIVE=OFF" in configure and "-DGGML_BACKEND_DL=ON" in configure
    assert not any("march=native" in arg or arg == "-DGGML_NATIVE=ON" for arg in configure)
    # the shared libraries stay in lib/, the backend modules sit next to the binaries
    assert (cpu_engine.path / "lib" / "libllama.so").exists()
    assert not list((cpu_engine.path / "lib").glob(f"{cpu_backend.MODULE_PREFIX}*"))


def test_cuda_engines_get_the_same_portable_cpu_backend(tmp_path: Path) -> None:
    toolchain = Toolchain("g++", "g++ 12", "cmake", "Ninja", None, "13.0")
    for target in (BuildTarget(), BuildTarget(("90",))):
        args = cmake_configure_args(target, toolchain, tmp_path / "src", tmp_path / "build")
        for flag in cpu_backend.cmake_flags():
            assert flag in args, (target.name, flag)
        assert "AMX" not in " ".join(args) and "sapphirerapids" not in " ".join(args)


def test_server_loads_the_variant_doctor_reports_and_no_amx_buffer(cpu_engine: Engine, smollm2: Path,
                                                                     llama_server) -> None:
    choice = cpu_backend.choose_variant(cpu_engine.path)
    assert choice.chosen is not None, choice.describe()
    # -lv 4: llama-server shows libllama's and ggml's INFO lines (the loaded backends, the model buffers) only then
    with llama_server(smollm2, ["-c", "1024", "-np", "1", "-lv", "4"]) as srv:
        body = httpx.post(f"{srv.url}/completion", json={"prompt": "The capital of France is", "n_predict": 4,
                                                         "temperature": 0}, timeout=120).json()
        log = srv.log()
    assert body["tokens_predicted"] > 0
    loaded = re.findall(r"loaded CPU backend from (\S+)", log)
    assert loaded and Path(loaded[0]).name == f"{cpu_backend.MODULE_PREFIX}{choice.chosen}.so", log[:3000]
    assert re.search(r"\bCPU\w* model buffer", log) and not re.search(r"\bAMX model buffer", log)

    check = doctor.cpu_check(cpu_engine)
    assert check.status == "ok" and check.facts["cpu_variant"] == choice.chosen
    assert f"CPU variant {choice.chosen}" in check.detail


def test_binding_loads_the_variants_next_to_the_binaries(cpu_engine: Engine) -> None:
    """The binding (Python is the executable) finds the modules in the engine's bin/ too."""
    script = ("import sys; from kvmem_llama.binding import load_library, recent_log; load_library(sys.argv[1]); "
              "print(''.join(recent_log(200)))")
    out = subprocess.run([sys.executable, "-c", script, str(cpu_engine.libllama)], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    chosen = cpu_backend.choose_variant(cpu_engine.path).chosen
    assert f"{cpu_backend.MODULE_PREFIX}{chosen}.so" in out.stdout, out.stdout[-2000:]


def test_engines_json_names_the_variant(cpu_engine: Engine) -> None:
    out = subprocess.run(["kvmem", "engines", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(r for r in json.loads(out.stdout) if r["key"] == cpu_engine.key)
    assert row["cpu_variant"] == cpu_backend.choose_variant(cpu_engine.path).chosen
    assert row["cpu_variants"] == sorted(cpu_backend.CPU_VARIANTS)


def test_binding_works_after_numpy_loaded_libstdcxx(cpu_engine: Engine, smollm2: Path) -> None:
    """`kvmem generate` imports numpy before the engine: a process that loaded libstdc++.so first. A toolchain that
    links the C++ runtime statically made our libraries export a second copy, and the tokenizer's std::regex
    crashed (seen on the GPU host); the engine is built with the shared runtime."""
    script = ("import sys, numpy; from kvmem_llama.binding import Llama\n"
              "with Llama.load(sys.argv[1], n_ctx=512, libllama=sys.argv[2]) as llm:\n"
              "    print(llm.generate('The capital of France is', max_tokens=4, temperature=0.0).text)")
    out = subprocess.run([sys.executable, "-c", script, str(smollm2), str(cpu_engine.libllama)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"exit code {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip()
    # one C++ runtime per process: every library loads the shared one (kvmem_llama.build.find_compiler)
    libraries = sorted(cpu_engine.path.glob("*/lib*.so"))
    assert any(lib.name.startswith("libggml-cpu-") for lib in libraries) and cpu_engine.libllama in libraries
    for lib in libraries:
        dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
        assert "libstdc++.so" in dynamic, f"{lib.name} carries its own C++ runtime"
