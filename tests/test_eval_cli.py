"""`kvmem eval` end to end: the real CLI against a real CPU llama-server with SmolLM2."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def kvmem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160"}  # wide enough that the table is not wrapped
    return subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 200 and height > 150


def test_eval_endpoint_end_to_end(llama_server, smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    args = ["eval", "--endpoint", "", "--tasks", "niah_single_noise,niah_multikey", "--lengths", "800",
            "--depths", "50", "--samples", "1", "--seed", "3", "--out", str(out), "--label", "smollm2-off"]
    with llama_server(smollm2, ["-c", "2048", "-np", "1"]) as srv:
        args[2] = srv.url
        started = time.monotonic()
        proc = kvmem(*args)
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = (out / "results.jsonl").read_text("utf-8").splitlines()
        assert len(lines) == 2
        records = [json.loads(line) for line in lines]
        assert {r["task"] for r in records} == {"niah_single_noise", "niah_multikey"}
        for r in records:
            assert r["config"] == "smollm2-off" and r["length"] == 800 and r["depth"] == 50
            assert 796 <= r["prompt_tokens"] <= 800
            assert r["server_prompt_tokens"] >= r["prompt_tokens"]  # + the chat template
            assert r["latency_s"] > 0 and isinstance(r["got"], str) and r["expected"]
            assert r["completion_tokens"] > 0 and r["cached_tokens"] is not None
            assert 0 <= r["score"] <= 100
        niah = next(r for r in records if r["task"] == "niah_single_noise")
        # a lone needle in 800 tokens of filler is within even a 135M model's reach (greedy, seeded)
        assert niah["score"] == 100.0, niah
        for name in ("accuracy_vs_length.png", "depth_heatmap.png"):
            assert_png(out / name)
        assert "smollm2-off" in (out / "summary.md").read_text("utf-8")
        assert "niah_single_noise" in proc.stdout and "average" in proc.stdout

        # the same command again resumes: nothing left to do, nothing appended, no new requests needed
        again = kvmem(*args)
        assert again.returncode == 0, again.stderr
        assert "resuming: 2 of 2" in again.stdout
        assert (out / "results.jsonl").read_text("utf-8").splitlines() == lines
    print(f"kvmem eval --endpoint (2 samples at 800 tokens): {elapsed:.1f} s")

    (out / "depth_heatmap.png").unlink()
    report = kvmem("eval", "report", str(out))
    assert report.returncode == 0, report.stderr
    assert_png(out / "depth_heatmap.png")


def test_eval_context_too_small_is_explained(llama_server, smollm2: Path, tmp_path: Path) -> None:
    with llama_server(smollm2, ["-c", "1024", "-np", "1"]) as srv:
        proc = kvmem("eval", "--endpoint", srv.url, "--tasks", "vt", "--lengths", "2000", "--depths", "50",
                     "--samples", "1", "--out", str(tmp_path / "eval"))
    assert proc.returncode != 0
    assert "context is 1024 tokens" in proc.stderr and "-c" in proc.stderr


def test_eval_run_starts_its_own_server(tmp_path: Path) -> None:
    """--run with tiering off (budget 0) goes through the launcher (or the built-in starter)."""
    out = tmp_path / "run"
    proc = kvmem("eval", "--run", "smollm2", "--budgets", "0", "--tasks", "niah_single_noise", "--lengths", "1000",
                 "--depths", "90", "--samples", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text("utf-8").splitlines()]
    assert record["config"] == "off" and record["budget"] == "0" and record["method"] is None
    assert_png(out / "accuracy_vs_length.png")


def test_eval_run_reports_a_refused_engine_flag(tmp_path: Path) -> None:
    """A kvmem flag the engine does not know stops the run with a clear message (real llama-server refusal)."""
    proc = kvmem("eval", "--run", "smollm2", "--budgets", "0", "--server-arg=--kvmem-no-such-flag 1",
                 "--tasks", "vt", "--lengths", "1000", "--depths", "50", "--samples", "1",
                 "--out", str(tmp_path / "bad"), timeout=120)
    assert proc.returncode != 0
    assert "does not know --kvmem-no-such-flag" in proc.stderr
    assert "hint:" in proc.stderr


def test_eval_run_with_a_budget(cpu_engine, tmp_path: Path) -> None:
    """A budgeted configuration passes --kvmem-budget/--kvmem-method to a real tiering engine."""
    help_text = subprocess.run([str(cpu_engine.server), "--help"], capture_output=True, text=True).stdout
    if "--kvmem-budget" not in help_text:
        pytest.skip("this engine has no KV tiering flags (test_eval_run_reports_a_refused_engine_flag covers that)")
    out = tmp_path / "budget"
    proc = kvmem("eval", "--run", "smollm2", "--budgets", "recency:640", "--tasks", "niah_single_noise",
                 "--lengths", "1000", "--depths", "90", "--samples", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text("utf-8").splitlines()]
    assert record["config"] == "640 recency" and record["budget_tokens"] == 640 and record["method"] == "recency"
    assert record["server_prompt_tokens"] > 640  # the prompt really is longer than the working set
