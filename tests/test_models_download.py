"""Downloads against a real HTTP server on 127.0.0.1 (tests/hub_server.py), good and misbehaving."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import small_tmpfs
from hub_server import FakeHub, isolate_env, make_gguf

from kvmem_llama import models
from kvmem_llama.errors import KvmemError, VerificationError
from kvmem_llama.models import store
from kvmem_llama.models.download import partial_paths, read_state

REPO = "test-org/Tiny-GGUF"
FILE = "tiny-Q8_0.gguf"
NAME = f"{REPO}:{FILE}"
SIZE = 8 << 20


@pytest.fixture(scope="module")
def blob(tmp_path_factory) -> bytes:
    return make_gguf(tmp_path_factory.mktemp("gguf") / FILE, SIZE, seed=1).read_bytes()


@pytest.fixture
def hub(blob):
    with FakeHub() as h:
        h.add_file(REPO, FILE, blob)
        yield h


@pytest.fixture
def env(monkeypatch, tmp_path, hub) -> Path:
    return isolate_env(monkeypatch, tmp_path, hub)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pull(**kw) -> store.Record:
    return models.pull_model(NAME, backoff=0.01, **kw)


def _store_ggufs() -> list[Path]:
    return [p for p in store.store_dir().rglob("*.gguf")]


def _partial(blob: bytes) -> tuple[Path, Path]:
    part, state, _ = partial_paths(store.partial_dir(), _sha(blob))
    return part, state


def test_happy_path_8_connections(env, hub, blob):
    hub.behavior.rate = 4e6  # per connection, so the 8 requests overlap
    rec = _pull(connections=8)
    path = Path(rec.path)
    assert path.read_bytes() == blob
    assert rec.sha256 == _sha(blob) and rec.size == len(blob)
    assert path.is_relative_to(store.store_dir()) and not rec.in_place
    assert rec.source["kind"] == "hub" and rec.source["commit"] == hub.commits[REPO]
    assert hub.max_active == 8
    gets = hub.file_gets()
    assert all(g.status == 206 for g in gets)
    assert hub.bytes_served == len(blob)  # every byte fetched exactly once
    assert not list(store.partial_dir().iterdir())  # no partial or state left behind
    assert store.find(NAME.lower()).sha256 == rec.sha256
    # a second pull is a no-op: nothing fetched
    hub.reset_stats()
    assert _pull().path == rec.path and hub.bytes_served == 0


def test_range_answered_with_200_is_an_error_and_nothing_is_appended(env, hub, blob):
    hub.behavior.ignore_range = True
    with pytest.raises(KvmemError, match="with 200") as exc:
        _pull(connections=4)
    assert "HF_ENDPOINT" in exc.value.hint
    part, state = _partial(blob)
    assert sum(read_state(state)["done"]) == 0
    assert part.stat().st_size == len(blob) and part.read_bytes().count(0) == len(blob)  # sparse zeros only
    assert _store_ggufs() == [] and store.records() == []


def test_wrong_content_range_is_an_error(env, hub, blob):
    hub.behavior.wrong_range = True
    with pytest.raises(KvmemError, match="Content-Range"):
        _pull(connections=2)
    part, state = _partial(blob)
    assert sum(read_state(state)["done"]) == 0 and part.read_bytes().count(0) == len(blob)


def test_sha256_mismatch_keeps_nothing_and_says_expected_vs_got(env, hub, blob):
    hub.behavior.wrong_hash = True
    with pytest.raises(VerificationError) as exc:
        _pull()
    msg = str(exc.value)
    reported = hashlib.sha256(_sha(blob).encode()).hexdigest()  # what the misbehaving API claims
    assert f"expected {reported}" in msg and f"got {_sha(blob)}" in msg
    assert "again" in exc.value.hint
    assert _store_ggufs() == [] and store.records() == []
    assert not any(store.partial_dir().glob("*.part"))


def test_truncated_bodies_are_resumed_not_accepted(env, hub, blob):
    hub.behavior.truncate_after = 300_000  # every answer stops short of its Content-Length
    rec = _pull(connections=4)
    assert Path(rec.path).read_bytes() == blob
    assert len(hub.file_gets()) > 16  # more requests than segments: the rest was asked for again
    assert hub.bytes_served == len(blob)  # and nothing twice


def test_body_that_never_arrives_fails_after_retries_and_keeps_partial(env, hub, blob):
    hub.behavior.truncate_after = 0
    with pytest.raises(KvmemError, match="keeps failing") as exc:
        _pull(connections=2, max_retries=2)
    assert "resume" in exc.value.hint
    part, state = _partial(blob)
    assert part.exists() and state.exists() and store.records() == []


def test_connection_drops_are_retried_without_refetching(env, hub, blob):
    hub.behavior.drop_first = 6
    hub.behavior.drop_after = 50_000
    rec = _pull(connections=4)
    assert Path(rec.path).read_bytes() == blob
    assert hub.bytes_served == len(blob)


def test_server_errors_are_retried_then_reported(env, hub):
    hub.behavior.status = 503
    with pytest.raises(KvmemError, match="HTTP 503"):
        _pull(connections=1, max_retries=1)
    assert len(hub.file_gets()) == 2  # one try + one retry


def test_token_is_sent_and_401_explained(env, hub, blob, monkeypatch, tmp_path):
    hub.behavior.require_token = "s3cret"
    with pytest.raises(KvmemError, match="401") as exc:
        _pull()
    assert "HF_TOKEN" in exc.value.hint
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(token_file))
    assert Path(_pull().path).read_bytes() == blob


def test_plain_http_only_to_loopback(env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.example.com")
    with pytest.raises(KvmemError, match="only https") as exc:
        _pull()
    assert "--insecure" in exc.value.hint


def test_hash_matches_but_not_gguf_keeps_nothing(env, hub):
    page = b"<!DOCTYPE html><html><body>rate limited</body></html>" * 20000
    hub.add_file(REPO, "page.gguf", page)
    with pytest.raises(KvmemError, match="HTML page"):
        models.pull_model(f"{REPO}:page.gguf")
    assert _store_ggufs() == [] and store.records() == []


def _cli(env_home: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvmem_llama.cli.main", *args], env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_progress(state: Path, proc: subprocess.Popen, at_least: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        st = read_state(state)
        if st and sum(st["done"]) >= at_least:
            return sum(st["done"])
        time.sleep(0.05)
    raise AssertionError("no download progress")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_killed_download_resumes_without_refetching(env, hub, blob, sig):
    hub.behavior.rate = 1.5e6  # ~1.5 s per segment, so the kill lands mid-download
    part, state = _partial(blob)
    proc = _cli(env, "pull", NAME, "--connections", "4")
    _wait_progress(state, proc, len(blob) // 4)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    if sig == signal.SIGINT:  # Ctrl-C: a clean message, exit code 130, state saved
        assert proc.returncode == 130 and "interrupted" in err and "resume" in err
    else:
        assert proc.returncode == -signal.SIGKILL
    st = read_state(state)
    kept = sum(st["done"])
    assert 0 < kept < len(blob)
    seg = st["segment_size"]
    missing = {f"bytes={i * seg + d}-{min(len(blob), (i + 1) * seg) - 1}"
               for i, d in enumerate(st["done"]) if i * seg + d < min(len(blob), (i + 1) * seg)}
    assert store.records() == []
    hub.reset_stats()
    hub.behavior.rate = None
    proc = _cli(env, "pull", NAME)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert hub.bytes_served == len(blob) - kept  # exactly the missing bytes, none twice
    assert {g.range for g in hub.file_gets()} == missing  # each range starts where the disk ends
    rec = store.find(NAME)
    assert rec and Path(rec.path).read_bytes() == blob


def _hf_cache_file(cache: Path, repo: str, filename: str, data: bytes, commit: str) -> Path:
    """Lay out one file as huggingface_hub's downloads do: the blob named after its sha256 in blobs/, a
    relative symlink to it in snapshots/COMMIT/, refs/main holding the commit. Returns the snapshot path."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    blob_path = repo_dir / "blobs" / _sha(data)
    blob_path.parent.mkdir(parents=True)
    blob_path.write_bytes(data)
    snapshot = repo_dir / "snapshots" / commit / filename
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(os.path.relpath(blob_path, snapshot.parent))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)  # no newline, as the hub client writes it
    return snapshot


