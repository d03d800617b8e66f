"""`kvmem bench` on the CPU engine: the serving benchmark runs end to end and reports."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvmem_llama.bench import TURN2_TOKENS, BenchResult, cells, load_results, markdown_table, ratios, record_selections
from kvmem_llama.engine import Engine
from kvmem_llama.kvmem_log import parse_select

pytestmark = pytest.mark.engine


def _bench(cpu_engine: Engine, smollm2: Path, out: Path, config: str, context: int, gen: int, repeats: int,
           server_args: str, *extra: str) -> None:
    run = subprocess.run(["kvmem", "bench", "--engine", str(cpu_engine.path), "--model", str(smollm2),
                          "--config", config, "--contexts", str(context), "--gen", str(gen), "--repeats", str(repeats),
                          "--server-args", server_args, "--out", str(out), *extra],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_bench_two_configs_and_report(cpu_engine: Engine, smollm2: Path, tmp_path: Path) -> None:
    """"upstream" with a server (and a prefill) per repeat, "ours" with one server for both repeats."""
    out = tmp_path / "bench"
    _bench(cpu_engine, smollm2, out, "upstream", 640, 8, 2, "", "--fresh-servers")
    _bench(cpu_engine, smollm2, out, "ours", 640, 8, 2, "-t 2")
    rows = load_results(out / "results.jsonl")
    assert sorted((r["config"], r["repeat"]) for r in rows) == [("ours", 0), ("ours", 1), ("upstream", 0),
                                                                 ("upstream", 1)]
    runs = {config: [r["server_run"] for r in rows if r["config"] == config] for config in ("upstream", "ours")}
    assert len(set(runs["upstream"])) == 2 and len(set(runs["ours"])) == 1
    assert {r["prefill_shared"] for r in rows} == {False, True}
    ours = [r for r in rows if r["config"] == "ours"]
    assert ours[0]["prefill_tps"] == ours[1]["prefill_tps"] and all(r["prefill_shared"] for r in ours)
    for cell in cells(rows):
        assert cell["repeats"] == 2 and cell["failed"] == 0
        assert cell["servers"] == (2 if cell["config"] == "upstream" else 1)
        assert cell["decode_tps_min"] <= cell["decode_tps_median"] and cell["decode_tokens"] == 8
    for row in rows:
        assert row["error"] is None
        assert row["prefill_tps"] > 0 and row["decode_tps"] > 0
        assert row["kv_buffer_mib"] > 0  # parsed from the engine's own log
        assert row["host_rss_peak_mib"] > 50
        # the anonymous part (no model file pages) is sampled apart; tiering off reserves no host KV pool
        assert 0 < row["host_anon_peak_mib"] < row["host_rss_peak_mib"] and row["host_pool_mib"] is None
        assert TURN2_TOKENS <= row["turn2_prompt_tokens"] <= TURN2_TOKENS + 8
    report = subprocess.run(["kvmem", "bench", "report", "--out", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    assert (out / "decode_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    assert "| ours | 640 | 2 | 1 |" in table and "| upstream | 640 | 2 | 2 |" in table
    assert len(json.loads((out / "cells.json").read_text())) == 2
    rel = json.loads((out / "ratios.json").read_text())
    assert {r["config"] for r in rel} == {"upstream", "ours"}
    assert next(r for r in rel if r["config"] == "upstream")["decode_vs_baseline"] == 1.0
    assert ratios(rows, "missing") == []


def test_bench_repeats_share_one_server_and_prefill(cpu_engine: Engine, smollm2: Path, tmp_path: Path) -> None:
    """Two repeats on one server after one prefill: each turn 2 reads only its 512 new tokens (the prompt
    cache keeps the 1,024-token prefix and drops the other repeat's suffix), and each row carries the
    selections of its own part of the server log."""
    out = tmp_path / "bench"
    args = "-t 2 --kvmem-budget 384 --kvmem-block 64 --kvmem-sink 64 --kvmem-recent 128 --kvmem-refresh 8"
    _bench(cpu_engine, smollm2, out, "tiered", 1024, 16, 2, args)
    rows = load_results(out / "results.jsonl")
    assert [r["repeat"] for r in rows] == [0, 1]
    assert rows[0]["server_run"] == rows[1]["server_run"] and all(r["prefill_shared"] for r in rows)
    assert rows[0]["prefill_tps"] == rows[1]["prefill_tps"] > 0
    for row in rows:
        assert row["error"] is None and row["decode_tokens"] == 16
        # turn 2 = 1,008 prompt + 16 generated + 512 new: the prefix came from the cache
        assert TURN2_TOKENS <= row["turn2_prompt_tokens"] <= TURN2_TOKENS + 4, row
        assert row["turn2_cached_tokens"] >= 1024 - 4
        assert len(row["select_ms"]) == 1  # this repeat's turn selection, not the other one's nor turn 1's
        assert len(row["refresh_ms"]) >= 1  # a re-selection every 8 generated tokens
        assert len(row["staged_in_blocks"]) == len(row["stage_ms"]) == 1
        assert len(row["turn1"]["select_ms"]) == 1 and row["turn1"] == rows[0]["turn1"]
    # the log of the one server holds turn 1's selection and one per repeat, in order
    (log,) = (out / "logs").iterdir()
    turns = [s["ms"] for line in log.read_text().splitlines()
             if (s := parse_select(line)) and s.get("reason") == "turn"]
    assert turns == rows[0]["turn1"]["select_ms"] + rows[0]["select_ms"] + rows[1]["select_ms"]
    (cell,) = cells(rows)
    assert cell["repeats"] == 2 and cell["servers"] == 1 and cell["prefill_tps_min"] == cell["prefill_tps_median"]
    assert cell["turn2_prompt_tokens_max"] <= TURN2_TOKENS + 4 and cell["stage_ms_median"] is not None


def test_cells_take_prefill_over_server_runs_only() -> None:
    """Three repeats of one server and two fresh servers: prefill min/median over the 3 servers, decode over
    the 5 repeats; rows of older versions (no server_run) are a server each."""
    def row(run: str | None, prefill: float, decode: float) -> dict:
        return {"config": "c", "context": 4096, "prefill_tps": prefill, "decode_tps": decode, "error": None,
                "server_run": run, "peak_vram_mib": None, "kv_buffer_mib": 1.0, "host_rss_peak_mib": 1.0}

    rows = [row("a", 100.0, 10.0), row("a", 100.0, 11.0), row("a", 100.0, 12.0), row("b", 200.0, 13.0),
            row(None, 300.0, 14.0)]
    (cell,) = cells(rows)
    assert cell["repeats"] == 5 and cell["servers"] == 3
    assert (cell["prefill_tps_min"], cell["prefill_tps_median"]) == (100.0, 200.0)
    assert (cell["decode_tps_min"], cell["decode_tps_median"]) == (10.0, 12.0)
    assert "| c | 4,096 | 5 | 3 | 100.0 / 200.0 |" in markdown_table(rows)


def test_bench_tiered_run_records_selections_refreshes_and_stage_in(cpu_engine: Engine, smollm2: Path,
                                                                     tmp_path: Path) -> None:
    """A generation of 64 tokens with a re-selection every 16: decode tok/s covers all 64 tokens and the
    re-selections are counted and timed apart from the two turn selections."""
    out = tmp_path / "bench"
    args = "-t 2 --kvmem-budget 640 --kvmem-block 64 --kvmem-sink 64 --kvmem-recent 128 --kvmem-refresh 16"
    _bench(cpu_engine, smollm2, out, "tiered", 2048, 64, 1, args)
    (row,) = load_results(out / "results.jsonl")
    assert row["error"] is None
    assert row["decode_tokens"] == 64
    assert len(row["turn1"]["select_ms"]) == 1 and len(row["select_ms"]) == 1  # one selection per turn
    assert len(row["refresh_ms"]) >= 64 // 16 - 1, row["refresh_ms"]  # turn 2's generation re-selects
    assert len(row["stage_ms"]) == 1 and all(ms >= 0 for ms in row["stage_ms"] + row["turn1"]["stage_ms"])
    # the scorer's part is timed within the selection
    assert len(row["score_ms"]) == 1 and 0 <= row["score_ms"][0] <= row["select_ms"][0]
    # the prompt's ubatches were captured and written through before the turn's selection: host time > 0
    assert len(row["capture_ms"]) == 1 and row["capture_ms"][0] > 0
    assert len(row["refresh_capture_ms"]) == len(row["refresh_ms"])
    # turn 1's selection brings the picked blocks in (after the prefill's window)
    assert row["turn1"]["staged_in_blocks"][0] > 0 and row["turn1"]["stage_in_gbps"][0] > 0
    (cell,) = cells([row])
    assert cell["refreshes_per_run"] == len(row["refresh_ms"]) and cell["refresh_ms_median"] > 0
    assert cell["turn1_stage_in_gbps_median"] > 0
    # the host KV pool the engine reserved (ARMED host_mib): the whole 2K context at f16, 23,040 B per token
    assert cell["host_pool_mib"] >= 2048 * 23040 / 2**20 and cell["host_anon_peak_mib"] > 0
    assert f"| {cell['host_pool_mib']:,.0f} |" in markdown_table([row])


def test_record_selections_keeps_each_turns_batch_timing_and_the_cell_its_medians() -> None:
    """TURN lines (where a prompt's last batch spent its time) land in `turns`; the cell has their medians and
    the repeats' time to first token."""
    line = ("0.05 W kvmem_score: TURN seq=0 tokens=4 segments=1 snapshots=1 snapshot_ms={snap} restore_ms=0.100 "
            "recompute_tokens=132 recompute_ms={rec} ms={ms}")
    rows = []
    for repeat, (snap, rec, ms, ttft) in enumerate([(0.02, 90.0, 180.0, 400.0), (0.04, 110.0, 220.0, 600.0)]):
        result = BenchResult("tiering-on", 4096, 4000, 1000.0, 50.0, 900.0, None, 64.0, 100.0, repeat=repeat,
                             turn2_prompt_ms=ttft)
        record_selections(line.format(snap=snap, rec=rec, ms=ms), result, block_bytes=1)
        assert result.turns == [{"seq": 0, "tokens": 4, "segments": 1, "snapshots": 1, "snapshot_ms": snap,
                                 "restore_ms": 0.1, "recompute_tokens": 132, "recompute_ms": rec, "ms": ms}]
        assert result.select_ms == []  # a TURN line is not a selection
        rows.append(result.__dict__)
    (cell,) = cells(rows)
    assert cell["ttft_ms_median"] == 500.0
    assert cell["turn_batch_recompute_ms_median"] == 100.0 and cell["turn_batch_ms_median"] == 200.0
    assert "| 500 |" in markdown_table(rows)


def test_record_selections_sorts_select_lines_by_reason() -> None:
    """turn (and an engine that names no reason) -> select_ms with its stage-in; refresh/room -> refresh_ms;
    prefill -> prompt_select_ms; a fits=1 line (nothing to select) is a turn selection of 0 ms."""
    keys = "seq=0 n_blocks=24 budget_blocks=6 share=6 sink=1 recent=2 scored=2 staged_out=0 reused=5 query_tokens=128"
    log = "\n".join([
        f"0.01 W kvmem_score: SELECT {keys} staged_in=4 ms=8.000 stage_ms=2.000 stage_mib=8.0 reason=turn pos=1024 "
        "score_ms=5.000 capture_ms=40.000",
        f"0.02 W kvmem_score: SELECT {keys} staged_in=1 ms=3.000 stage_ms=1.000 stage_mib=2.0 reason=refresh pos=1040 "
        "score_ms=1.000 capture_ms=6.500 plan_ms=0.500 score_steps=1 score_build_ms=0.100 score_upload_ms=0.200 "
        "score_compute_ms=0.700 gather_ms=0.050 stage_wait_ms=0.400",
        f"0.03 W kvmem_score: SELECT {keys} staged_in=0 ms=2.500 stage_ms=0.000 stage_mib=0.0 reason=room pos=1050",
        f"0.04 W kvmem_score: SELECT {keys} staged_in=2 ms=5.000 stage_ms=1.000 stage_mib=4.0 reason=prefill pos=512",
        f"0.05 W kvmem_score: SELECT {keys} staged_in=0 ms=0.000 stage_ms=0.000 stage_mib=0.0 reason=turn pos=9 fits=1",
        f"0.06 W kvmem_score: SELECT {keys} staged_in=2 ms=4.000",  # an older engine: no reason, no stage_ms
        "0.07 I slot      release: id  0 | task 17 | stop processing: n_tokens = 1551, truncated = 0",
    ])
    result = BenchResult("c", 1024, 1008, 0.0, 0.0, 0.0, None, 0.0, 0.0)
    record_selections(log, result, block_bytes=2**20)
    assert result.select_ms == [8.0, 0.0, 4.0]
    assert result.refresh_ms == [3.0, 2.5] and result.prompt_select_ms == [5.0]
    assert result.staged_in_blocks == [4, 0, 2] and result.stage_ms == [2.0, 0.0]
    assert result.score_ms == [5.0]  # only the engines that time their scorer say it
    assert result.capture_ms == [40.0] and result.refresh_capture_ms == [6.5]
    # the parts of a selection, from the engines that time them
    assert result.phases == [{"reason": "refresh", "ms": 3.0, "stage_ms": 1.0, "score_ms": 1.0, "plan_ms": 0.5,
                              "score_steps": 1, "score_build_ms": 0.1, "score_upload_ms": 0.2, "score_compute_ms": 0.7,
                              "gather_ms": 0.05, "stage_wait_ms": 0.4, "capture_ms": 6.5}]
    assert result.stage_in_gbps == [round(8 * 2**20 / 0.002 / 1e9, 2), round(2 * 2**20 / 0.004 / 1e9, 2)]


def test_image_events_take_the_encode_from_the_log_times_and_the_decode_from_its_lines() -> None:
    from kvmem_llama.bench import image_events

    text = ("1.02.100.000 I slot process_mtmd: id  0 | task 0 | encoding mtmd batch from idx = 1, n_chunks = 1\n"
            "1.02.350.500 I image decoded (batch 1/2) in 50 ms\n"
            "1.02.400.000 I image decoded (batch 2/2) in 40 ms\n")
    assert image_events(text) == (200.5, 90.0)  # 250.5 ms from the start of the encode to the first decode's end
    assert image_events("0.00.001.000 I no images here\n") == (None, None)
