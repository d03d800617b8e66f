"""The fault table of docs/reliability/README.md (issue 17): each fault with what the user sees, on the real
CPU engine with real processes, real files and real HTTP on 127.0.0.1. Rows covered by older tests are
named in the table; this file has the others.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import small_tmpfs
from hub_server import FakeHub, isolate_env, make_gguf

from kvmem_llama import models
from kvmem_llama.engine import Engine
from kvmem_llama.errors import KvmemError
from kvmem_llama.models import store
from kvmem_llama.models.download import partial_paths, read_state
from kvmem_llama.serving import argv, process, readiness, registry
from kvmem_llama.serving.process import ServerFailed

REPO = "test-org/Smol-GGUF"
FILE = "smol-Q4_1.gguf"


# --- helpers ---


def kvmem(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200", **(env or {})})


def one_line(text: str) -> str:
    """rich wraps long messages at 140 columns when piped: compare without the line breaks."""
    return " ".join(text.split())


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private `kvmem ps` registry; every server still registered at the end is stopped."""
    folder = tmp_path / "servers"
    monkeypatch.setenv("KVMEM_SERVERS_DIR", str(folder))
    yield folder
    for record in registry.list_records():
        if record.alive:
            registry.stop(record, 5)


def run_detached(name: str, *server_args: str, extra: tuple[str, ...] = (), engine: Engine,
                 timeout: float = 300) -> registry.ServerRecord:
    out = kvmem("run", "--detach", "--name", name, "--port", "auto", "--engine", str(engine.path), *extra, "--",
                "-t", "2", *server_args, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    record = registry.load(name)
    assert record is not None and record.alive
    return record


def haystack(tokens: int) -> str:
    """About `tokens` tokens of SmolLM2 filler (4.8 tokens a sentence)."""
    filler = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go."]
    return " ".join(filler[i % 4] for i in range(int(tokens / 4.8)))


# --- model files ---


def test_truncated_gguf_is_refused_before_a_server_starts(cpu_engine: Engine, smollm2: Path, tmp_path: Path,
                                                          servers: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(smollm2, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(smollm2.stat().st_size - (1 << 20)))  # a download that stopped 1 MiB short
    out = kvmem("run", str(cut), "--port", "auto", "--engine", str(cpu_engine.path))
    err = one_line(out.stderr)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"tensor data needs {smollm2.stat().st_size} bytes, the file has {cut.stat().st_size}" in err, err
    assert "hint:" in err and "Traceback" not in out.stderr
    assert registry.list_records() == []  # nothing was started


def test_unknown_architecture_is_named_by_the_engine(cpu_engine: Engine, tmp_path: Path, servers: Path) -> None:
    alien = make_gguf(tmp_path / "alien.gguf", 1 << 20, arch="notanarch")
    out = kvmem("run", str(alien), "--port", "auto", "--engine", str(cpu_engine.path), "--", "-c", "256", "-t", "2")
    text = one_line(out.stdout + out.stderr)
    assert out.returncode == 1, text
    # the engine's own words, first in the message, then its last log lines
    assert ("error: llama-server exited with code 1 while starting: error loading model: unknown model "
            "architecture: 'notanarch'") in text, text
    assert "last lines of" in text
    assert "Traceback" not in out.stderr
    assert [r for r in registry.list_records() if r.alive] == []


def test_model_changed_after_pull_is_refused_at_run(cpu_engine: Engine, smollm2: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, servers: Path) -> None:
    with FakeHub() as hub:
        hub.add_path(REPO, FILE, smollm2, store_sha := _sha(smollm2))
        isolate_env(monkeypatch, tmp_path, hub)
        pulled = kvmem("pull", f"{REPO}:{FILE}")
        assert pulled.returncode == 0, pulled.stderr
    rec = store.find(f"{REPO}:{FILE}")
    assert rec is not None and rec.sha256 == store_sha and not rec.in_place
    path = Path(rec.path)
    path.chmod(0o644)
    with open(path, "r+b") as fh:  # one byte of the tensor data changes; the size does not
        fh.seek(-4096, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-4096, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0x01]))
    out = kvmem("run", f"{REPO}:{FILE}", "--port", "auto", "--engine", str(cpu_engine.path))
    err = one_line(out.stderr)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"sha256 mismatch: expected {store_sha}, got " in err, err
    assert "the file changed on disk" in err and "pull it again" in err
    assert registry.list_records() == []  # refused before any server started
    with open(path, "r+b") as fh:  # put the byte back: the same command resolves the model again
        fh.seek(-4096, os.SEEK_END)
        fh.write(byte)
    assert models.resolve_model(f"{REPO}:{FILE}").path == path


