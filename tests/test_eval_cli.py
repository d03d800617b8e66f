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

from kvmem_llama import plots

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def kvmem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160"}  # wide enough that the table is not wrapped
    return subprocess.run([sys.executable, "-m", "kvmem_llama.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_png(path: Path) -> None:
    """A real PNG with the plots extra installed; without matplotlib, no file (the report says it skipped it)."""
    if not plots.available():
        assert not path.exists()
        return
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

    (out / "depth_heatmap.png").unlink(missing_ok=True)
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
    """--run with tiering off (budget 0) starts its server as `kvmem run` does."""
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


def test_eval_run_reports_a_method_the_engine_refuses(cpu_engine, tmp_path: Path) -> None:
    """Any method name passes the harness; the real engine's refusal of an unknown one is what the user sees."""
    help_text = subprocess.run([str(cpu_engine.server), "--help"], capture_output=True, text=True).stdout
    if "--kvmem-method" not in help_text:
        pytest.skip("this engine has no --kvmem-method")
    proc = kvmem("eval", "--run", "smollm2", "--budgets", "no_such_method:640", "--tasks", "niah_single_noise",
                 "--lengths", "1000", "--depths", "50", "--samples", "1", "--out", str(tmp_path / "bad"), timeout=120)
    assert proc.returncode != 0
    assert "the engine refused --kvmem-method" in proc.stderr and "no_such_method" in proc.stderr, proc.stderr
    assert "hint:" in proc.stderr


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text("utf-8").splitlines()]


def test_eval_followup_two_requests_reuse_the_prompt_cache(tmp_path: Path) -> None:
    """niah_followup on SmolLM2 (budget off): document A, then document B + the question, scored."""
    out = tmp_path / "followup"
    proc = kvmem("eval", "--run", "smollm2", "--budgets", "0", "--tasks", "followup", "--lengths", "1500",
                 "--depths", "50", "--samples", "1", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = _records(out)
    assert r["task"] == "niah_followup" and r["depth"] == 50 and r["config"] == "off"
    assert r["score"] in (0.0, 100.0) and r["expected"][0].isdigit()
    (first,) = r["earlier_answers"]
    assert isinstance(first, str) and r["earlier_prompt_tokens"][0] < r["server_prompt_tokens"]
    # the second request reused the first one's prompt (document A) from the server's cache
    assert r["cached_tokens"] >= r["earlier_prompt_tokens"][0] - 8, r
    assert r["server_prompt_tokens"] <= 1500 + 64  # + the chat template
    # the answer's token position is inside document B, after everything of the first request
    (pos,) = r["answer_positions"]
    assert r["earlier_prompt_tokens"][0] < pos < r["server_prompt_tokens"]
    assert r["turn_resident_hit"] is None and r["selects"] == 0  # tiering off: nothing to select
    assert "niah_followup" in (out / "summary.md").read_text("utf-8")


def test_eval_jobs_run_configurations_at_once_with_the_same_results(cpu_engine, tmp_path: Path) -> None:
    """--jobs 2 starts both servers at once; every sample gets the answer it gets with --jobs 1."""
    help_text = subprocess.run([str(cpu_engine.server), "--help"], capture_output=True, text=True).stdout
    if "--kvmem-budget" not in help_text:
        pytest.skip("this engine has no KV tiering flags")
    common = ["--run", "smollm2", "--budgets", "0,recency:640", "--tasks", "niah_single_noise", "--lengths", "900",
              "--depths", "10,90", "--samples", "1", "--server-args", "-t 1"]
    results = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        proc = kvmem("eval", *common, "--jobs", str(jobs), "--out", str(out), timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        records = _records(out)
        assert len(records) == 4
        results[jobs] = {(r["config"], r["task"], r["length"], r["depth"], r["sample"]): r for r in records}
        logs = sorted(p.name for p in (out / "logs").iterdir())
        assert logs == ["server-640-recency-900.log", "server-off-900.log"], logs
    assert results[1].keys() == results[2].keys()
    for key, one in results[1].items():
        two = results[2][key]
        assert (one["score"], one["got"], one["answer_positions"]) == (two["score"], two["got"],
                                                                       two["answer_positions"]), key
    tiered = [r for r in results[2].values() if r["config"] == "640 recency"]
    assert all(r["block_tokens"] == 128 and r["selects"] >= 1 and r["staged_in"] is not None for r in tiered)
    assert all(r["answer_blocks"] == [p // 128 for p in r["answer_positions"]] for r in tiered)
    off = [r for r in results[2].values() if r["config"] == "off"]
    assert all(r["block_tokens"] is None and r["selects"] == 0 and r["answer_blocks"] is None for r in off)
    trace = (tmp_path / "jobs2" / "logs" / "server-640-recency-900.log").read_text("utf-8", errors="replace")
    if "kvmem_trace: resident" in trace:  # engines with the resident trace line
        hit = {r["depth"]: r["turn_resident_hit"] for r in tiered}
        # recency keeps the sink and the newest blocks of a 900-token prompt in 640 tokens: the needle at
        # 90% is resident after the turn's selection, the one at 10% is not
        assert hit == {90: True, 10: False}, tiered
        assert all(r["selects_hit"] is not None for r in tiered)
    if "kvmem_trace: ranked" in trace:  # engines with the ranked trace line
        rank = {r["depth"]: r["answer_rank"] for r in tiered}
        # the needle at 90% is in the recent window (kept by rule, not ranked); the one at 10% was ranked, not picked
        assert rank[90] == 0 and rank[10] >= 1, tiered


def test_eval_run_refuses_a_budget_the_engine_would_refuse(tmp_path: Path) -> None:
    """1/32 of 2K is 64 tokens, less than the sink + recent window + two blocks: said before any server starts."""
    proc = kvmem("eval", "--run", "smollm2", "--budgets", "0,hybrid:1/32,1024", "--tasks", "niah_single_noise",
                 "--lengths", "2k,7k", "--depths", "50", "--samples", "1", "--out", str(tmp_path / "small"), timeout=60)
    assert proc.returncode != 0
    said = " ".join(proc.stderr.split())  # the console wraps long lines
    assert "1/32 hybrid at 2048 (64 tokens), 1/32 hybrid at 7168 (224 tokens);" in said, said
    assert "at least 640 tokens" in said and "1024" not in said.split("hint")[0], said
    assert "ready at" not in proc.stdout  # no server was started


def test_eval_run_refuses_a_length_beyond_the_training_context(tmp_path: Path) -> None:
    """SmolLM2 was trained on 8192 tokens: an 8k prompt + answer does not fit; said before any server starts."""
    proc = kvmem("eval", "--run", "smollm2", "--budgets", "0,recency:1/8", "--tasks", "niah_single_noise",
                 "--lengths", "2k,8k", "--depths", "50", "--samples", "1", "--out", str(tmp_path / "long"), timeout=60)
    assert proc.returncode != 0
    assert "training context is 8192 tokens" in proc.stderr and "--lengths up to" in proc.stderr, proc.stderr
    assert "ready at" not in proc.stdout  # no server was started