def test_hf_cache_discovery_uses_the_file_in_place(env, hub, blob, tmp_path, monkeypatch):
    cache = Path(os.environ["HF_HUB_CACHE"])
    got = _hf_cache_file(cache, REPO, FILE, blob, hub.commits[REPO])
    assert Path(got).read_bytes() == blob
    hub.reset_stats()
    rec = models.pull_model(NAME)
    assert rec.in_place and rec.source["kind"] == "hf-cache"
    assert Path(rec.path).resolve() == Path(got).resolve() and Path(rec.path).is_relative_to(cache)
    assert hub.bytes_served == 0 and _store_ggufs() == []  # no second copy
    # a catalog alias with a quant glob is found offline (hub gone) through the cache scan
    (env / "catalog.json").parent.mkdir(parents=True, exist_ok=True)
    (env / "catalog.json").write_text(json.dumps({"models": {"tiny": {"repo": REPO, "quant": ["*Q8_0*.gguf"]}}}))
    store.remove(NAME)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    resolved = models.resolve_model("tiny")
    assert resolved.path.resolve() == Path(got).resolve() and resolved.alias == "tiny"
    assert resolved.record.verified_at  # hashed against the blob's sha256 name before use
    # a damaged cached blob is refused, not used
    store.remove("tiny")
    blob_path = Path(got).resolve()
    blob_path.chmod(0o644)
    with open(blob_path, "r+b") as fh:
        fh.seek(len(blob) - 10)
        fh.write(b"XXXXXXXXXX")
    with pytest.raises(VerificationError, match="expected"):
        models.resolve_model("tiny")


