"""`kvmem doctor` on real files: a healthy setup passes, each classic failure is named with its fix."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvmem_llama import doctor, hardware
from kvmem_llama.engine import Engine, list_engines
from kvmem_llama.serving.process import free_port


def by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def cpu_hw(ram: str | None = None) -> hardware.Hardware:
    return hardware.detect(vram="0", ram=ram)


def write_gguf(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_head_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_healthy_default_model(cpu_engine: Engine, smollm2: Path) -> None:
    checks = by_name(doctor.run_checks(None, port=free_port(), hw=cpu_hw()))
    assert [c for c in checks.values() if c.status == "fail"] == []
    assert checks["architecture"].status == "ok" and cpu_engine.key in checks["architecture"].detail
    assert checks["format"].detail == "GGUF v3, architecture llama; 30 layers, 30 with KV, KV 23,040 B/token at f16"
    assert checks["format"].facts["kv_bytes_per_token"]["f16"] == 23040
    assert checks["checksum"].status == "ok" and "b179c9523d0e6a0f" in checks["checksum"].detail
    assert checks["port"].status == "ok" and checks["paths"].status == "ok"
    assert checks["driver"].status == "skip"  # no NVIDIA driver on this machine


def test_engine_reads_real_files(cpu_engine: Engine, smollm2: Path, tmp_path: Path) -> None:
    assert doctor.engine_reads(cpu_engine, smollm2) == (True, "")
    ok, why = doctor.engine_reads(cpu_engine, write_gguf(tmp_path / "alien.gguf", "notanarch"))
    assert not ok and why == "unknown model architecture: 'notanarch'"


def test_unknown_arch_and_not_gguf(cpu_engine: Engine, tmp_path: Path) -> None:
    alien = write_gguf(tmp_path / "alien.gguf", "notanarch")
    fmt = by_name(doctor.run_checks(str(alien), port=free_port(), hw=cpu_hw()))["format"]
    assert fmt.status == "fail" and "unknown model architecture: 'notanarch'" in fmt.detail
    assert fmt.fix.startswith("update kvmem")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"<html>rate limited</html>" * 40)
    checks = by_name(doctor.run_checks(str(junk), port=free_port(), hw=cpu_hw()))
    assert checks["format"].status == "fail" and checks["format"].fix
    assert checks["host RAM"].status == "skip"


def test_checksum_mismatch(smollm2: Path, tmp_path: Path) -> None:
    copy = tmp_path / smollm2.name  # same name as the shipped file, one byte changed in the tensor data
    shutil.copyfile(smollm2, copy)
    with open(copy, "r+b") as fh:
        fh.seek(-100, 2)
        byte = fh.read(1)
        fh.seek(-100, 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    check = by_name(doctor.run_checks(str(copy), port=free_port(), hw=cpu_hw()))["checksum"]
    assert check.status == "fail" and "b179c9523d0e6a0f" in check.detail and "pull it again" in check.fix


def test_port_ram_and_architecture_failures(cpu_engine: Engine, smollm2: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        checks = by_name(doctor.run_checks(None, port=port, hw=cpu_hw("50M")))
    assert checks["port"].status == "fail" and "--port auto" in checks["port"].fix
    assert checks["host RAM"].status == "fail" and "do not fit" in checks["host RAM"].detail
    gpu = hardware.Hardware([hardware.GPU(0, "NVIDIA GeForce RTX 4090", "89", 24 << 30, 24 << 30)],
                            64 << 30, 64 << 30, 8, "580.1", "13.0")
    if not any(e.sms and e.runs_on("89") for e in list_engines()):
        arch = by_name(doctor.run_checks(None, port=free_port(), hw=gpu))["architecture"]
        assert arch.status == "fail" and arch.fix.startswith("kvmem build --sm 89")


def test_cli_exit_code(tmp_path: Path) -> None:
    module = "kvmem_llama.cli.main"
    junk = tmp_path / "broken.gguf"
    junk.write_bytes(b"\0" * 64)
    bad = subprocess.run([sys.executable, "-m", module, "doctor", str(junk), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "check(s) failed" in bad.stderr
    good = subprocess.run([sys.executable, "-m", module, "doctor", "--port", str(free_port()), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr


def test_unrecorded_file_points_to_kvmem_import(smollm2: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_HOME", str(tmp_path / "home"))  # an empty model store
    mine = tmp_path / "mine.gguf"
    shutil.copyfile(smollm2, mine)
    check = by_name(doctor.run_checks(str(mine), port=free_port(), hw=cpu_hw()))["checksum"]
    assert check.status == "skip" and "`kvmem import PATH --alias NAME`" in check.fix
    # what the fix says, done: the file then has a record and the check passes
    done = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", "import", str(mine), "--alias", "mine"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check = by_name(doctor.run_checks("mine", port=free_port(), hw=cpu_hw()))["checksum"]
    assert check.status == "ok" and "matches the model store record" in check.detail


@pytest.mark.parametrize("label", ["modèle"])
def test_non_ascii_path_is_reported(smollm2: Path, tmp_path: Path, label: str) -> None:
    folder = tmp_path / label
    folder.mkdir()
    copy = folder / "copy.gguf"
    shutil.copyfile(smollm2, copy)
    paths_check = by_name(doctor.run_checks(str(copy), port=free_port(), hw=cpu_hw()))["paths"]
    assert paths_check.status == "warn" and label in paths_check.detail and paths_check.fix
