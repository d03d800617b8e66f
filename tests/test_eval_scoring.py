"""Scoring, parsing, results log and report rendering on hand-made data (no server needed)."""

from __future__ import annotations

import json
import struct
from fractions import Fraction
from pathlib import Path

import pytest

from kvmem_llama import plots
from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation.records import ResultsLog, load_records
from kvmem_llama.evaluation.report import markdown, render, summarize, to_json
from kvmem_llama.evaluation.runner import Item, Plan
from kvmem_llama.evaluation.scoring import score
from kvmem_llama.evaluation.servers import (
    Config,
    engine_refusal,
    eval_args,
    parse_budgets,
    parse_length,
    refused_value,
    rejected_flag,
)
from kvmem_llama.evaluation.stats import estimate, proportion, wilson
from kvmem_llama.evaluation.tasks import parse_depths, parse_tasks

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
    for bad in ("2/1", "Side-ways:1/8", "1/0", "", "1/8:query-tokens", "1/8:=3", "0:refresh=64",
                "recency:1/8:budget=9", "2x:1/8"):
        with pytest.raises(KvmemError):
            parse_budgets(bad)


def test_budgets_take_any_method_name_and_engine_options() -> None:
    # method names are the engine's to accept; the harness checks only their spelling
    configs = parse_budgets("votes:1/8,quest:1/8,retrieval:1/8:prefill=retrieval:query-tokens=128,1/8:refresh=0",
                            "meankey")
    assert [c.label for c in configs] == ["1/8 votes", "1/8 quest",
                                          "1/8 retrieval prefill=retrieval query-tokens=128",
                                          "1/8 meankey refresh=0"]
    assert configs[2].server_args(8192) == ["--kvmem-budget", "1024", "--kvmem-method", "retrieval",
                                            "--kvmem-prefill", "retrieval", "--kvmem-query-tokens", "128"]
    assert configs[2].per_length and configs[2].options == (("prefill", "retrieval"), ("query-tokens", "128"))
    # the same budget with and without options are two configurations
    assert len(parse_budgets("1/8,1/8:query-tokens=64")) == 2
    with pytest.raises(KvmemError):
        parse_budgets("1/8", "Bad-Method")


def test_min_budget_follows_the_engine_options() -> None:
    default, small_blocks, odd = parse_budgets("1/8,1/16:block=64:sink=64:recent=128,1/8:sink=1:recent=257")
    assert default.min_budget() == 640  # sink 1 block + recent 2 blocks + one retrieved + the partial tail
    assert small_blocks.min_budget() == (1 + 2 + 2) * 64
    assert odd.min_budget() == (1 + 3 + 2) * 128  # partial blocks round up, as in the engine
    assert parse_budgets("1/8:block=x")[0].min_budget() == 0  # not a number: the engine's own check says so


def test_eval_servers_get_one_slot_and_the_trace() -> None:
    tiered, off = parse_budgets("recency:1/8,0")
    assert eval_args(tiered, 8192) == ["--kvmem-budget", "1024", "--kvmem-method", "recency", "--kvmem-trace",
                                       "-lv", "4", "-np", "1"]
    assert eval_args(off, 8192, ["-t", "4"]) == ["-np", "1", "-t", "4"]  # tiering off: no kvmem flag at all
    assert eval_args(tiered, 8192, ["--parallel", "2", "--kvmem-trace"])[-3:] == ["--parallel", "2", "--kvmem-trace"]
    assert eval_args(tiered, 8192, ["-lv", "5"]).count("-lv") == 1
    assert eval_args(tiered, 8192, ["--parallel", "2"]).count("-np") == 0


def test_rejected_flag_from_llama_server_log() -> None:
    assert rejected_flag("build: 1 (x)\nerror: invalid argument: --kvmem-budget\n") == "--kvmem-budget"
    assert rejected_flag("error: invalid argument: --foo") is None
    assert rejected_flag("all good") is None


def test_refused_value_from_llama_server_log() -> None:
    # llama.cpp's arg parser, when a flag's handler throws (common/arg.cpp)
    log = ('error while handling argument "--kvmem-method": --kvmem-method must be one of retrieval, recency, '
           "quest (got 'votes')\n\nusage:\n--kvmem-method {retrieval,recency,quest}\n")
    assert refused_value(log) == ("--kvmem-method", "--kvmem-method must be one of retrieval, recency, quest "
                                                    "(got 'votes')")
    err = engine_refusal(log)
    assert err is not None and "refused --kvmem-method" in str(err) and "got 'votes'" in str(err)
    assert "does not know --kvmem-budget" in str(engine_refusal("error: invalid argument: --kvmem-budget"))
    assert engine_refusal('error while handling argument "-c": bad') is None