def _sha(path: Path) -> str:
    from kvmem_llama.files import sha256_file

    return sha256_file(path)


def test_non_ascii_and_space_paths_end_to_end(cpu_engine: Engine, smollm2: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The model, KVMEM_HOME and the server registry (log files) all under paths with spaces and non-ASCII."""
    odd = tmp_path / "mödel dir 模型"
    odd.mkdir()
    model = odd / "smol lm ü.gguf"
    shutil.copyfile(smollm2, model)
    monkeypatch.setenv("KVMEM_HOME", str(tmp_path / "kvmem home ü"))
    monkeypatch.setenv("KVMEM_SERVERS_DIR", str(tmp_path / "kvmem home ü" / "sérvers"))
    try:
        record = run_detached("spaced", "-c", "1024", extra=(str(model),), engine=cpu_engine)
        assert record.model_path == str(model) and " " in record.log_path and "ü" in record.log_path
        reply = httpx.post(f"{record.url}/v1/chat/completions", timeout=120, json={
            "model": record.model_id, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
        assert record.model_id == "smol-lm"  # the file name, slugged to ASCII
        rows = json.loads(kvmem("ps", "--json").stdout)
        assert [(r["name"], r["state"]) for r in rows] == [("spaced", "running")]
        logs = kvmem("logs", "spaced", "-n", "400")
        assert logs.returncode == 0 and "listening on" in logs.stdout and "模型" in logs.stdout
    finally:
        for rec in registry.list_records():
            registry.stop(rec, 5)


def test_port_taken_between_the_check_and_the_bind_is_reported_with_the_log(cpu_engine: Engine, smollm2: Path,
                                                                             tmp_path: Path) -> None:
    """`kvmem run --port N` checks the port first (test_launcher's test_port_in_use_is_a_clear_error); if
    another program takes it before llama-server binds, the server's own words come back, not a hang."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        t = time.monotonic()
        with pytest.raises(ServerFailed) as err:
            process.start_llama_server(cpu_engine.server, smollm2, ["-c", "256", "-t", "2"], tmp_path / "s.log",
                                       port=port, timeout=120)
        assert time.monotonic() - t < 60
    text = str(err.value)
    assert (f"exited with code 1 while starting: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
            f"port: {port}") in text, text
    assert "last lines of" in text


# --- the server process ---


def _stream_until_killed(url: str, model: str, started: threading.Event, result: dict) -> None:
    body = {"model": model, "stream": True, "max_tokens": 2000, "temperature": 0.7, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]}
    t = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    result["chunks"] = result.get("chunks", 0) + 1
                    started.set()
        result["error"] = None
    except httpx.HTTPError as exc:
        result["error"] = exc
    result["seconds"] = time.monotonic() - t
    result["ended"] = time.monotonic()
    started.set()


def test_sigkill_mid_stream_detached(cpu_engine: Engine, servers: Path) -> None:
    """The OOM killer (SIGKILL) mid-answer: the client gets an error at once, `kvmem ps` says crashed with
    the exit code (the monitor that started it recorded it), the log is kept, `kvmem stop` forgets it.
    (Two parallel slots: readiness expects each slot's share of -c, which it used to refuse.)"""
    record = run_detached("victim", "-c", "4096", "-np", "2", engine=cpu_engine)  # 2 slots of 2,048 tokens
    assert httpx.get(f"{record.url}/v1/models", timeout=10).json()["data"][0]["meta"]["n_ctx"] == 2048
    started, result = threading.Event(), {}
    client = threading.Thread(target=_stream_until_killed, args=(record.url, record.model_id, started, result))
    client.start()
    assert started.wait(120) and result.get("chunks", 0) > 0, result
    os.kill(record.pid, signal.SIGKILL)
    killed = time.monotonic()
    client.join(30)
    assert not client.is_alive(), "the client hangs after the server died"
    assert isinstance(result["error"], httpx.RemoteProtocolError), result  # an error, not a clean end
    assert result["ended"] - killed < 10
    deadline = time.monotonic() + 10
    while (rows := json.loads(kvmem("ps", "--json").stdout))[0]["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    row = rows[0]
    assert (row["name"], row["alive"], row["state"], row["exit_code"]) == ("victim", False, "crashed", -9), row
    assert row["status"] == "crashed (exit code -9, SIGKILL)"
    table = kvmem("ps")
    assert "crashed (exit code -9, SIGKILL)" in table.stdout, table.stdout
    log = Path(record.log_path).read_text()
    assert "listening on" in log and f"llama-server (pid {record.pid}) killed by SIGKILL (exit code -9)" in log
    logs = kvmem("logs", "victim", "-n", "5")
    assert logs.returncode == 0 and "killed by SIGKILL" in logs.stdout
    stop = kvmem("stop", "victim")
    assert stop.returncode == 0 and "victim: not running" in stop.stdout
    assert registry.load("victim") is None and Path(record.log_path).exists()  # forgotten; the log stays


def test_sigkill_mid_stream_foreground(cpu_engine: Engine, servers: Path) -> None:
    """The same crash under a foreground `kvmem run`: it exits 1 with the exit code and the last log lines,
    and `kvmem ps` (another terminal) shows the server as crashed."""
    run = subprocess.Popen([sys.executable, "-m", "kvmem_llama.cli.main", "run", "--quiet", "--name", "fg",
                            "--port", "auto", "--engine", str(cpu_engine.path), "--", "-c", "2048", "-t", "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 180
        while (record := registry.load("fg")) is None or not _ready(record.url):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.3)
        started, result = threading.Event(), {}
        client = threading.Thread(target=_stream_until_killed, args=(record.url, record.model_id, started, result))
        client.start()
        assert started.wait(120)
        os.kill(record.pid, signal.SIGKILL)
        out, err = run.communicate(timeout=30)
        client.join(30)
        assert not client.is_alive() and isinstance(result["error"], httpx.RemoteProtocolError)
        text = one_line(err)
        assert run.returncode == 1
        assert "llama-server crashed (exit code -9, SIGKILL)" in text and "last lines of" in text, text
        rows = json.loads(kvmem("ps", "--json").stdout)
        assert [(r["name"], r["state"], r["exit_code"], r["detached"]) for r in rows] == [("fg", "crashed", -9,
                                                                                           False)]
        assert Path(record.log_path).exists()
    finally:
        if run.poll() is None:
            run.kill()


def _ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


def test_stop_during_a_long_prefill_is_prompt_and_the_client_gets_an_error(cpu_engine: Engine,
                                                                           servers: Path) -> None:
    """llama-server honours SIGTERM only after the batch it computes and then waits for its open requests
    (measured: a 30 s linger for a stream, minutes for a prompt); `kvmem stop` sends a second SIGTERM after
    FORCE_AFTER s, which makes it exit at once: the stop takes seconds and the client gets an error."""
    record = run_detached("busy", "-c", "8192", "-np", "1", "--kvmem-budget", "1024", engine=cpu_engine)
    result: dict = {}

    def ask() -> None:
        t = time.monotonic()
        try:
            resp = httpx.post(f"{record.url}/v1/chat/completions", timeout=600, json={
                "model": record.model_id, "max_tokens": 8,
                "messages": [{"role": "user", "content": haystack(6500) + " How many sentences?"}]})
            result["status"] = resp.status_code
        except httpx.HTTPError as exc:
            result["error"] = exc
        result["ended"], result["seconds"] = time.monotonic(), time.monotonic() - t

    client = threading.Thread(target=ask)
    client.start()
    deadline = time.monotonic() + 60
    while not any(s["is_processing"] for s in httpx.get(f"{record.url}/slots", timeout=10).json()):
        assert time.monotonic() < deadline, "the prompt never started"
        time.sleep(0.2)
    time.sleep(2)  # well inside the prefill of a 6.5K-token prompt on the CPU
    t = time.monotonic()
    stop = kvmem("stop", "busy")
    took = time.monotonic() - t
    client.join(30)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert took < process.FORCE_AFTER + 8, (took, stop.stdout)
    assert "busy: stopped" in stop.stdout and "killed" not in stop.stdout, stop.stdout
    assert not client.is_alive() and "error" in result, result  # not a hang, not a made-up answer
    assert result["ended"] - t < process.FORCE_AFTER + 8
    assert not psutil.pid_exists(record.pid) or psutil.Process(record.pid).status() == psutil.STATUS_ZOMBIE
    assert registry.load("busy") is None
    log = Path(record.log_path).read_text()
    assert "kvmem_score: ARMED" in log and "=== kvmem: llama-server" in log  # the log is kept, with the end


def _concurrent_prompts(url: str, model: str, n: int = 2) -> list[httpx.Response]:
    def ask(i: int) -> httpx.Response:
        time.sleep(2 * i)  # the second arrives while the first is being read
        text = " ".join(f"Sentence {j} of story {i} is about the river and the mill." for j in range(120))
        return httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 48})

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(ask, range(n)))


