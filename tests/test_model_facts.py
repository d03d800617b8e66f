"""`kvmem plan --json`, `kvmem inspect --json` and `kvmem doctor --json` read a model the same way: the
same layer counts and KV bytes per token, for real files of every shape the tests use (plain llama and
qwen2, sliding-window gemma3, the hybrid qwen35), and numbers computed by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem_llama.engine import Engine
from kvmem_llama.serving.process import free_port
from kvmem_llama.shipped import shipped_model_path

pytestmark = pytest.mark.engine  # doctor loads the vocabulary with the engine

# (layers, layers with KV, KV bytes per token at f16 and q8_0): layers x KV heads x head dim x (K+V) x bytes
EXPECTED = {
    "smollm2": (30, 30, 30 * 3 * 64 * 2 * 2, 30 * 3 * 64 * 2 * 34 // 32),
    "qwen2.5-coder:0.5b": (24, 24, 24 * 2 * 64 * 2 * 2, 24 * 2 * 64 * 2 * 34 // 32),
    # sliding-window layers keep KV too (a window of it): all 18 count, 1 KV head of 256
    "gemma3:270m": (18, 18, 18 * 1 * 256 * 2 * 2, 18 * 1 * 256 * 2 * 34 // 32),
    # hybrid: full attention on every 4th of 8 layers, the rest recurrent; 2 KV heads of 64
    "qwen35": (8, 2, 2 * 2 * 64 * 2 * 2, 2 * 2 * 64 * 2 * 34 // 32),
}


def kvmem_json(*args: str) -> dict | list:
    out = subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args, "--json"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_plan_inspect_and_doctor_agree(name: str, cpu_engine: Engine, qwen35: dict[str, Path]) -> None:
    model = str(qwen35["plain"] if name == "qwen35" else shipped_model_path(name))
    plan = kvmem_json("plan", model, "--vram", "0")
    inspect = kvmem_json("inspect", model)
    doctor = {c["name"]: c for c in kvmem_json("doctor", model, "--port", str(free_port()))}
    facts = doctor["format"]["facts"]
    assert doctor["format"]["status"] == "ok", doctor["format"]

    layers, with_kv, f16, q8_0 = EXPECTED[name]
    seen = {
        "plan": (plan["model"]["n_layers"], plan["model"]["n_attention_layers"], plan["kv_per_token"]),
        "inspect": (inspect["n_layers"], inspect["n_attention_layers"], inspect["kv_bytes_per_token"]),
        "doctor": (facts["n_layers"], facts["n_attention_layers"], facts["kv_bytes_per_token"]),
    }
    for command, (n_layers, n_kv_layers, kv) in seen.items():
        assert (n_layers, n_kv_layers, kv["f16"], kv["q8_0"]) == (layers, with_kv, f16, q8_0), command
        assert kv == inspect["kv_bytes_per_token"], command  # every cache type, not only the two above
    # the plan's KV cache is that many bytes per token of its context
    ledger = {row["item"]: row for row in plan["ledger"]}
    assert ledger["KV cache"]["bytes"] == plan["profile"]["ctx"] * f16