@pytest.mark.parametrize(("k", "n", "lo", "hi"), [
    # Newcombe (1998), Stat Med 17:857, table I, method 3 (Wilson score without continuity correction)
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
    # textbook values: 5/10, and the all-success cell of 30 samples
    (5, 10, 0.2366, 0.7634),
    (30, 30, 0.8865, 1.0),
])
def test_wilson_known_values(k: int, n: int, lo: float, hi: float) -> None:
    got = wilson(k / n, n)
    assert got == (pytest.approx(lo, abs=1e-4), pytest.approx(hi, abs=1e-4))


def test_estimates_treat_scores_as_success_fractions() -> None:
    e = estimate([100.0] * 5 + [0.0] * 5)
    assert (e.mean, e.n) == (50.0, 10)
    assert (e.lo, e.hi) == (pytest.approx(23.66, abs=0.01), pytest.approx(76.34, abs=0.01))
    assert e.text() == "50.0 [23.7, 76.3] (10)"
    # partial credit: four samples at 50 are a mean fraction of 0.5 over n = 4
    assert estimate([50.0] * 4).lo == pytest.approx(100 * wilson(0.5, 4)[0])
    assert estimate([]) is None
    hits = proportion([True, False, None, True])  # unknown (no trace line) is left out
    assert hits.n == 3 and hits.mean == pytest.approx(200 / 3)
    assert proportion([None, None]) is None
    with pytest.raises(ValueError):
        wilson(0.5, 0)


def test_depths_spread10() -> None:
    assert parse_depths("spread10") == [5, 15, 25, 35, 45, 55, 65, 75, 85, 95]
    assert parse_depths("10,50,90") == [10, 50, 90]
    assert parse_depths("spread4") == [12, 38, 62, 88]
    assert parse_depths("50,spread2") == [50, 25, 75]
    for bad in ("", "deep", "101", "spread0", "-5"):
        with pytest.raises(KvmemError):
            parse_depths(bad)


def test_parse_tasks_groups() -> None:
    assert parse_tasks("niah_single,vt") == ["niah_single_noise", "niah_single_essay", "vt"]
    assert parse_tasks("all")[-1] == "cwe"
    with pytest.raises(KvmemError):
        parse_tasks("niah_double")


def test_plan_items_skip_depth_for_cwe() -> None:
    plan = Plan(["vt", "cwe"], [1024, 2048], [10, 90], 2, 0)
    items = plan.items()
    # a cell gets samples x depths samples: cwe (no depth) as many, with distinct indices
    assert len(items) == 2 * (2 * 2 + 2 * 2)
    assert Item("cwe", 1024, None, 3) in items and Item("vt", 2048, 90, 0) in items


