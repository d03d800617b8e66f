"""Drop-in without surprises: llama-server's own download flags (-hf, ...) need HTTPS, which the
engine is built without; `kvmem serve`, `kvmem run` and `kvmem chat` refuse them up front and name
`kvmem pull` instead of letting the engine fail after it started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem_llama.engine import Engine
from kvmem_llama.errors import KvmemError
from kvmem_llama.serving import argv


def kvmem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "250", **(env or {})})


@pytest.mark.parametrize("flags", [
    ["-hf", "ggml-org/gemma-3-270m-GGUF:Q4_K_M"],
    ["-hfr", "ggml-org/gemma-3-270m-GGUF"],
    ["--hf-repo=ggml-org/gemma-3-270m-GGUF:Q4_K_M"],
    ["-c", "4096", "--hf-repo-draft", "owner/draft-GGUF"],
    ["--docker-repo", "gemma3"],
    ["-mu", "https://example.com/model.gguf"],
])
def test_serve_refuses_download_flags_naming_kvmem_pull(flags: list[str]) -> None:
    proc = kvmem("serve", *flags)
    assert proc.returncode == 1
    assert "kvmem pull" in proc.stderr and "HTTPS" in proc.stderr and "OpenSSL" in proc.stderr
    assert flags[-1].split("=")[-1] in proc.stderr  # says which argument it refused


def test_the_refusal_names_the_repository_to_pull() -> None:
    with pytest.raises(KvmemError) as info:
        argv.refuse_download_flags(["-hf", "ggml-org/gemma-3-270m-GGUF:Q4_K_M"], env={})
    assert "kvmem pull ggml-org/gemma-3-270m-GGUF:FILE.gguf" in info.value.hint
    # plain http (a local mirror) and ordinary flags pass
    argv.refuse_download_flags(["-mu", "http://127.0.0.1:8000/m.gguf", "-m", "x.gguf", "-c", "512"], env={})
    argv.refuse_download_flags(["--hf-token", "abc"], env={})  # a token alone downloads nothing


def test_env_twins_are_refused_too() -> None:
    proc = kvmem("serve", "-c", "512", env={"LLAMA_ARG_HF_REPO": "owner/repo-GGUF"})
    assert proc.returncode == 1 and "LLAMA_ARG_HF_REPO" in proc.stderr and "kvmem pull" in proc.stderr


def test_run_and_chat_refuse_before_starting_anything(tmp_path: Path) -> None:
    env = {"KVMEM_SERVERS_DIR": str(tmp_path / "servers")}
    for command in (["run", "--port", "auto"], ["chat", "--once", "hi"]):
        proc = kvmem(*command, "--", "-hf", "owner/repo-GGUF:Q4_K_M", env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "kvmem pull owner/repo-GGUF:FILE.gguf" in proc.stderr
    assert not (tmp_path / "servers").exists() or not list((tmp_path / "servers").iterdir())


@pytest.mark.engine
def test_the_engine_itself_cannot_download(cpu_engine: Engine) -> None:
    """Why the refusal exists: the engine's llama-server, given -hf, fails with "HTTPS is not supported".
    If an engine is ever built with OpenSSL this fails, and the refusal should go."""
    proc = subprocess.run([str(cpu_engine.server), "-hf", "owner/repo-GGUF:Q4_K_M", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "HTTPS is not supported" in proc.stdout + proc.stderr