def test_parallel_slots_beyond_the_working_set_wait_instead_of_failing(cpu_engine: Engine, servers: Path) -> None:
    """Found by the soak: each busy slot keeps at least sink + recent + 2 blocks of the shared working set, so
    -np 2 with --kvmem-budget 384 used to start and then fail both of two concurrent prompts with HTTP 500 'no
    room for a ubatch'. Now the server lets only as many slots work as the working set holds (one here) and the
    other request waits; `kvmem run` says so and names the budget that serves both at once."""
    small = ["-c", "8192", "-np", "2", "--kv-unified", "--kvmem-block", "64", "--kvmem-sink", "64", "--kvmem-recent",
             "128", "--kvmem-gen-reserve", "64"]
    out = kvmem("run", "--detach", "--name", "tight", "--port", "auto", "--engine", str(cpu_engine.path), "--",
                "-t", "2", *small, "--kvmem-budget", "384")
    assert out.returncode == 0, out.stdout + out.stderr
    warning = one_line(out.stderr)
    assert ("warning: -np 2 with --kvmem-budget 384: the GPU working set serves 1 slot at once (each keeps at least "
            "sink + recent + 2 blocks and an open block or its --kvmem-gen-reserve), so further requests wait until "
            "one finishes; use --kvmem-budget 640 to serve all 2 at once") in warning, warning
    record = registry.load("tight")
    assert record is not None
    answers = _concurrent_prompts(record.url, record.model_id)
    assert [resp.status_code for resp in answers] == [200, 200], [resp.text[:200] for resp in answers]
    log = Path(record.log_path).read_text()
    assert "kvmem: the GPU working set holds 1 of the 2 slots at once (--kvmem-budget 384)" in log
    assert "no room for a ubatch" not in log
    registry.stop(record, 5)
    out = kvmem("run", "--detach", "--name", "roomy", "--port", "auto", "--engine", str(cpu_engine.path), "--",
                "-t", "2", *small, "--kvmem-budget", "640")  # what the warning says
    assert out.returncode == 0 and "slot at once" not in out.stderr, out.stderr
    record = registry.load("roomy")
    assert record is not None
    answers = _concurrent_prompts(record.url, record.model_id)
    assert [resp.status_code for resp in answers] == [200, 200], [resp.text[:200] for resp in answers]
    assert "slots at once" not in Path(record.log_path).read_text()