def test_plan_spread10_gives_30_samples_per_cell() -> None:
    plan = Plan(parse_tasks("niah_single_essay,followup,cwe"), [8192], parse_depths("spread10"), 3, 0)
    cells: dict[str, int] = {}
    for item in plan.items():
        cells[item.task] = cells.get(item.task, 0) + 1
    assert cells == {"niah_single_essay": 30, "niah_followup": 30, "cwe": 30}
    depths = sorted({i.depth for i in plan.items() if i.task == "niah_followup"})
    assert depths == [5, 15, 25, 35, 45, 55, 65, 75, 85, 95]


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
    assert s.estimates[("off", "niah_single_noise", 1024)].lo == pytest.approx(100 * wilson(1.0, 3)[0])
    assert not s.has_hits  # no sample carries a trace
    assert s.overall[("off", 1024)] == pytest.approx((100 + 0 + 40) / 3)
    assert s.overall[("off", 2048)] == 50.0
    assert s.depth[("off", 50, 1024)] == 50.0  # niah 100 and vt 0 at depth 50; cwe has no depth
    assert ("off", 10, 2048) not in s.depth
    md = markdown(s)
    assert "| off | niah_single_noise | 100.0 [43.9, 100.0] (3) | 50.0 [5.5, 94.5] (1) |" in md
    assert "| 1/8 retrieval | vt | - | - |" in md  # tasks a configuration never ran are dashes
    with open(tmp_path / "results.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    _, files = render(tmp_path)
    names = sorted(f.name for f in files)
    pictures = ["accuracy_vs_length.png", "depth_heatmap.png"] if plots.available() else []  # the plots extra
    assert names == sorted([*pictures, "summary.json", "summary.md"])
    data = json.loads((tmp_path / "summary.json").read_text("utf-8"))
    cell = next(c for c in data["cells"] if (c["config"], c["task"], c["length"]) == ("off", "vt", 1024))
    assert cell["score"] == {"mean": 0.0, "lo": 0.0, "hi": pytest.approx(79.35, abs=0.01), "n": 1}
    assert cell["turn_resident_hit"] is None
    for f in files:
        if f.suffix == ".png":
            w, h = png_size(f)
            assert w > 200 and h > 150


def test_summarize_empty_is_a_user_error() -> None:
    with pytest.raises(KvmemError):
        summarize([])


def test_summary_reports_the_hit_rate_next_to_the_score() -> None:
    records = []
    for i in range(10):  # 10 samples: 6 found; the answer block was resident in 7 of the 9 with a trace
        r = _record("1/8 votes", "niah_single_essay", 8192, 50, i, 100.0 if i < 6 else 0.0)
        r["turn_resident_hit"] = None if i == 9 else i < 7
        r["answer_rank"] = None if i == 9 else i  # places 0..8: median 4
        records.append(r)
    records.append(_record("off", "niah_single_essay", 8192, 50, 0, 100.0))  # off: no trace, no hit
    s = summarize(records)
    hit = s.hits[("1/8 votes", "niah_single_essay", 8192)]
    assert (hit.n, hit.mean) == (9, pytest.approx(700 / 9))
    assert ("off", "niah_single_essay", 8192) not in s.hits
    md = markdown(s)
    assert "| configuration | task | 8K | 8K hit |" in md
    assert f"| 1/8 votes | niah_single_essay | 60.0 [31.3, 83.2] (10) | {hit.text()} |" in md
    assert "| off | niah_single_essay | 100.0 [20.7, 100.0] (1) | - |" in md
    assert s.configs == ["1/8 votes", "off"]  # first appearance, unless the command's order is given
    assert summarize(records, order=["off", "1/8 votes", "1/8 quest"]).configs == ["off", "1/8 votes"]
    data = to_json(s)
    cell = next(c for c in data["cells"] if c["config"] == "1/8 votes")
    assert cell["turn_resident_hit"]["n"] == 9 and cell["score"]["n"] == 10
    assert cell["answer_rank"] == {"median": 4, "max": 8, "n": 9}
    assert next(c for c in data["cells"] if c["config"] == "off")["answer_rank"] is None


def test_server_context_stops_at_the_training_context(tmp_path: Path) -> None:
    from kvmem_llama.evaluation.runner import Evaluation

    e = Evaluation(Plan(["niah_single_essay"], [8192], [50], 1, 0), tmp_path)  # answers up to 32 tokens
    assert e._server_ctx([8192]) == 8448  # prompt + answer + template, rounded up to 256
    assert e._server_ctx([8192], 32768) == 8448
    assert e._server_ctx([32000], 32768) == 32256
    assert e._server_ctx([32650], 32768) == 32768  # the rounding headroom would pass the model's limit
    with pytest.raises(KvmemError, match="training context is 32768") as err:
        e._server_ctx([32768], 32768)
    assert "--lengths up to 32672" in str(err.value.hint)


def test_report_lists_configurations_in_the_commands_order(tmp_path: Path) -> None:
    records = [_record(c, "vt", 1024, 50, 0, 0.0) for c in ("1/8 quest", "off", "1/8 votes")]  # --jobs order
    with open(tmp_path / "results.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    runs = [{"argv": ["kvmem", "eval"], "configs": ["off", "1/8 votes"]}, {"argv": [], "configs": ["1/8 quest"]}]
    (tmp_path / "runs.json").write_text(json.dumps(runs), encoding="utf-8")
    summary, _ = render(tmp_path)
    assert summary.configs == ["off", "1/8 votes", "1/8 quest"]
    (tmp_path / "runs.json").write_text("[{\"argv\": []}]", encoding="utf-8")  # older folders: first appearance
    assert render(tmp_path)[0].configs == ["1/8 quest", "off", "1/8 votes"]
