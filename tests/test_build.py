"""`kvmem build` / `kvmem engines`: the exact cmake commands, clear errors, the installed engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvmem_llama.build import BUILD_TARGETS, parse_sms
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


def test_dry_run_for_sm90_shows_real_arch_and_all_fa_quants(tmp_path: Path) -> None:
    # a dry run needs no CUDA toolkit: run it without nvcc on PATH
    out = kvmem("build", "--sm", "90", "--dry-run", env=path_without("nvcc", tmp_path))
    assert out.returncode == 0, out.stderr
    text = out.stdout.replace("\n", " ")
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in text
    assert "-DGGML_CUDA_FA_QUANTS=all" in text
    assert "-DGGML_CUDA=ON" in text and "-DGGML_RPC=ON" in text
    for target in BUILD_TARGETS:
        assert f" {target}" in text


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
