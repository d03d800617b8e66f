"""Engine packages and source packs: verified install, SM checks, tamper refusal."""

from __future__ import annotations

import functools
import http.server
import io
import json
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from kvmem_llama import build, webui
from kvmem_llama.engine import Engine, load_engine, sm_runs_on
from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.files import sha256_file
from kvmem_llama.packaging import (
    SUMS_FILE,
    install_engine_package,
    pack_source,
    package_engine,
    read_sums,
    unpack_source,
    write_sums,
)
from kvmem_llama.patching import load_series
from kvmem_llama.vendor import load_pin

ROOT = Path(__file__).resolve().parent.parent


def test_sm_compatibility_rules() -> None:
    assert sm_runs_on("90", "90")
    assert sm_runs_on("86", "89") and sm_runs_on("80", "86")  # same major, newer minor
    assert not sm_runs_on("89", "86")
    assert not sm_runs_on("90", "120") and not sm_runs_on("75", "80")
    assert sm_runs_on("120a", "120") and not sm_runs_on("120a", "121")


def test_matrix_dry_run_prints_all_six_targets() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "packaging/make_packages.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for arch in ("75-real", "80-real", "86-real", "89-real", "90-real", "120a-real"):
        assert f"-DCMAKE_CUDA_ARCHITECTURES={arch}" in out.stdout
    assert out.stdout.count("-DGGML_CUDA_FA_QUANTS=bf16-bf16,f16-f16,q4_0-q4_0,q5_0-q5_0,q8_0-q8_0 ") == 6


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A separate engine store, so installs don't touch the real one."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVMEM_HOME", str(home))
    return home / "engines"


def fake_cuda_engine(cpu_engine: Engine, dest: Path, sm: str) -> Engine:
    """The CPU engine relabelled as a CUDA build (only build-info decides what it claims)."""
    shutil.copytree(cpu_engine.path, dest, symlinks=True)
    info = json.loads((dest / "build-info.json").read_text())
    info.update(target=f"cuda-sm{sm}", sms=[sm], key=dest.name)
    (dest / "build-info.json").write_text(json.dumps(info))
    engine = load_engine(dest)
    assert engine is not None
    return engine


@pytest.mark.engine
def test_package_then_install_verified(cpu_engine: Engine, tmp_path: Path, store: Path) -> None:
    dist = tmp_path / "dist"
    tarball = package_engine(cpu_engine, dist)
    assert read_sums((dist / SUMS_FILE).read_text())[tarball.name] == sha256_file(tarball)
    with tarfile.open(tarball) as archive:
        names = archive.getnames()
    top = f"kvmem-engine-{cpu_engine.key}"
    for rel in ("bin/llama-server", "bin/rpc-server", "lib/libllama.so", "build-info.json",
                "licenses/LICENSE-llama.cpp", "include/llama.h"):
        assert f"{top}/{rel}" in names
    installed = install_engine_package(str(tarball))
    assert installed.path.parent == store and installed.key == cpu_engine.key
    version = subprocess.run([str(installed.server), "--version"], capture_output=True, text=True, timeout=60)
    assert "kvmem-llama" in version.stdout + version.stderr  # relative RPATH: runs from its new place


@pytest.mark.engine
def test_tampered_package_is_refused(cpu_engine: Engine, tmp_path: Path, store: Path) -> None:
    dist = tmp_path / "dist"
    tarball = package_engine(cpu_engine, dist)
    data = bytearray(tarball.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tarball.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="SHA256SUMS says"):
        install_engine_package(str(tarball))
    assert not store.exists() or not any(store.iterdir())


@pytest.mark.engine
def test_repacked_binary_with_fresh_sums_is_still_refused(cpu_engine: Engine, tmp_path: Path, store: Path) -> None:
    """Someone swaps a binary and regenerates SHA256SUMS: build-info's per-file hashes catch it."""
    work = tmp_path / "work" / f"kvmem-engine-{cpu_engine.key}"
    shutil.copytree(cpu_engine.path, work, symlinks=True)
    (work / "bin" / "llama-server").write_bytes(b"#!/bin/sh\necho evil\n")
    dist = tmp_path / "dist"
    dist.mkdir()
    with tarfile.open(dist / f"{work.name}.tar.gz", "w:gz") as archive:
        archive.add(work, arcname=work.name)
    write_sums(dist)
    with pytest.raises(VerificationError, match="bin/llama-server does not match"):
        install_engine_package(str(dist / f"{work.name}.tar.gz"))


