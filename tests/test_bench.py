"""`kvmem bench` on the CPU engine: the serving benchmark runs end to end and reports."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvmem_llama.bench import cells, load_results, ratios
from kvmem_llama.engine import Engine

pytestmark = pytest.mark.engine


def test_bench_two_configs_and_report(cpu_engine: Engine, smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    for config, args in (("upstream", ""), ("ours", "-t 2")):
        run = subprocess.run(["kvmem", "bench", "--engine", str(cpu_engine.path), "--model", str(smollm2),
                              "--config", config, "--contexts", "640", "--gen", "8", "--repeats", "2",
                              "--server-args", args, "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
    rows = load_results(out / "results.jsonl")
    assert sorted((r["config"], r["repeat"]) for r in rows) == [("ours", 0), ("ours", 1), ("upstream", 0),
                                                                 ("upstream", 1)]
    for cell in cells(rows):
        assert cell["repeats"] == 2 and cell["failed"] == 0
        assert cell["decode_tps_min"] <= cell["decode_tps_median"] and cell["decode_tokens"] == 8
    for row in rows:
        assert row["error"] is None
        assert row["prefill_tps"] > 0 and row["decode_tps"] > 0
        assert row["kv_buffer_mib"] > 0  # parsed from the engine's own log
        assert row["host_rss_peak_mib"] > 50
    report = subprocess.run(["kvmem", "bench", "report", "--out", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    assert (out / "decode_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| ours | 640 | 2 |" in (out / "results.md").read_text()
    assert len(json.loads((out / "cells.json").read_text())) == 2
    rel = json.loads((out / "ratios.json").read_text())
    assert {r["config"] for r in rel} == {"upstream", "ours"}
    assert next(r for r in rel if r["config"] == "upstream")["decode_vs_baseline"] == 1.0
    assert ratios(rows, "missing") == []


def test_bench_tiered_run_records_selections_refreshes_and_stage_in(cpu_engine: Engine, smollm2: Path,
                                                                     tmp_path: Path) -> None:
    """A generation of 64 tokens with a re-selection every 16: decode tok/s covers all 64 tokens and the
    re-selections are counted and timed apart from the two turn selections."""
    out = tmp_path / "bench"
    args = "-t 2 --kvmem-budget 640 --kvmem-block 64 --kvmem-sink 64 --kvmem-recent 128 --kvmem-refresh 16"
    run = subprocess.run(["kvmem", "bench", "--engine", str(cpu_engine.path), "--model", str(smollm2),
                          "--config", "tiered", "--contexts", "2048", "--gen", "64", "--repeats", "1",
                          "--server-args", args, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (row,) = load_results(out / "results.jsonl")
    assert row["error"] is None
    assert row["decode_tokens"] == 64
    assert len(row["select_ms"]) == 2  # one selection per turn
    assert len(row["refresh_ms"]) >= 64 // 16 - 1, row["refresh_ms"]  # turn 2's generation re-selects
    assert len(row["stage_ms"]) >= 2 and all(ms >= 0 for ms in row["stage_ms"])
    assert row["staged_in_blocks"][0] > 0 and row["stage_in_gbps"] and row["stage_in_gbps"][0] > 0
    (cell,) = cells([row])
    assert cell["refreshes_per_run"] == len(row["refresh_ms"]) and cell["refresh_ms_median"] > 0
