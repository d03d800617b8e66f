"""`kvmem build` / `kvmem engines`: the exact cmake commands, clear errors, the installed engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvmem_llama.build import (
    BUILD_TARGETS,
    BuildTarget,
    check_machine_code,
    fa_pairs,
    fa_quants_label,
    parse_cuobjdump,
    parse_sms,
)
from kvmem_llama.engine import Engine, matrix_sms
from kvmem_llama.errors import BuildError
from kvmem_llama.files import sha256_file

KVMEM = shutil.which("kvmem") or "kvmem"


def kvmem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KVMEM, *args], capture_output=True, text=True, env=env, timeout=120)


def path_without(tool: str, tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH hides `tool` but keeps everything else of PATH."""
    shadow = tmp_path / "bin"
    shadow.mkdir(exist_ok=True)
    keep = []
    for entry in os.environ["PATH"].split(os.pathsep):
        if entry and (Path(entry) / tool).exists():
            # re-expose the other tools of that directory through links
            for item in Path(entry).iterdir():
                if item.name != tool and not (shadow / item.name).exists():
                    try:
                        (shadow / item.name).symlink_to(item)
                    except OSError:
                        pass
        else:
            keep.append(entry)
    return {**os.environ, "PATH": os.pathsep.join([str(shadow), *keep])}


def test_dry_run_for_sm90_shows_real_arch_and_the_engines_fa_pairs(tmp_path: Path) -> None:
    # a dry run needs no CUDA toolkit: run it without nvcc on PATH
    out = kvmem("build", "--sm", "90", "--dry-run", env=path_without("nvcc", tmp_path))
    assert out.returncode == 0, out.stderr
    text = out.stdout.replace("\n", " ")
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in text
    # the pairs kvmem run attends with, q5_0 (the 27B profiles' cache) included; not all 49
    assert "-DGGML_CUDA_FA_QUANTS=bf16-bf16,f16-f16,q4_0-q4_0,q5_0-q5_0,q8_0-q8_0 " in text
    every = kvmem("build", "--sm", "90", "--dry-run", "--fa-quants", "all", env=path_without("nvcc", tmp_path))
    assert "-DGGML_CUDA_FA_QUANTS=all " in every.stdout.replace("\n", " ")
    assert "-DGGML_CUDA=ON" in text and "-DGGML_RPC=ON" in text
    for target in BUILD_TARGETS:
        assert f" {target}" in text


def test_a_wrong_fa_pair_is_a_clear_cli_error(tmp_path: Path) -> None:
    out = kvmem("build", "--sm", "90", "--dry-run", "--fa-quants", "q8_0-q3_k", env=path_without("nvcc", tmp_path))
    assert out.returncode != 0
    assert "'q8_0-q3_k' is not a K-V pair" in out.stderr and "Traceback" not in out.stderr


def test_fa_pairs_of_the_named_sets_and_lists() -> None:
    assert fa_pairs("all") is None
    assert "q5_0-q5_0" in fa_pairs("engine") and "q5_0-q5_0" not in fa_pairs("default")
    assert fa_pairs("Q8_0-q5_0") == ["f16-f16", "q8_0-q5_0"]  # the pin compiles f16-f16 whatever the list
    assert fa_quants_label("engine") == "engine" and fa_quants_label("q8_0-q5_0").startswith("x")
    with pytest.raises(BuildError, match="empty"):
        fa_pairs(" , ")


# cuobjdump's listings of a two-fatbin library built for sm_90 and for sm_120a (the format of CUDA 12-13)
ELF_SM90 = "ELF file    1: libggml-cuda.1.sm_90.cubin\nELF file    2: libggml-cuda.2.sm_90.cubin\n"


def test_machine_code_must_be_exactly_the_targets() -> None:
    found = parse_cuobjdump(ELF_SM90, "")
    assert found == {"elf": ["sm_90"], "ptx": []}
    check_machine_code(found, BuildTarget(("90",)))
    with pytest.raises(BuildError, match="holds machine code for sm_90; cuda-sm89 must hold sm_89 only"):
        check_machine_code(found, BuildTarget(("89",)))
    mixed = parse_cuobjdump(ELF_SM90 + "ELF file    3: libggml-cuda.3.sm_89.cubin\n", "")
    with pytest.raises(BuildError, match="sm_89, sm_90"):
        check_machine_code(mixed, BuildTarget(("90",)))
    blackwell = parse_cuobjdump("ELF file    1: libggml-cuda.1.sm_120a.cubin\n", "")
    check_machine_code(blackwell, BuildTarget(("120a",)))
    with_ptx = parse_cuobjdump(ELF_SM90, "PTX file    1: libggml-cuda.1.sm_90.ptx\n")
    with pytest.raises(BuildError, match="and PTX for sm_90"):  # -real targets carry no PTX
        check_machine_code(with_ptx, BuildTarget(("90",)))
    with pytest.raises(BuildError, match="machine code for nothing"):
        check_machine_code(parse_cuobjdump("", ""), BuildTarget(("86",)))


