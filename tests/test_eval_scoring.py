"""Scoring, parsing, results log and report rendering on hand-made data (no server needed)."""

from __future__ import annotations

import json
import struct
from fractions import Fraction
from pathlib import Path

import pytest

from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation.report import markdown, render, summarize
from kvmem_llama.evaluation.runner import Item, Plan, ResultsLog, load_records
from kvmem_llama.evaluation.scoring import score
from kvmem_llama.evaluation.servers import Config, parse_budgets, parse_length, rejected_flag
from kvmem_llama.evaluation.tasks import parse_tasks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize(("expected", "got", "want"), [
    (["1234567"], "The special magic number is 1234567.", 100.0),
    (["1234567"], "The special magic number is 1234568.", 0.0),
    (["quiet-harbor"], "QUIET-HARBOR, of course", 100.0),
    (["11", "22", "33", "44"], "I found 22 and 44 only", 50.0),
    (["ABCDE", "FGHIJ", "KLMNO"], "abcde, kLmNo", pytest.approx(200 / 3)),
    (["apple", "pear"], "", 0.0),
    (["apple"], "pineapple", 100.0),  # RULER's substring rule: containment counts
])
def test_score_hand_made(expected: list[str], got: str, want: float) -> None:
    assert score(expected, got) == want


def test_cwe_scoring_counts_only_the_first_list_words() -> None:
    pool = {"apple", "pear", "plum", "fig", "kiwi", "lime"}
    expected = ["apple", "pear", "plum"]
    # the preamble has no list words; the first three list words named are what counts
    assert score(expected, "The top 3 words that appear most often are: Apple, pear, plum.", pool) == 100.0
    assert score(expected, "apple, fig, kiwi, pear, plum", pool) == pytest.approx(100 / 3)
    # reciting the whole list earns nothing: plain substring scoring would give 100 here
    recital = "fig, kiwi, lime, apple, pear, plum"
    assert score(expected, recital) == 100.0 and score(expected, recital, pool) == 0.0
    assert score(expected, "apple apple apple pear", pool) == pytest.approx(200 / 3)  # repeats are one pick
    assert score(expected, "", pool) == 0.0


def test_score_needs_expected() -> None:
    with pytest.raises(ValueError):
        score([], "anything")


def test_parse_lengths_and_budgets() -> None:
    assert parse_length("4k") == 4096
    assert parse_length("1500") == 1500
    assert parse_length("0.5K") == 512
    with pytest.raises(KvmemError):
        parse_length("lots")
    configs = parse_budgets("0,1/8,0.0625,recency:1/8,2k", "retrieval")
    assert [c.label for c in configs] == ["off", "1/8 retrieval", "1/16 retrieval", "1/8 recency", "2048 retrieval"]
    assert configs[0].server_args(8192) == []  # tiering off passes no kvmem flag at all
    assert configs[1].server_args(8192) == ["--kvmem-budget", "1024", "--kvmem-method", "retrieval"]
    assert configs[3].server_args(16384) == ["--kvmem-budget", "2048", "--kvmem-method", "recency"]
    assert configs[4].budget_tokens(99999) == 2048 and not configs[4].per_length
    assert Config(Fraction(1, 8)).per_length
    for bad in ("2/1", "sideways:1/8", "1/0", ""):
        with pytest.raises(KvmemError):
            parse_budgets(bad)


def test_rejected_flag_from_llama_server_log() -> None:
    assert rejected_flag("build: 1 (x)\nerror: invalid argument: --kvmem-budget\n") == "--kvmem-budget"
    assert rejected_flag("error: invalid argument: --foo") is None
    assert rejected_flag("all good") is None


def test_parse_tasks_groups() -> None:
    assert parse_tasks("niah_single,vt") == ["niah_single_noise", "niah_single_essay", "vt"]
    assert parse_tasks("all")[-1] == "cwe"
    with pytest.raises(KvmemError):
        parse_tasks("niah_double")


def test_plan_items_skip_depth_for_cwe() -> None:
    plan = Plan(["vt", "cwe"], [1024, 2048], [10, 90], 2, 0)
    items = plan.items()
    assert len(items) == 2 * (2 * 2 + 1 * 2)
    assert Item("cwe", 1024, None, 1) in items and Item("vt", 2048, 90, 0) in items


def _record(config: str, task: str, length: int, depth: int | None, sample: int, value: float) -> dict:
    return {"task": task, "length": length, "depth": depth, "sample": sample, "seed": 0, "config": config,
            "expected": ["x"], "got": "", "score": value, "latency_s": 1.5}


def test_results_log_resumes_and_survives_torn_line(tmp_path: Path) -> None:
    log = ResultsLog(tmp_path)
    log.append(_record("off", "vt", 1024, 50, 0, 100.0))
    with open(tmp_path / "results.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"task": "vt", "len')  # a run killed mid-write
    again = ResultsLog(tmp_path)
    assert again.is_done("off", Item("vt", 1024, 50, 0), 0)
    assert not again.is_done("off", Item("vt", 1024, 50, 1), 0)
    assert not again.is_done("1/8 retrieval", Item("vt", 1024, 50, 0), 0)
    again.append(_record("off", "vt", 1024, 50, 1, 0.0))
    assert [r["sample"] for r in load_records(tmp_path)] == [0, 1]


def test_summary_weighs_tasks_equally_and_renders(tmp_path: Path) -> None:
    records = [
        # niah: 3 depths at 1024 -> mean 100; vt: one sample 0 -> task mean 0; overall 50, not 75
        _record("off", "niah_single_noise", 1024, 10, 0, 100.0),
        _record("off", "niah_single_noise", 1024, 50, 0, 100.0),
        _record("off", "niah_single_noise", 1024, 90, 0, 100.0),
        _record("off", "vt", 1024, 50, 0, 0.0),
        _record("off", "niah_single_noise", 2048, 50, 0, 50.0),
        _record("1/8 retrieval", "niah_single_noise", 1024, 50, 0, 25.0),
        _record("off", "cwe", 1024, None, 0, 40.0),
    ]
    s = summarize(records)
    assert s.configs == ["off", "1/8 retrieval"]
    assert s.lengths == [1024, 2048]
    assert s.cell[("off", "niah_single_noise", 1024)] == (100.0, 3)
    assert s.overall[("off", 1024)] == pytest.approx((100 + 0 + 40) / 3)
    assert s.overall[("off", 2048)] == 50.0
    assert s.depth[("off", 50, 1024)] == 50.0  # niah 100 and vt 0 at depth 50; cwe has no depth
    assert ("off", 10, 2048) not in s.depth
    md = markdown(s)
    assert "| off | niah_single_noise | 100.0 (3) | 50.0 (1) |" in md
    assert "| 1/8 retrieval | vt | - | - |" in md  # tasks a configuration never ran are dashes
    with open(tmp_path / "results.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    _, files = render(tmp_path)
    names = sorted(f.name for f in files)
    assert names == ["accuracy_vs_length.png", "depth_heatmap.png", "summary.md"]
    for f in files:
        if f.suffix == ".png":
            w, h = png_size(f)
            assert w > 200 and h > 150


def test_summarize_empty_is_a_user_error() -> None:
    with pytest.raises(KvmemError):
        summarize([])
