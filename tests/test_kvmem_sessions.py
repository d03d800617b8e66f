"""Tiered sessions that survive: a sequence's state holds its whole history (the host pool as well as the GPU
working set), through the C API and llama-server's slot save/restore, and a state that does not fit is refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import small_tmpfs
from test_kvmem_engine import complete, essay

from kvmem_llama import kvmem_log
from kvmem_llama.binding import KvmemConfig, Llama, ffi, load_library, recent_log
from kvmem_llama.engine import Engine

TIERED = KvmemConfig(budget=512, block=64, sink=64, recent=128, gen_reserve=128)
SERVER_TIERING = ["-c", "4096", "-np", "1", "--kvmem-budget", "512", "--kvmem-block", "64", "--kvmem-sink", "64",
                  "--kvmem-recent", "128"]


def _state(lib, llm: Llama) -> bytes:
    size = lib.llama_state_seq_get_size(llm._ctx, 0)
    buf = ffi.new("uint8_t[]", size)
    assert lib.llama_state_seq_get_data(llm._ctx, buf, size, 0) == size
    return bytes(ffi.buffer(buf, size))


def _restore(lib, llm: Llama, state: bytes) -> int:
    return lib.llama_state_seq_set_data(llm._ctx, ffi.from_buffer("uint8_t[]", state), len(state), 0)


def test_a_tiered_state_restores_the_whole_history(cpu_engine: Engine, smollm2) -> None:
    """A fresh context restored from a state answers a follow-up with the same tokens as the context that never
    stopped, with every block of the host pool back."""
    lib = load_library(cpu_engine.libllama)
    with Llama.load(smollm2, n_ctx=4096, libllama=cpu_engine.libllama, kvmem=TIERED) as first:
        first.decode(first.tokenize(essay(150) + " The secret code word is PAPAYA-71. " + essay(40)))
        before = first.kvmem_stats()
        assert before.evicted > 0 and before.blocks_host > 3 * before.blocks_gpu  # most of it only in the host pool
        state = _state(lib, first)
        question = first.tokenize(" Question: what is the secret code word? Answer:", add_special=False)
        expected = first.generate(question, max_tokens=12).tokens
    assert len(state) > before.host_bytes  # the history, not only the working set
    with Llama.load(smollm2, n_ctx=4096, libllama=cpu_engine.libllama, kvmem=TIERED) as second:
        assert _restore(lib, second, state) == len(state)
        after = second.kvmem_stats()
        assert (after.blocks_host, after.blocks_gpu) == (before.blocks_host, before.blocks_gpu)
        assert second.generate(question, max_tokens=12).tokens == expected


def test_a_state_of_another_layout_is_refused_and_changes_nothing(cpu_engine: Engine, smollm2) -> None:
    lib = load_library(cpu_engine.libllama)
    with Llama.load(smollm2, n_ctx=4096, libllama=cpu_engine.libllama, kvmem=TIERED) as saved:
        saved.decode(saved.tokenize(essay(100)))
        state = _state(lib, saved)
    with Llama.load(smollm2, n_ctx=1024, libllama=cpu_engine.libllama) as plain:
        plain.decode(plain.tokenize("The capital of France is"))
        untiered = _state(lib, plain)
    other = KvmemConfig(budget=512, block=128, sink=128, recent=128, gen_reserve=128)
    with Llama.load(smollm2, n_ctx=4096, libllama=cpu_engine.libllama, kvmem=other) as llm:
        llm.decode(llm.tokenize("The capital of France is"))
        kept = llm.kvmem_stats()
        assert _restore(lib, llm, state) == 0
        said = "".join(recent_log(30))
        assert "saved with another layout" in said and "block 64 tokens" in said and "block 128 tokens" in said, said
        assert _restore(lib, llm, untiered) == 0
        assert "not saved by a tiered context" in "".join(recent_log(30))
        assert llm.kvmem_stats().blocks_gpu == kept.blocks_gpu  # the sequence it had is untouched
        assert llm.generate(llm.tokenize(" Paris", add_special=False), max_tokens=2).tokens


def _slot(url: str, action: str, filename: str) -> httpx.Response:
    return httpx.post(f"{url}/slots/0", params={"action": action}, json={"filename": filename}, timeout=600)


def _tokens(url: str, text: str) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60).json()["tokens"]


def _log_with(server, text: str, deadline_s: float = 30.0) -> str:
    """The server's log once it holds `text` (it may answer a request before its log line is flushed), or as it
    is at the deadline."""
    deadline = time.monotonic() + deadline_s
    while text not in (log := server.log()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return log


def _wait_dead(pid: int, deadline_s: float = 60.0) -> None:
    """Until the process is gone or a zombie (its parent, the monitor, may not have reaped it yet)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state == "Z":
            return
        time.sleep(0.1)
    pytest.fail(f"the server (pid {pid}) did not die after SIGKILL")