@pytest.mark.engine
def test_wrong_sm_is_refused_with_the_reason(cpu_engine: Engine, tmp_path: Path, store: Path) -> None:
    engine = fake_cuda_engine(cpu_engine, tmp_path / "cuda-sm90-fake", "90")
    tarball = package_engine(engine, tmp_path / "dist")
    with pytest.raises(KvmemError, match="no kernel image is available") as err:
        install_engine_package(str(tarball), gpu_sms=["86"])
    assert "kvmem build --sm 86" in (err.value.hint or "")
    with pytest.raises(KvmemError, match="no NVIDIA GPU is visible"):
        install_engine_package(str(tarball), gpu_sms=[])
    assert install_engine_package(str(tarball), gpu_sms=["90"]).sms == ["90"]


@pytest.mark.engine
def test_the_docs_table_names_each_packages_target_machine_code_and_sha(cpu_engine: Engine, tmp_path: Path) -> None:
    engine = fake_cuda_engine(cpu_engine, tmp_path / "cuda-sm89-fake", "89")
    info = {**engine.info, "machine_code": {"elf": ["sm_89"], "ptx": []}, "fa_quants": ["f16-f16", "q5_0-q5_0"],
            "build_seconds": 301.5}
    (engine.path / "build-info.json").write_text(json.dumps(info))
    tarball = package_engine(engine, tmp_path / "dist")
    script = str(ROOT / "packaging/make_packages.py")
    described = subprocess.run([sys.executable, script, "--describe", str(tmp_path / "dist")],
                               capture_output=True, text=True, timeout=120)
    assert described.returncode == 0, described.stderr
    (tmp_path / "packages.json").write_text(described.stdout)
    [package] = json.loads(described.stdout)
    assert package["sha256"] == sha256_file(tarball) and package["info"]["machine_code"]["elf"] == ["sm_89"]
    table = subprocess.run([sys.executable, script, "--table", str(tmp_path / "packages.json")],
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    row = table.stdout.splitlines()[-1]
    assert row.startswith("| cuda-sm89 | RTX 40xx") and "| 301.5 | sm_89 | f16-f16, q5_0-q5_0 |" in row
    assert sha256_file(tarball) in row


@pytest.mark.engine
def test_install_from_url_with_sums_next_to_it(cpu_engine: Engine, tmp_path: Path, store: Path) -> None:
    dist = tmp_path / "dist"
    tarball = package_engine(cpu_engine, dist)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(dist))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{tarball.name}"
        assert install_engine_package(url).key == cpu_engine.key
        (dist / SUMS_FILE).unlink()
        with pytest.raises(KvmemError, match="HTTP 404"):
            install_engine_package(url)
    finally:
        server.shutdown()


def test_unpack_refuses_a_pack_of_another_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    marker = json.dumps({"pin": "0" * 64, "series": "f" * 64}).encode()
    pack = tmp_path / "other.tar.gz"
    with tarfile.open(pack, "w:gz") as archive:
        info = tarfile.TarInfo("src/.kvmem-tree.json")
        info.size = len(marker)
        archive.addfile(info, io.BytesIO(marker))
    with pytest.raises(VerificationError, match="another pin or patch series"):
        unpack_source(pack)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("src"))


@pytest.mark.engine
def test_source_pack_round_trip(cpu_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack = pack_source(tmp_path / "out")  # reads the real cached patched tree
    ui_here = webui.source_hash(build.patched_tree(load_pin(), load_series()) / webui.UI_SUBDIR)
    assert pack.stat().st_size < 16 * 2**20  # small enough to carry to a build host
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    src = unpack_source(pack)
    for rel in ("CMakeLists.txt", "src/llama.cpp", "ggml/src/ggml-cuda/fattn.cu", "tools/server/main.cpp",
                "common/kvmem-version.h", ".kvmem-tree.json"):
        assert (src / rel).exists(), rel
    assert not (src / "docs").exists() and not (src / "models").exists()
    # a build host without npm finds the web UI built here (carried into its cache) under the same source hash
    assert webui.source_hash(src / webui.UI_SUBDIR) == ui_here