def test_user_catalog_quant_selector_pulls_from_hub(env, hub, blob):
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", blob[:-1] + b"\x01")  # another quant in the same repo
    env.mkdir(parents=True, exist_ok=True)
    (env / "catalog.json").write_text(json.dumps({"models": {
        "tiny": {"repo": REPO, "quant": ["*Q8_0*.gguf"], "profiles": [{"min_vram_gib": 8, "ctx": 4096}]},
        "tiny:wrong": {"repo": REPO, "file": FILE, "sha256": "0" * 64},
    }}))
    resolved = models.resolve_model("tiny", pull=True, confirm=lambda msg: FILE in msg)
    assert resolved.path.read_bytes() == blob and resolved.entry.profile_for(12) == {"min_vram_gib": 8, "ctx": 4096}
    with pytest.raises(KvmemError, match="declined"):
        models.resolve_model(f"{REPO}:tiny-Q4_K_M.gguf", pull=True, confirm=lambda msg: False)
    with pytest.raises(VerificationError, match="catalog expects"):  # a catalog hash pins the file
        models.pull_model("tiny:wrong")
    hub.reset_stats()
    with pytest.raises(KvmemError, match="not in the model store") as exc:  # no pull: a hint, nothing fetched
        models.resolve_model(f"{REPO}:tiny-Q4_K_M.gguf")
    assert exc.value.hint == f"kvmem pull {REPO}:tiny-Q4_K_M.gguf" and hub.log == []


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs (needs root / CAP_SYS_ADMIN, as in the CI container); skipped where mounting is refused."""
    with small_tmpfs(tmp_path, "12m") as mnt:
        yield mnt


def test_disk_full_mid_download_keeps_partial_and_resumes(env, hub, blob, small_disk, monkeypatch):
    from kvmem_llama.models import download

    monkeypatch.setenv("KVMEM_HOME", str(small_disk / "home"))
    # the up-front free-space check refuses when the file cannot fit at all ...
    hub.add_file(REPO, "big.gguf", blob * 2)
    with pytest.raises(KvmemError, match="not enough disk space"):
        models.pull_model(f"{REPO}:big.gguf")
    # ... and a disk that fills up during the download (another writer) is a clear error, partial kept
    monkeypatch.setattr(download, "DISK_MARGIN", 0)
    hub.behavior.rate = 2e6
    part, state = _partial(blob)
    filler = small_disk / "filler"

    def fill() -> None:
        while not (state.exists() and sum((read_state(state) or {"done": [0]})["done"]) > (2 << 20)):
            time.sleep(0.02)
        with open(filler, "wb") as fh:
            with contextlib.suppress(OSError):
                for _ in range(12 << 4):
                    fh.write(b"\0" * (64 << 10))

    t = threading.Thread(target=fill)
    t.start()
    with pytest.raises(KvmemError, match="disk full while writing") as exc:
        _pull(connections=4)
    t.join()
    assert "resume" in exc.value.hint
    st = read_state(state)
    kept = sum(st["done"])
    assert 0 < kept < len(blob) and part.exists() and store.records() == []
    filler.unlink()
    hub.reset_stats()
    hub.behavior.rate = None
    rec = _pull(connections=4)
    assert Path(rec.path).read_bytes() == blob
    assert hub.bytes_served == len(blob) - kept  # resumed from the state file, nothing fetched twice