def test_sm_specs_normalise_to_the_matrix() -> None:
    assert parse_sms("120") == ("120a",)
    assert parse_sms("sm_86, 89") == ("86", "89")
    assert parse_sms("all") == matrix_sms() == ("75", "80", "86", "89", "90", "120a")
    with pytest.raises(BuildError, match="CUDA 13 dropped sm_70"):
        parse_sms("70")
    with pytest.raises(BuildError, match="unknown SM 'banana'"):
        parse_sms("banana")


def test_unknown_sm_is_a_clear_cli_error() -> None:
    out = kvmem("build", "--sm", "61", "--dry-run")
    assert out.returncode != 0
    assert "unknown SM '61'" in out.stderr and "Traceback" not in out.stderr


def test_sm_without_nvcc_says_what_is_missing(tmp_path: Path) -> None:
    out = kvmem("build", "--sm", "90", env=path_without("nvcc", tmp_path))
    assert out.returncode != 0
    assert "nvcc is not on PATH" in out.stderr


def test_no_cmake_says_what_is_missing(tmp_path: Path) -> None:
    out = kvmem("build", "--dry-run", env=path_without("cmake", tmp_path))
    assert out.returncode != 0
    assert "cmake is not installed" in out.stderr


def static_runtime_compilers(tmp_path: Path) -> Path:
    """c++, g++ and clang++ that link the C++ runtime statically: the real g++ with -static-libstdc++, as the GPU
    host's CXX=/opt/gcc/bin/g++ does (it has no libstdc++.so)."""
    gxx = shutil.which("g++")
    assert gxx, "the tests need g++"
    folder = tmp_path / "static-cxx"
    folder.mkdir()
    for name in ("c++", "g++", "clang++"):
        wrapper = folder / name
        wrapper.write_text(f'#!/bin/sh\nexec {gxx} -static-libstdc++ "$@"\n')
        wrapper.chmod(0o755)
    return folder


def test_a_cxx_that_links_the_runtime_statically_is_passed_over_with_the_reason(tmp_path: Path) -> None:
    # every library of the engine would carry its own runtime: on the GPU host every program aborted at exit
    static_gxx = static_runtime_compilers(tmp_path) / "g++"
    out = kvmem("build", "--dry-run", env={**os.environ, "CXX": str(static_gxx)})
    assert out.returncode == 0, out.stderr
    assert f"{static_gxx} links the C++ runtime statically" in out.stdout
    assert "-DCMAKE_CXX_COMPILER=" in out.stdout
    assert f"-DCMAKE_CXX_COMPILER={static_gxx}" not in out.stdout


def test_only_static_cxx_runtimes_stop_the_build_with_what_to_install(tmp_path: Path) -> None:
    folder = static_runtime_compilers(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PATH"] = os.pathsep.join([str(folder), os.environ["PATH"]])
    out = kvmem("build", "--dry-run", env=env)
    assert out.returncode != 0
    message = " ".join(out.stderr.split())
    assert "link(s) the C++ runtime statically" in message and "apt-get install g++" in message
    assert "Traceback" not in out.stderr


@pytest.mark.engine
def test_engines_lists_the_cpu_engine_with_build_info(cpu_engine: Engine) -> None:
    out = kvmem("engines", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    row = next(r for r in rows if r["key"] == cpu_engine.key)
    assert row["target"] == "cpu" and row["current"] is True
    info = cpu_engine.info
    assert info["pin"]["package"] == "llama-cpp-python==0.3.36"
    assert info["patches"] and info["series_hash"]
    for rel, digest in info["files"].items():  # every installed file is what was recorded
        assert sha256_file(cpu_engine.path / rel) == digest, rel
    for name in ("llama-server", "llama-cli", "llama-bench", "rpc-server"):
        assert os.access(cpu_engine.binary(name), os.X_OK)
    assert cpu_engine.libllama.exists()


@pytest.mark.engine
def test_engine_marks_itself_as_kvmem(cpu_engine: Engine) -> None:
    out = subprocess.run([str(cpu_engine.server), "--version"], capture_output=True, text=True, timeout=60)
    assert "kvmem-llama" in out.stdout + out.stderr


@pytest.mark.engine
def test_second_build_is_a_cache_hit(cpu_engine: Engine) -> None:
    out = kvmem("build")
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stdout and cpu_engine.key in out.stdout
