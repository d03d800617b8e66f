"""One CUDA compatibility rule: sm_matrix.json's `runs_on`, `kvmem engines install` and `kvmem run`'s
engine choice accept and refuse the same (engine SM, GPU) pairs.

The engines are small but real engine directories (build-info.json with per-file sha256) packed into
real tarballs with SHA256SUMS; nothing here runs their binaries, so no GPU is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem_llama import hardware
from kvmem_llama.engine import (
    Engine,
    current_tree_key,
    engine_file_hashes,
    load_engine,
    select_engine,
    sm_matrix,
    sm_runs_on,
)
from kvmem_llama.errors import KvmemError
from kvmem_llama.packaging import install_engine_package, package_engine

# compute capabilities of NVIDIA GPUs from Turing on (8.7: Jetson Orin; 10.x/11.0: data-center Blackwell)
GPU_SMS = ("75", "80", "86", "87", "89", "90", "100", "103", "110", "120", "121")


def gpu(sm: str) -> hardware.Hardware:
    return hardware.Hardware([hardware.GPU(0, f"GPU sm_{sm}", sm, 16 << 30, 16 << 30)], 64 << 30, 64 << 30, 8)


def test_matrix_runs_on_lists_exactly_what_the_rule_accepts() -> None:
    for target in sm_matrix():
        assert target["sm"] in target["arch"] and target["arch"].endswith("-real")
        accepted = [sm for sm in GPU_SMS if sm_runs_on(target["sm"], sm)]
        assert accepted == target["runs_on"], target["sm"]  # accepted where listed, refused everywhere else


def test_rule_by_hand() -> None:
    assert sm_runs_on("86", "89") and sm_runs_on("80", "86") and sm_runs_on("90", "90")  # same major, newer minor
    assert not sm_runs_on("89", "86") and not sm_runs_on("86", "80")  # an older minor lacks the instructions
    assert not sm_runs_on("90", "120") and not sm_runs_on("75", "80")  # another major: no
    assert sm_runs_on("120a", "120") and not sm_runs_on("120a", "121")  # arch-specific: exactly 12.0
    assert not sm_runs_on("90", None)


def fake_engine(root: Path, sm: str) -> Engine:
    """An engine directory claiming CUDA code for `sm`, as `kvmem build --sm` would install it."""
    key = f"cuda-sm{sm}-test"
    path = root / key
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "llama-server").write_text(f"machine code for sm_{sm}\n")
    info = {"key": key, "target": f"cuda-sm{sm}", "sms": [sm], "tree_key": current_tree_key(),
            "built_at": "2026-01-01T00:00:00+00:00", "files": engine_file_hashes(path)}
    (path / "build-info.json").write_text(json.dumps(info))
    engine = load_engine(path)
    assert engine is not None
    return engine


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """One tarball per matrix target (one SHA256SUMS), and an empty engine store of our own."""
    monkeypatch.setenv("KVMEM_HOME", str(tmp_path / "home"))
    dist = tmp_path / "dist"
    return {t["sm"]: package_engine(fake_engine(tmp_path / "built", t["sm"]), dist) for t in sm_matrix()}


def accepts(action, *args, **kwargs) -> bool:
    try:
        action(*args, **kwargs)
    except KvmemError as exc:
        assert "no kernel image is available" in str(exc)
        return False
    return True


def test_install_and_run_accept_and_refuse_the_same_engines(packages: dict[str, Path]) -> None:
    for engine_sm, tarball in packages.items():
        install_engine_package(str(tarball), gpu_sms=[engine_sm])  # in the store, for `run --engine KEY`
    for target in sm_matrix():
        engine_sm, key = target["sm"], f"cuda-sm{target['sm']}-test"
        for gpu_sm in GPU_SMS:
            installs = accepts(install_engine_package, str(packages[engine_sm]), gpu_sms=[gpu_sm])
            runs = accepts(select_engine, gpu(gpu_sm), key)
            assert installs == runs == (gpu_sm in target["runs_on"]), (engine_sm, gpu_sm)


def test_run_picks_the_closest_engine_that_runs(packages: dict[str, Path]) -> None:
    for engine_sm, tarball in packages.items():
        install_engine_package(str(tarball), gpu_sms=[engine_sm])
    expected = {"75": "75", "80": "80", "86": "86", "87": "86", "89": "89", "90": "90", "120": "120a"}
    for gpu_sm in GPU_SMS:
        if gpu_sm in expected:
            assert select_engine(gpu(gpu_sm)).sms == [expected[gpu_sm]], gpu_sm
        else:
            with pytest.raises(KvmemError, match=f"no engine for your GPU sm_{gpu_sm}") as err:
                select_engine(gpu(gpu_sm))
            assert err.value.hint.startswith("kvmem build --sm")


def test_cli_install_refuses_with_the_reason(packages: dict[str, Path]) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "kvmem_llama.cli.main", "engines", "install", str(packages["89"])]
    refused = subprocess.run([*cmd, "--gpu-sm", "8.6"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 1
    assert "no kernel image is available" in refused.stderr and "kvmem build --sm 86" in refused.stderr
    installed = subprocess.run([*cmd, "--gpu-sm", "8.9"], capture_output=True, text=True, env=env, timeout=120)
    assert installed.returncode == 0 and "installed cuda-sm89-test" in installed.stdout