@pytest.mark.parametrize("score_on", ["host", "device"])
def test_a_tiered_slot_resumes_after_kill_9_without_reading_its_history_again(llama_server, smollm2, tmp_path: Path,
                                                                              score_on: str) -> None:
    """save -> kill -9 -> restart -> restore: the follow-up's answer is the never-stopped server's, and only the
    follow-up's own tokens are read; with the summaries and query rows on the host scorer or in the scoring
    backend's stores (a CPU backend of its own here)."""
    slots = tmp_path / "slots"
    slots.mkdir()
    args = [*SERVER_TIERING, "--kvmem-score-on", score_on, "--kvmem-trace", "--slot-save-path", str(slots)]
    with llama_server(smollm2, args) as first:
        history = _tokens(first.url, essay(150) + " The secret code word is PAPAYA-71. " + essay(30))
        turn = complete(first.url, history, n_predict=8, cache_prompt=True)
        saved = _slot(first.url, "save", "session.bin")
        assert saved.status_code == 200, saved.text
        n_saved = saved.json()["n_saved"]
        assert n_saved >= len(history)
        follow_up = history + turn["tokens"] + _tokens(first.url, " Question: what is the secret code word?")
        expected = complete(first.url, follow_up, n_predict=12, cache_prompt=True)["tokens"]
        ranked = kvmem_log.rankings(first.log())[-1]  # the follow-up turn's: what scoring saw
        os.kill(first.pid, signal.SIGKILL)
        _wait_dead(first.pid)
    with llama_server(smollm2, args) as second:
        restored = _slot(second.url, "restore", "session.bin")
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == n_saved
        again = complete(second.url, follow_up, n_predict=12, cache_prompt=True)
        assert again["tokens"] == expected
        assert again["timings"]["prompt_n"] <= len(follow_up) - n_saved + 1  # the history was not read again
        # the same summaries and query rows: the follow-up's blocks rank in the same order
        assert kvmem_log.rankings(second.log())[-1] == ranked