# --- pulls ---


@pytest.fixture
def small_home(tmp_path: Path) -> Iterator[Path]:
    """A 100 MiB tmpfs for KVMEM_HOME (root, as in the CI container; skipped where mounting is refused)."""
    with small_tmpfs(tmp_path, "100m") as mnt:
        yield mnt


def test_disk_full_during_kvmem_pull(tmp_path: Path, small_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvmem pull` into a tmpfs that another writer fills mid-download: exit 1 with a clear message, the
    partial file and its state kept, nothing in the store; the same command resumes once there is room.
    (test_models_download's test_disk_full_mid_download_keeps_partial_and_resumes: the same in-process.)"""
    data = make_gguf(tmp_path / "blob.gguf", 24 << 20, seed=5).read_bytes()
    with FakeHub() as hub:
        sha = hub.add_file(REPO, "part.gguf", data)
        isolate_env(monkeypatch, tmp_path, hub)
        monkeypatch.setenv("KVMEM_HOME", str(small_home / "home"))
        hub.behavior.rate = 2e6
        part, state, _ = partial_paths(small_home / "home" / "models" / ".partial", sha)
        filler = small_home / "filler"

        def fill() -> None:  # another program eats the free space once the download is under way
            deadline = time.monotonic() + 60
            while not ((st := read_state(state)) and sum(st["done"]) > (4 << 20)) and time.monotonic() < deadline:
                time.sleep(0.02)
            with open(filler, "wb", buffering=0) as fh, contextlib.suppress(OSError):
                while True:
                    fh.write(b"\0" * (1 << 20))

        filling = threading.Thread(target=fill)
        filling.start()  # 24 MiB + the 64 MiB margin fit the 100 MiB: the up-front check passes
        out = kvmem("pull", "--connections", "2", f"{REPO}:part.gguf")
        filling.join(60)
        err = one_line(out.stderr)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "disk full while writing" in err and "bytes kept" in err, err
        assert "run the same command again to resume" in err and "Traceback" not in out.stderr
        kept = sum(read_state(state)["done"])
        assert 0 < kept < len(data) and part.exists()
        listed = kvmem("list", "--json")
        assert json.loads(listed.stdout)["models"] == []  # nothing half-installed
        assert [p for p in (small_home / "home").rglob("*.gguf*") if ".partial" not in p.parts] == []
        filler.unlink()
        hub.reset_stats()
        hub.behavior.rate = None
        again = kvmem("pull", f"{REPO}:part.gguf")
        assert again.returncode == 0, again.stderr
        assert hub.bytes_served == len(data) - kept  # resumed, nothing fetched twice
        assert Path(store.find(f"{REPO}:part.gguf").path).read_bytes() == data


def test_two_pulls_of_the_same_model_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `kvmem pull` of one file at the same time: one downloads, the other says who does (and exits 1);
    one file and one record result, every byte fetched once; pulling again afterwards is a no-op."""
    data = make_gguf(tmp_path / "twice.gguf", 16 << 20, seed=6).read_bytes()
    with FakeHub() as hub:
        hub.add_file(REPO, "twice.gguf", data)
        isolate_env(monkeypatch, tmp_path, hub)
        hub.behavior.rate = 1e6  # ~4 s: long enough for the second one to arrive while the first runs
        command = [sys.executable, "-m", "kvmem_llama.cli.main", "pull", "--connections", "4", f"{REPO}:twice.gguf"]
        procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "COLUMNS": "200"}) for _ in range(2)]
        results = [(p.wait(120), one_line(p.stderr.read() if p.stderr else "")) for p in procs]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 1], results
        loser = next(err for code, err in results if code == 1)
        winner_pid = next(p.pid for p, (code, _) in zip(procs, results, strict=True) if code == 0)
        assert f"another kvmem process (pid {winner_pid}) is downloading {REPO}:twice.gguf" in loser, loser
        assert "wait for it to finish" in loser
        files = [p for p in store.store_dir().rglob("*.gguf")]
        assert len(files) == 1 and files[0].read_bytes() == data
        assert len(store.records()) == 1 and hub.bytes_served == len(data)
        hub.reset_stats()
        again = kvmem("pull", f"{REPO}:twice.gguf")
        assert again.returncode == 0 and hub.bytes_served == 0
    assert not list((store.store_dir() / ".partial").glob("*.lock"))  # no lock file left behind


# --- exposure ---


ROUTES = [("GET", "/metrics"), ("GET", "/slots"), ("GET", "/props"), ("GET", "/v1/models"), ("GET", "/models"),
          ("POST", "/v1/chat/completions"), ("POST", "/chat/completions"), ("POST", "/v1/completions"),
          ("POST", "/completion"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template"),
          ("POST", "/infill"), ("POST", "/embeddings"), ("POST", "/slots/0?action=erase"), ("POST", "/props"),
          ("GET", "/lora-adapters"), ("POST", "/v1/messages"), ("GET", "/no-such-route")]
PUBLIC = [("GET", "/health"), ("GET", "/v1/health")]  # upstream's public endpoints: liveness only


def test_api_key_guards_every_route_and_kvmem_run_still_gets_ready(cpu_engine: Engine, servers: Path) -> None:
    """`kvmem run -- --api-key K` (tiering on: the readiness self-test must send the key): every route but the
    liveness probe answers 401 without the key or with a wrong one, /metrics and /slots included."""
    record = run_detached("locked", "-c", "4096", "--kvmem-budget", "1024", "--metrics", "--api-key", "s3cret,other",
                          engine=cpu_engine)
    log = Path(record.log_path).read_text()
    assert "kvmem_score: SELECT" in log  # the self-test ran, with the key
    body = {"model": record.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt": "hi", "content": "hi", "tokens": [1], "input_prefix": "a", "input_suffix": "b", "input": "x"}
    with httpx.Client(base_url=record.url, timeout=60) as http:
        for method, route in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}):
                resp = http.request(method, route, json=body if method == "POST" else None, headers=headers)
                assert resp.status_code == 401, (method, route, headers, resp.status_code, resp.text[:200])
                assert resp.json()["error"]["type"] == "authentication_error"
        for method, route in PUBLIC:
            assert http.request(method, route).status_code == 200
        key = {"Authorization": "Bearer s3cret"}
        for route in ("/metrics", "/slots", "/props", "/v1/models"):
            assert http.get(route, headers=key).status_code == 200, route
        assert "llamacpp:kvmem_selections_total" in http.get("/metrics", headers=key).text
        chat = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer other"})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] is not None


def test_binding_every_interface_warns_that_the_api_is_unauthenticated(cpu_engine: Engine, servers: Path) -> None:
    out = kvmem("run", "--detach", "--name", "open", "--host", "0.0.0.0", "--port", "auto", "--engine",
                str(cpu_engine.path), "--", "-c", "1024", "-t", "2")
    err = one_line(out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    record = registry.load("open")
    assert record is not None and record.host == "0.0.0.0"
    assert (f"warning: --host 0.0.0.0 listens on every network interface and no --api-key is set: anyone who can "
            f"reach port {record.port} can use the API unauthenticated") in err, err
    assert httpx.get(f"http://127.0.0.1:{record.port}/slots", timeout=10).status_code == 200  # as it says
    registry.stop(record, 5)
    keyed = kvmem("run", "--dry-run", "--host", "0.0.0.0", "--port", "auto", "--engine", str(cpu_engine.path), "--",
                  "--api-key", "k")
    assert keyed.returncode == 0 and "unauthenticated" not in keyed.stderr
    local = kvmem("run", "--dry-run", "--port", "auto", "--engine", str(cpu_engine.path))
    assert local.returncode == 0 and "unauthenticated" not in local.stderr


# --- no server ---


def test_wording_api_key_sources_and_slot_context(tmp_path: Path) -> None:
    assert process.describe_exit(-9) == "crashed (exit code -9, SIGKILL)"
    assert process.describe_exit(1) == "crashed (exit code 1)"
    assert process.describe_exit(0) == "exited (code 0)" and "unknown" in process.describe_exit(None)
    assert process.describe_stop("forced").startswith("stopped with a second SIGTERM")
    assert argv.api_key_from(["--api-key", "a,b"], env={}) == "a"
    assert argv.api_key_from(["--api-key=z"], env={}) == "z"
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\nk1\nk2\n")
    assert argv.api_key_from(["--api-key-file", str(keys)], env={}) == "k1"
    assert argv.api_key_from([], env={"LLAMA_API_KEY": "e"}) == "e"
    assert argv.api_key_from([], env={}) is None
    assert readiness.exposure_warning("127.0.0.1", 1, None) is None and readiness.exposure_warning("::", 1, "k") is None
    assert "192.168.1.5" in (readiness.exposure_warning("192.168.1.5", 8080, None) or "")
    assert argv.slot_context(32768, ["-np", "4", "--kv-unified"], 8192) == 8192
    assert argv.slot_context(16384, ["--parallel=4"], 8192) == 4096
    assert argv.slot_context(16384, ["-np", "1"], 8192) == 16384  # one slot: capping is refused, not hidden
    assert argv.slot_context(2048, [], 8192) == 2048


def test_a_lock_left_by_a_finished_pull_does_not_block_the_next(tmp_path: Path) -> None:
    """The lock file is removed by its holder; a process that had opened the old file re-locks the new one."""
    from kvmem_llama.models import download

    lock = tmp_path / "x.lock"
    with download._download_lock(lock, "x"):
        assert lock.read_text() == str(os.getpid())
        with pytest.raises(KvmemError, match=rf"another kvmem process \(pid {os.getpid()}\)"):
            with download._download_lock(lock, "x"):
                pass
        lock.unlink()  # what a finishing holder does, while still holding the old inode
        with download._download_lock(lock, "x"):  # a new file: not blocked by the old inode's lock
            assert lock.exists()
