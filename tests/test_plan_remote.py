"""`kvmem plan` for a hub model that is not downloaded: only its GGUF header is read, over HTTP Range
requests to a real hub server on 127.0.0.1 (tests/hub_server.py) that counts every byte it sends."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import FakeHub, isolate_env

from kvmem_llama import hardware, planner, synth
from kvmem_llama.default_model import default_model_path
from kvmem_llama.models import store
from kvmem_llama.models.gguf_header import read_header
from kvmem_llama.models.gguf_info import model_info
from kvmem_llama.models.remote_gguf import MAX_CHUNK, cache_dir

SMOL_REPO, SMOL_FILE = "test-org/SmolLM2-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf"
# the catalog's qwen27b entry: unsloth/Qwen3.8-27B-GGUF, the first file matching *UD-Q4_K_XL*.gguf
QWEN_REPO, QWEN_FILE = "unsloth/Qwen3.8-27B-GGUF", "Qwen3.8-27B-UD-Q4_K_XL.gguf"


def kvmem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return default_model_path()  # before any test points KVMEM_CACHE elsewhere


@pytest.fixture(scope="module")
def smol_bytes(smol_path: Path) -> bytes:
    return smol_path.read_bytes()


@pytest.fixture(scope="module")
def qwen27b_file(tmp_path_factory) -> Path:
    """The Qwen3.8-27B shape with its MTP head: the real 8 MB header (248K-token vocabulary) and 15.5 GB of
    tensor data left as a sparse hole, so the hub serves a file of the real size that takes no disk."""
    out = tmp_path_factory.mktemp("q27") / QWEN_FILE
    return synth.synthesize(out, "qwen35", "qwen35-27b", mtp=True, quant="q4_k", zero_weights=True).path


def test_plan_reads_only_the_header_and_caches_it(monkeypatch, tmp_path, smol_path, smol_bytes) -> None:
    with FakeHub() as hub:
        hub.add_file(SMOL_REPO, SMOL_FILE, smol_bytes)
        isolate_env(monkeypatch, tmp_path, hub)
        monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
        name = f"{SMOL_REPO}:{SMOL_FILE}"
        out = kvmem("plan", name, "--vram", "8G", "--ram", "32G", "--json")
        assert out.returncode == 0, out.stderr
        remote = json.loads(out.stdout)
        header_end = read_header(smol_path).data_offset
        # every byte the hub sent was header: nothing at or past the tensor data, one final step at most past it
        gets = hub.file_gets()
        assert gets and all(g.status == 206 for g in gets)
        served = hub.bytes_served
        assert served == remote["not_downloaded"]["fetched_bytes"]
        assert header_end <= served <= header_end + MAX_CHUNK and served < len(smol_bytes) // 10
        assert remote["not_downloaded"]["size"] == len(smol_bytes)
        assert remote["not_downloaded"]["sha256"] == hashlib.sha256(smol_bytes).hexdigest()
        assert remote["not_downloaded"]["cached"] is False
        assert not list(store.store_dir().rglob("*.gguf"))  # nothing was downloaded

        # the same plan as from the downloaded file
        local = planner.plan(model_info(smol_path), hardware.detect(vram="8G", ram="32G"), label=name)
        assert remote["ledger"] == [{"item": i, "bytes": b, "note": n} for i, b, n in local.ledger]
        assert remote["profile"] == json.loads(json.dumps(local.to_dict()["profile"]))
        assert remote["kv_per_token"] == local.kv_per_token

        # the second plan reads the cached header: the hub's API is asked, no byte of the file is sent
        hub.reset_stats()
        again = kvmem("plan", name, "--vram", "8G", "--ram", "32G")
        assert again.returncode == 0, again.stderr
        assert hub.bytes_served == 0 and not hub.file_gets()
        assert "not downloaded yet (0.1 GB)" in again.stdout and "(cached)" in again.stdout
        assert (cache_dir() / f"{hashlib.sha256(smol_bytes).hexdigest()}.head").stat().st_size <= header_end


def test_plan_qwen27b_16g_q5_0_without_downloading(monkeypatch, tmp_path, qwen27b_file) -> None:
    size = qwen27b_file.stat().st_size
    header_end = read_header(qwen27b_file).data_offset
    with FakeHub() as hub:
        hub.add_path(QWEN_REPO, QWEN_FILE, qwen27b_file, sha256=hashlib.sha256(QWEN_FILE.encode()).hexdigest())
        hub.add_file(QWEN_REPO, "Qwen3.8-27B-Q8_0.gguf", b"GGUF not this one")  # the quant glob picks the right file
        isolate_env(monkeypatch, tmp_path, hub)
        monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
        out = kvmem("plan", "qwen27b", "--vram", "16G", "--ram", "64G", "--ctk", "q5_0")
        assert out.returncode == 0, out.stderr
        assert f"qwen27b: not downloaded yet ({size / 1e9:.1f} GB)" in out.stdout
        assert f"kvmem pull qwen27b downloads {QWEN_REPO}:{QWEN_FILE}" in out.stdout.replace("`", "")
        assert "q5_0" in out.stdout and "16 of 64 layers hold KV" in out.stdout
        served = hub.bytes_served
        assert header_end <= served <= header_end + MAX_CHUNK  # 8 MB of a 15.5 GB file
        assert len(hub.file_gets()) <= 12  # the step doubles: a few requests, not one per string
        ranges = sorted(int(g.range.split("=")[1].split("-")[0]) for g in hub.file_gets())
        assert ranges[0] == 0 and all(r < header_end for r in ranges)  # contiguous, never into the data

    local = planner.plan(model_info(qwen27b_file), hardware.detect(vram="16G", ram="64G"), ctk="q5_0")
    assert local.profile.ctk == "q5_0" and local.profile.budget > 0


def test_server_ignoring_range_is_refused_without_reading_the_file(monkeypatch, tmp_path, smol_bytes) -> None:
    with FakeHub() as hub:
        hub.add_file(SMOL_REPO, SMOL_FILE, smol_bytes)
        hub.behavior.ignore_range = True  # a proxy that answers 200 with the whole body
        isolate_env(monkeypatch, tmp_path, hub)
        monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
        out = kvmem("plan", f"{SMOL_REPO}:{SMOL_FILE}", "--vram", "8G")
        assert out.returncode == 1
        assert "ignores Range requests" in out.stderr and "kvmem pull" in out.stderr
        assert "Traceback" not in out.stderr
        hub.wait_idle()
        assert hub.bytes_served < len(smol_bytes) // 2  # the client hung up instead of taking the model
        assert not cache_dir().exists() or not list(cache_dir().iterdir())


def test_not_a_gguf_on_the_hub_is_a_clear_error(monkeypatch, tmp_path) -> None:
    page = b"<!DOCTYPE html><html><body>Sign in to continue</body></html>" * 20
    with FakeHub() as hub:
        hub.add_file(SMOL_REPO, "page.gguf", page)
        isolate_env(monkeypatch, tmp_path, hub)
        monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
        out = kvmem("plan", f"{SMOL_REPO}:page.gguf")
        assert out.returncode == 1
        assert "not a GGUF file (found an HTML page" in out.stderr and "Traceback" not in out.stderr
