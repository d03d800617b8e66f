"""`kvmem chat` in a real pseudo-terminal against real llama-server processes (CPU engine, SmolLM2):
two turns with the history sent, multi-line input, the slash commands, Ctrl-C mid-answer, --once,
attaching to a `kvmem run --detach` server; plus the input and file handling without a server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pexpect
import psutil
import pytest

from kvmem_llama import chat
from kvmem_llama.errors import KvmemError
from kvmem_llama.serving.process import port_in_use

PROMPT = ">>> "
SHORT = "You are a terse assistant. Answer in at most ten words."


def kvmem_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmem_llama.cli.main", *args]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    # own server registry; no colours, so the terminal text is plain
    return {**os.environ, "KVMEM_SERVERS_DIR": str(tmp_path / "servers"), "NO_COLOR": "1", "TERM": "dumb",
            "COLUMNS": "250"}


def kvmem(env: dict[str, str], *args: str, stdin: str | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(kvmem_argv(*args), capture_output=True, text=True, env=env, input=stdin, timeout=timeout)


def slots(url: str) -> list[dict]:
    return httpx.get(url + "/slots", timeout=10, trust_env=False).json()


def answer_of(before: str) -> str:
    """What the terminal showed after the echoed input line, up to the next prompt."""
    return before.split("\n", 1)[1].strip() if "\n" in before else ""


def command(child: pexpect.spawn, line: str) -> str:
    child.sendline(line)
    child.expect_exact(PROMPT)
    return answer_of(child.before)


def number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text}"
    return int(match[1].replace(",", ""))


# --- input and files, no server ---


def test_read_message_joins_fenced_blocks_and_backslash_lines() -> None:
    def reader(lines: list[str]):
        it = iter(lines)

        def read(_prompt: str) -> str:
            try:
                return next(it)
            except StopIteration:
                raise EOFError from None

        return read

    assert chat.read_message(reader(["hello"])) == "hello"
    assert chat.read_message(reader(['"""', "line one", "", "line three", '"""', "next"])) == "line one\n\nline three"
    assert chat.read_message(reader(['"""first', 'last"""'])) == "first\nlast"
    assert chat.read_message(reader(['"""one line"""'])) == "one line"
    assert chat.read_message(reader(["a \\", "b \\", "c"])) == "a \nb \nc"
    assert chat.read_message(reader(['"""', "unclosed"])) == "unclosed"  # the input ended the block
    assert chat.read_message(reader([])) is None


def test_conversation_files_round_trip_and_bad_files_are_explained(tmp_path: Path) -> None:
    conv = chat.Conversation(system="be brief")
    conv.add("two\nlines", "ok")
    saved = conv.save(tmp_path / "c.json")
    loaded = chat.Conversation.load(saved)
    assert loaded == conv
    assert loaded.messages()[0] == {"role": "system", "content": "be brief"}

    (tmp_path / "bad.json").write_text('{"messages": [{"role": "wizard", "content": "x"}]}', encoding="utf-8")
    with pytest.raises(KvmemError, match="message 1 of .* role system/user/assistant"):
        chat.Conversation.load(tmp_path / "bad.json")
    (tmp_path / "notjson.json").write_text("{", encoding="utf-8")
    with pytest.raises(KvmemError, match="is not JSON"):
        chat.Conversation.load(tmp_path / "notjson.json")
    with pytest.raises(KvmemError, match="cannot read"):
        chat.Conversation.load(tmp_path / "missing.json")


def test_bad_chat_input_is_a_clear_error(env: dict[str, str], tmp_path: Path) -> None:
    missing = kvmem(env, "chat", "--load", str(tmp_path / "nope.json"), "--once", "hi")
    assert missing.returncode == 1 and "cannot read" in missing.stderr and "nope.json" in missing.stderr
    empty = kvmem(env, "chat", "--once", "  ")
    assert empty.returncode == 2 and "non-empty prompt" in empty.stderr
    unknown = kvmem(env, "chat", "no-such-model-xyz", "--once", "hi")
    assert unknown.returncode == 1 and "no-such-model-xyz" in unknown.stderr
    download = kvmem(env, "chat", "--once", "hi", "--", "-hf", "owner/repo:Q4_K_M")
    assert download.returncode == 1 and "kvmem pull" in download.stderr
    assert not list((tmp_path / "servers").glob("*.json"))  # nothing was started


# --- a real terminal session ---


