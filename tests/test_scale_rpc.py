"""Scale-out through llama.cpp's RPC backend (issue 19), on the CPU: `kvmem rpc-server` on loopback holds the
model's layers and the tiered working set; the host pool stays in this process. Real processes, real HTTP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from test_kvmem_engine import SMALL, complete, haystack_prompt

from kvmem_llama import kvmem_log
from kvmem_llama.serving import launch, process

pytestmark = pytest.mark.engine


@contextlib.contextmanager
def rpc_server() -> Iterator[str]:
    port = process.free_port()
    rpc = subprocess.Popen([sys.executable, "-m", "kvmem_llama.cli.main", "rpc-server", "--port", str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not process.port_in_use("127.0.0.1", port):
            assert rpc.poll() is None, rpc.stdout.read() if rpc.stdout else ""
            assert time.monotonic() < deadline, "rpc-server did not listen"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(rpc.pid, signal.SIGTERM)
        rpc.wait(15)


def test_tiered_needle_over_rpc(smollm2) -> None:
    """A prompt 3x the budget, the needle a fifth in: evicted during prefill, staged back in through the RPC
    device's tensors after the turn's selection, answered right; kvmem run's own readiness needle passes too."""
    with rpc_server() as endpoint, launch.start_server(
            None, ctx=4096, rpc=endpoint, ready_timeout=300,
            extra_args=["-np", "1", "-lv", "4", "--kvmem-budget", "1024", *SMALL]) as srv:
        out = complete(srv.url, haystack_prompt(600, 0.2, "ZEBRA", "48213"), n_predict=8)
        log = srv.log_text()
    assert f"using device RPC0 ({endpoint})" in log
    assert kvmem_log.tiering_state(log) == "armed"
    assert out["tokens_evaluated"] > 2 * 1024
    assert kvmem_log.selects(log)[-1]["staged_in"] > 0
    assert "48213" in out["content"], out["content"]


def test_tensor_split_is_refused_by_tiering_with_a_reason(smollm2) -> None:
    """--split-mode tensor cuts every KV row across devices: tiering says DISABLED and why, the server still
    serves untiered (the RPC device makes tensor split possible on a CPU-only machine)."""
    with rpc_server() as endpoint, launch.start_server(
            None, ctx=2048, rpc=endpoint, ready_timeout=300, self_test=False,
            extra_args=["-np", "1", "-sm", "tensor", "--kvmem-budget", "1024"]) as srv:
        out = complete(srv.url, "The capital of France is", n_predict=4)
        log = srv.log_text()
    assert out["tokens_predicted"] > 0
    assert kvmem_log.tiering_state(log).startswith("disabled: --split-mode tensor"), kvmem_log.tiering_state(log)