def test_a_slot_file_that_does_not_fit_is_refused_and_the_server_goes_on(llama_server, smollm2,
                                                                         tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    with llama_server(smollm2, [*SERVER_TIERING, "--slot-save-path", str(slots)]) as srv:
        complete(srv.url, essay(80), n_predict=4, cache_prompt=True)
        assert _slot(srv.url, "save", "whole.bin").status_code == 200
    whole = (slots / "whole.bin").read_bytes()
    (slots / "cut.bin").write_bytes(whole[: len(whole) // 2])
    other_block = [*SERVER_TIERING, "--slot-save-path", str(slots)]
    other_block[other_block.index("--kvmem-block") + 1] = "128"
    other_block[other_block.index("--kvmem-sink") + 1] = "128"
    with llama_server(smollm2, other_block) as srv:
        assert _slot(srv.url, "restore", "cut.bin").status_code != 200
        assert _slot(srv.url, "restore", "whole.bin").status_code != 200
        assert "saved with another layout" in _log_with(srv, "saved with another layout")
        assert complete(srv.url, "The capital of France is", n_predict=4)["tokens_predicted"] > 0
    assert (slots / "whole.bin").read_bytes() == whole  # a refused restore leaves the file as it was


def test_a_save_that_does_not_fit_on_the_disk_keeps_the_previous_file(llama_server, smollm2, tmp_path: Path) -> None:
    """A state file is written beside the old one and renamed over it once whole: a full disk fails the save with
    an error and leaves the previous session as it was, with no partial file."""
    with small_tmpfs(tmp_path, "16m") as disk, \
            llama_server(smollm2, [*SERVER_TIERING, "--slot-save-path", str(disk)]) as srv:
        complete(srv.url, "The capital of France is", n_predict=4, cache_prompt=True)
        assert _slot(srv.url, "save", "s.bin").status_code == 200
        before = (disk / "s.bin").read_bytes()
        complete(srv.url, essay(150), n_predict=4, cache_prompt=True)  # ~40 MB of state: more than the disk
        failed = _slot(srv.url, "save", "s.bin")
        assert failed.status_code != 200 and "Unable to save slot" in failed.text
        full = "No space left on device (the previous file is unchanged)"
        assert full in _log_with(srv, full)
        assert (disk / "s.bin").read_bytes() == before
        assert sorted(p.name for p in disk.iterdir()) == ["s.bin"]
        assert complete(srv.url, "The capital of France is", n_predict=4)["tokens_predicted"] > 0


def _kvmem(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def _ready_url(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stdout + out.stderr
    match = re.search(r"ready (http://127\.0\.0\.1:\d+)", out.stdout)
    assert match, out.stdout
    return match.group(1)


def test_kvmem_run_keep_sessions_saves_on_stop_and_resumes_on_start(smollm2, tmp_path: Path) -> None:
    env = {**os.environ, "KVMEM_SERVERS_DIR": str(tmp_path / "servers"),
           "KVMEM_SESSIONS_DIR": str(tmp_path / "sessions")}
    start = ["run", "--detach", "--keep-sessions", "--name", "keep", "--port", "auto", "--", *SERVER_TIERING]
    url = _ready_url(_kvmem(start, env))
    try:
        history = _tokens(url, essay(150) + " The secret code word is PAPAYA-71. " + essay(30))
        turn = complete(url, history, n_predict=8, cache_prompt=True)
    finally:
        stop = _kvmem(["stop", "keep"], env)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    saved = re.search(r"keep: slot 0: saved ([\d,]+) tokens", stop.stdout)
    assert saved, stop.stdout
    n_saved = int(saved.group(1).replace(",", ""))
    assert n_saved >= len(history)
    listed = json.loads(_kvmem(["sessions", "list", "--json"], env).stdout)
    assert [(row["model"], row["slot"]) for row in listed] == [("smollm2", 0)] and listed[0]["bytes"] > 0

    kept = tmp_path / "sessions" / "smollm2" / "slot-0.bin"
    before = kept.read_bytes()
    # the self-test's request used slot 0 while its session waited: a stop saves nothing over the session
    _ready_url(_kvmem(start, env))
    stopped = _kvmem(["stop", "keep"], env)
    assert stopped.returncode == 0 and "saved" not in stopped.stdout, stopped.stdout
    assert kept.read_bytes() == before

    again = _kvmem(start, env)
    url = _ready_url(again)
    try:
        # the session waits on disk until a request continues it (--kvmem-lazy-restore)
        assert f"slot 0: {n_saved:,} tokens kept" in again.stdout, again.stdout
        ps = json.loads(_kvmem(["ps", "--json"], env).stdout)
        assert [(row["name"], row["kept_sessions_bytes"]) for row in ps] == [("keep", listed[0]["bytes"])]
        follow_up = history + turn["tokens"] + _tokens(url, " Question: what is the secret code word?")
        answer = complete(url, follow_up, n_predict=8, cache_prompt=True)
        assert answer["timings"]["prompt_n"] <= len(follow_up) - n_saved + 1  # the history was not read again
    finally:
        assert _kvmem(["stop", "keep"], env).returncode == 0
    removed = _kvmem(["sessions", "rm", "smollm2"], env)
    assert removed.returncode == 0 and "removed 1 session file(s)" in removed.stdout
    assert json.loads(_kvmem(["sessions", "list", "--json"], env).stdout) == []
    missing = _kvmem(["sessions", "rm", "smollm2"], env)
    assert missing.returncode != 0 and "no kept sessions for 'smollm2'" in missing.stderr


def test_ctrl_c_on_kvmem_run_keep_sessions_saves_before_stopping(smollm2, tmp_path: Path) -> None:
    env = {**os.environ, "KVMEM_SERVERS_DIR": str(tmp_path / "servers"),
           "KVMEM_SESSIONS_DIR": str(tmp_path / "sessions"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvmem_llama.cli.main", "run", "--keep-sessions", "--quiet",
                             "--port", "auto", "--name", "fg", "--", *SERVER_TIERING],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:  # until "ready" (the server's readiness has its own timeout)
            seen.append(line)
            if line.startswith("ready "):
                break
        match = re.search(r"ready (http://127\.0\.0\.1:\d+)", "".join(seen))
        assert match, "".join(seen)
        complete(match.group(1), essay(60), n_predict=4, cache_prompt=True)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert re.search(r"slot 0: saved [\d,]+ tokens", rest), rest
    assert (tmp_path / "sessions" / "smollm2" / "slot-0.bin").stat().st_size > 0


def test_a_whole_context_state_restores_every_sequence(cpu_engine: Engine, smollm2) -> None:
    """llama_state_* (llama-cli's --prompt-cache): the whole context, host pool included."""
    lib = load_library(cpu_engine.libllama)
    with Llama.load(smollm2, n_ctx=4096, libllama=cpu_engine.libllama, kvmem=TIERED) as first:
        first.decode(first.tokenize(essay(150) + " The secret code word is PAPAYA-71. " + essay(40)))
        before = first.kvmem_stats()
        size = lib.llama_state_get_size(first._ctx)
        buf = ffi.new("uint8_t[]", size)
        assert lib.llama_state_get_data(first._ctx, buf, size) == size
        question = first.tokenize(" Question: what is the secret code word? Answer:", add_special=False)
        expected = first.generate(question, max_tokens=12).tokens
    with Llama.load(smollm2, n_ctx=4096, libllama=cpu_engine.libllama, kvmem=TIERED) as second:
        assert lib.llama_state_set_data(second._ctx, buf, size) == size
        assert second.kvmem_stats().blocks_host == before.blocks_host
        assert second.generate(question, max_tokens=12).tokens == expected


def test_a_hybrid_model_slot_resumes_with_its_recurrent_state(llama_server, qwen35, tmp_path: Path) -> None:
    """qwen35: the tiered attention layers and the recurrent layers' state come back together."""
    slots = tmp_path / "slots"
    slots.mkdir()
    args = ["-c", "8192", "-np", "1", "--kvmem-budget", "1024", "--slot-save-path", str(slots)]
    with llama_server(qwen35["plain"], args) as first:
        history = _tokens(first.url, essay(200))
        turn = complete(first.url, history, n_predict=8, cache_prompt=True)
        assert _slot(first.url, "save", "q.bin").status_code == 200
        follow_up = history + turn["tokens"] + _tokens(first.url, " And chapter 3 again?")
        expected = complete(first.url, follow_up, n_predict=12, cache_prompt=True)["tokens"]
    with llama_server(qwen35["plain"], args) as second:
        restored = _slot(second.url, "restore", "q.bin")
        assert restored.status_code == 200, restored.text
        again = complete(second.url, follow_up, n_predict=12, cache_prompt=True)
    assert again["tokens"] == expected
    assert again["timings"]["prompt_n"] < 64
    # the same shape with other weights (a fine-tune): the file's KV is not its KV
    from kvmem_llama import synth

    other = synth.synthesize(tmp_path / "q35-other.gguf", "qwen35", "tiny", quant="q4_k", seed=2).path
    with llama_server(other, args) as third:
        refused = _slot(third.url, "restore", "q.bin")
        said = _log_with(third, "saved with another layout")
    assert refused.status_code != 200
    assert "saved with another layout" in said and "weights" in said, said[-2000:]


def test_a_draft_mtp_slot_resumes_after_kill_9_with_the_draft_starting_anew(llama_server, qwen35,
                                                                            tmp_path: Path) -> None:
    """--spec-type draft-mtp: the target's tiered state is saved and restored; the MTP draft's cache is not in the
    file and continues the restored sequence from the follow-up on (llama-server empties the slot before a
    restore). Greedy verification keeps the answer the never-stopped server's; no history token is read again."""
    slots = tmp_path / "slots"
    slots.mkdir()
    args = ["-c", "8192", "-np", "1", "--kvmem-budget", "1024", "--spec-type", "draft-mtp",
            "--slot-save-path", str(slots)]
    with llama_server(qwen35["mtp"], args) as first:
        history = _tokens(first.url, essay(200))
        turn = complete(first.url, history, n_predict=8, cache_prompt=True)
        saved = _slot(first.url, "save", "mtp.bin")
        assert saved.status_code == 200, saved.text
        n_saved = saved.json()["n_saved"]
        follow_up = history + turn["tokens"] + _tokens(first.url, " And chapter 3 again?")
        expected = complete(first.url, follow_up, n_predict=12, cache_prompt=True)
        assert expected["timings"]["draft_n"] > 0  # the draft ran before the save too
        os.kill(first.pid, signal.SIGKILL)
        _wait_dead(first.pid)
    with llama_server(qwen35["mtp"], args) as second:
        restored = _slot(second.url, "restore", "mtp.bin")
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == n_saved
        again = complete(second.url, follow_up, n_predict=12, cache_prompt=True)
        log = second.log()
    assert again["tokens"] == expected["tokens"]
    assert again["timings"]["prompt_n"] <= len(follow_up) - n_saved + 1
    assert again["timings"]["draft_n"] > 0, "the draft did not run after the restore"
    assert "GGML_ASSERT" not in log and "cannot save" not in log


def test_a_slot_whose_restore_was_refused_does_not_overwrite_its_kept_session(smollm2, tmp_path: Path) -> None:
    """A server that cannot take a kept file (here: another block size; kvmem run restores on the first request
    that continues it) leaves its slot empty; stopping it saves nothing over the session, which the right server
    can still restore."""
    env = {**os.environ, "KVMEM_SERVERS_DIR": str(tmp_path / "servers"),
           "KVMEM_SESSIONS_DIR": str(tmp_path / "sessions")}
    start = ["run", "--detach", "--keep-sessions", "--name", "keep", "--port", "auto", "--", *SERVER_TIERING]
    url = _ready_url(_kvmem(start, env))
    try:
        first = complete(url, essay(80), n_predict=4, cache_prompt=True)
    finally:
        assert _kvmem(["stop", "keep"], env).returncode == 0
    follow_up = essay(80) + first["content"] + " And then?"
    kept = tmp_path / "sessions" / "smollm2" / "slot-0.bin"
    before = kept.read_bytes()
    other = [*start]
    other[other.index("--kvmem-block") + 1] = "128"
    other[other.index("--kvmem-sink") + 1] = "128"
    refused = _kvmem(other, env)
    url = _ready_url(refused)
    try:
        assert re.search(r"slot 0: [\d,]+ tokens kept", refused.stdout), refused.stdout
        resp = httpx.post(f"{url}/slots/0", params={"action": "restore"}, json={"filename": "slot-0.bin"}, timeout=600)
        assert resp.status_code != 200  # another block size
    finally:
        stop = _kvmem(["stop", "keep"], env)
    assert stop.returncode == 0 and "saved" not in stop.stdout, stop.stdout
    assert kept.read_bytes() == before
    assert sorted(p.name for p in kept.parent.iterdir()) == ["slot-0.bin"]
    restored = _kvmem(start, env)
    url = _ready_url(restored)
    try:
        assert re.search(r"slot 0: [\d,]+ tokens kept", restored.stdout), restored.stdout
        assert complete(url, follow_up, n_predict=4, cache_prompt=True)["timings"]["prompt_n"] < 40  # came back
    finally:
        _kvmem(["stop", "keep"], env)


def test_a_kept_session_comes_back_with_the_first_request_that_continues_it(llama_server, smollm2,
                                                                           tmp_path: Path) -> None:
    """--kvmem-lazy-restore: nothing is read at start; an unrelated request takes the other slot; the request that
    continues the session takes its slot, which is restored first (only the new tokens are read, the answer is the
    never-stopped server's); a request that does not continue it leaves the file as it was."""
    slots = tmp_path / "slots"
    slots.mkdir()
    two = ["-np", "2", "--kv-unified", *SERVER_TIERING[4:], "-c", "8192", "--slot-save-path", str(slots)]
    with llama_server(smollm2, two) as first:
        history = _tokens(first.url, essay(150) + " The secret code word is PAPAYA-71. " + essay(30))
        turn = complete(first.url, history, n_predict=8, cache_prompt=True, id_slot=0)
        assert httpx.post(f"{first.url}/slots/0", params={"action": "save"}, json={"filename": "slot-0.bin"},
                          timeout=600).status_code == 200
        follow_up = history + turn["tokens"] + _tokens(first.url, " Question: what is the secret code word?")
        expected = complete(first.url, follow_up, n_predict=12, cache_prompt=True, id_slot=0)["tokens"]
    kept = (slots / "slot-0.bin").read_bytes()
    with llama_server(smollm2, [*two, "--kvmem-lazy-restore"]) as srv:
        waiting = {s["id"]: s.get("kept_session") for s in httpx.get(f"{srv.url}/slots", timeout=30).json()}
        assert waiting[0]["n_tokens"] >= len(history) and waiting[1] is None, waiting
        assert "waits in" in srv.log() and "restored the kept session" not in srv.log()
        complete(srv.url, "The capital of France is", n_predict=4, cache_prompt=True)  # any slot but the kept one
        assert "restored the kept session" not in srv.log()
        assert re.search(r"id  1 \| task \S+ \| selected slot by LRU", srv.log()), srv.log()[-2000:]
        answer = complete(srv.url, follow_up, n_predict=12, cache_prompt=True)
        log = srv.log()
    assert "restored the kept session" in log
    assert answer["timings"]["prompt_n"] < 40  # the history came from the file
    assert answer["tokens"] == expected
    with llama_server(smollm2, [*SERVER_TIERING, "--slot-save-path", str(slots), "--kvmem-lazy-restore"]) as one:
        complete(one.url, "The capital of France is", n_predict=4, cache_prompt=True)
        assert "stays on disk: this request continues" in one.log()
    assert (slots / "slot-0.bin").read_bytes() == kept