@pytest.mark.engine
@pytest.mark.slow
def test_chat_session_in_a_terminal(cpu_engine, env: dict[str, str], tmp_path: Path) -> None:
    # answers of at most 48 tokens keep the test short on a busy machine; Ctrl-C comes after the first words
    child = pexpect.spawn(sys.executable, kvmem_argv("chat", "smollm2", "--ctx", "4096", "--system", SHORT,
                                                     "--max-tokens", "48", "--", "--kvmem-budget", "1024",
                                                     "-np", "1")[1:],
                          env=env, encoding="utf-8", timeout=300, dimensions=(60, 250))
    try:
        child.expect(r"ready http://127\.0\.0\.1:(\d+)")
        url = f"http://127.0.0.1:{child.match[1]}"
        child.expect_exact(PROMPT)
        (record,) = [json.loads(p.read_text()) for p in (tmp_path / "servers").glob("*.json")]
        server = psutil.Process(record["pid"])

        # turn 1, then the stats: tiering is on, the numbers are the server's own
        first = command(child, "My name is Ada. Say hello to me.")
        assert first, "no answer to turn 1"
        stats = command(child, "/stats")
        prompt1 = number(r"prompt ([\d,]+) tokens", stats)
        answer1 = number(r"last answer: ([\d,]+) tokens at [\d.]+ tok/s", stats)
        host = number(r"host pool: ([\d,]+) blocks", stats)
        assert re.search(r"working set: \d+ blocks = \d+ tokens of a 1,024-token budget", stats), stats
        assert host == slots(url)[0]["kvmem"]["blocks_host"]
        # the readiness self-test's selection, read from the server's log
        assert re.search(r"last SELECT \(\d+ so far\): seq 0 reason=turn n_blocks=\d+ budget_blocks=8 ", stats), stats

        # /mode changes the request's sampling; turn 2 is typed over three lines and sends the history
        assert "mode tool: temperature 0.2, top_p 0.8, top_k 20, presence_penalty 0.05" in command(child, "/mode tool")
        child.sendline('"""')
        child.sendline("What is my name?")
        child.sendline('Answer with the name only."""')
        child.expect_exact(PROMPT)
        stats = command(child, "/stats")
        assert number(r"prompt ([\d,]+) tokens", stats) > prompt1 + answer1  # turn 1 went with it
        assert "sampling: tool profile" in stats
        params = slots(url)[0]["params"]
        assert params["temperature"] == pytest.approx(0.2) and params["presence_penalty"] == pytest.approx(0.05)

        # /save, /clear, /load: the same conversation back; a bad file leaves the session as it was
        saved, again = tmp_path / "a.json", tmp_path / "b.json"
        assert "saved 5 messages" in command(child, f"/save {saved}")
        messages = json.loads(saved.read_text("utf-8"))["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
        assert messages[0]["content"] == SHORT and messages[1]["content"] == "My name is Ada. Say hello to me."
        assert messages[3]["content"] == "What is my name?\nAnswer with the name only."
        assert "cleared 4 messages (the system prompt stays)" in command(child, "/clear")
        assert "error: cannot read" in command(child, f"/load {tmp_path / 'missing.json'}")
        assert "loaded 5 messages" in command(child, f"/load {saved}")
        command(child, f"/save {again}")
        assert json.loads(again.read_text("utf-8")) == json.loads(saved.read_text("utf-8"))
        assert "system prompt set (14 characters)" in command(child, "/system Be very brief.")
        assert "unknown command /frobnicate" in command(child, "/frobnicate")

        # Ctrl-C mid-answer stops the answer on the server and keeps the session
        command(child, "/mode chat")
        child.sendline("Write a very long story about a dragon who learns to fly, at least 1000 words.")
        child.expect_exact("1000 words.")
        child.expect(r"\w+")  # the answer is being written
        child.sendintr()
        child.expect_exact("answer stopped (Ctrl-C); the chat goes on")
        child.expect_exact(PROMPT)
        deadline = time.monotonic() + 10
        while slots(url)[0]["is_processing"] and time.monotonic() < deadline:
            time.sleep(0.2)
        slot = slots(url)[0]
        assert not slot["is_processing"]
        # stopped by the cancel, not by its end or the 48-token limit (those clear has_next_token)
        assert slot["next_token"][0]["has_next_token"], "the story ended by itself: Ctrl-C came too late"
        assert slot["next_token"][0]["n_decoded"] < 48
        assert command(child, "Say OK."), "no answer after Ctrl-C"
        command(child, f"/save {again}")
        roles = [m["role"] for m in json.loads(again.read_text("utf-8"))["messages"]]
        assert roles == ["system"] + ["user", "assistant"] * 4  # the stopped answer stays as far as it went

        child.sendline("/bye")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
        assert not list((tmp_path / "servers").glob("*.json"))
        server.wait(5)  # the server the chat started is gone with it
    finally:
        if child.isalive():
            child.terminate(force=True)


@pytest.mark.engine
@pytest.mark.slow
def test_chat_once_starts_and_stops_its_server(cpu_engine, env: dict[str, str], tmp_path: Path) -> None:
    proc = kvmem(env, "chat", "--once", "Say hello.", "--system", SHORT, "-n", "16", "--", "-c", "1024", "-np", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and proc.stderr == ""  # the answer only: fit for scripts
    (log,) = (tmp_path / "servers").glob("*.log")
    text = log.read_text("utf-8")
    assert number(r"\|\s+eval time =\s+[\d.]+ ms /\s+(\d+) tokens", text) <= 16  # --max-tokens went along
    port = number(r"listening on http://127\.0\.0\.1:(\d+)", text)
    assert not list((tmp_path / "servers").glob("*.json")) and not port_in_use("127.0.0.1", port)


@pytest.mark.engine
@pytest.mark.slow
def test_chat_attaches_to_a_named_server(cpu_engine, env: dict[str, str], tmp_path: Path) -> None:
    run = kvmem(env, "run", "--detach", "--name", "pal", "--port", "auto", "-q", "--", "-c", "1024", "-np", "1")
    assert run.returncode == 0, run.stderr
    try:
        url = re.search(r"ready (http://127\.0\.0\.1:\d+)", run.stdout)[1]
        # `kvmem run` says where the web UI is, and only when the server really serves one
        home = httpx.get(url + "/", timeout=10, trust_env=False)
        if home.status_code == 200:
            assert f"web UI {url}/" in run.stdout
        else:
            assert f"no web UI at {url}/" in run.stdout
        assert slots(url)[0].get("id_task") is None

        proc = kvmem(env, "chat", "pal", "-n", "16", "--once", "-", stdin="Say hello.")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip()
        assert slots(url)[0].get("id_task") is not None  # the answer came from pal
        assert httpx.get(url + "/health", timeout=10, trust_env=False).status_code == 200  # and pal still runs

        assert slots(url)[0]["params"]["temperature"] == pytest.approx(0.7)  # pal's own (chat) sampling
        # --mode goes with each request, so it works on a server started with another profile
        tool = kvmem(env, "chat", "pal", "--mode", "tool", "-n", "16", "--once", "Say hello.")
        assert tool.returncode == 0, tool.stderr
        assert slots(url)[0]["params"]["temperature"] == pytest.approx(0.2)

        flags = kvmem(env, "chat", "pal", "--ctx", "2048", "--once", "hi")
        assert flags.returncode == 2 and "--ctx" in flags.stderr and "already running" in flags.stderr
    finally:
        kvmem(env, "stop", "pal")
    noui = kvmem(env, "run", "--detach", "--name", "noui", "--port", "auto", "-q", "--", "-c", "512", "--no-ui")
    try:
        assert noui.returncode == 0, noui.stderr
        assert "no web UI at http://127.0.0.1:" in noui.stdout
    finally:
        kvmem(env, "stop", "noui")


def test_stats_say_what_waits_on_the_disk_tier() -> None:
    from kvmem_llama.chat import ServerStats, describe

    stats = ServerStats("m", "http://127.0.0.1:1", tiering={"enabled": True, "block": 64, "budget": 512,
                                                            "method": "hybrid", "disk_path": "/kv"},
                        slots=[{"id": 0, "kvmem": {"blocks_gpu": 8, "blocks_host": 2, "blocks_disk": 35,
                                                   "disk_bytes": 35 * 2**20}},
                               {"id": 1, "kvmem": {"blocks_gpu": 8, "blocks_host": 43}}])
    lines = describe(stats, None, None, 2)
    assert "disk tier: 35 blocks = 2,240 tokens, 35.0 MiB under /kv" in "\n".join(lines)
    assert "  slot 0: 8 in the working set, 2 in the host pool, 35 on disk" in lines
    assert "  slot 1: 8 in the working set, 43 in the host pool" in lines
    plain = ServerStats("m", "http://127.0.0.1:1", tiering={"enabled": True, "block": 64, "budget": 512},
                        slots=[{"id": 0, "kvmem": {"blocks_gpu": 8, "blocks_host": 2}}])
    assert not any(line.startswith("disk tier") for line in describe(plain, None, None, 1))
