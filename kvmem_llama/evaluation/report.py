"""Summaries and pictures from results.jsonl: a table (task x length per configuration) and PNGs.

Each cell is the mean score with its 95% Wilson interval and the sample count; next to it, where
the engine traced its selections, the share of samples whose answer blocks were resident after
the turn's selection (with its own interval). Averages are per task first, then across tasks
with equal weight, so a task with more depths does not outweigh the others (no interval there:
the tasks' samples are not one population). summary.json holds the same numbers.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmem_llama import plots
from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation.records import load_records
from kvmem_llama.evaluation.scoring import mean
from kvmem_llama.evaluation.stats import Estimate, estimate, proportion

ACCURACY_PNG = "accuracy_vs_length.png"
HEATMAP_PNG = "depth_heatmap.png"
SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"


@dataclass
class Summary:
    configs: list[str]
    tasks: list[str]
    lengths: list[int]
    cell: dict[tuple[str, str, int], tuple[float, int]]  # (config, task, length) -> (mean score, samples)
    overall: dict[tuple[str, int], float]  # (config, length) -> mean over tasks
    depth: dict[tuple[str, int, int], float]  # (config, depth, length) -> mean over depth-aware tasks
    depths: list[int]
    latency: dict[str, float]  # config -> mean latency (s)
    # (config, task, length) -> score with its 95% Wilson interval
    estimates: dict[tuple[str, str, int], Estimate] = field(default_factory=dict)
    # (config, task, length) -> share of samples with every answer block resident after the turn selection
    hits: dict[tuple[str, str, int], Estimate] = field(default_factory=dict)
    # (config, task, length) -> the answer blocks' place in the turn's attention order, per traced sample
    ranks: dict[tuple[str, str, int], list[int]] = field(default_factory=dict)

    @property
    def has_hits(self) -> bool:
        return bool(self.hits)


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def summarize(records: list[dict], order: list[str] | None = None) -> Summary:
    """`order`: configuration labels to list first, in that order (e.g. the command's --budgets);
    the rest follow in the order they first appear (with --jobs that order varies)."""
    if not records:
        raise KvmemError("no results to summarize", hint="run `kvmem eval` first; results live in OUT/results.jsonl")
    seen = _ordered(r["config"] for r in records)
    configs = [c for c in order or [] if c in seen] + [c for c in seen if c not in (order or [])]
    tasks = _ordered(r["task"] for r in records)
    lengths = sorted({int(r["length"]) for r in records})
    depths = sorted({int(r["depth"]) for r in records if r.get("depth") is not None})
    scores: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    by_depth: dict[tuple[str, str, int, int], list[float]] = defaultdict(list)
    lat: dict[str, list[float]] = defaultdict(list)
    hit_flags: dict[tuple[str, str, int], list[bool | None]] = defaultdict(list)
    ranks: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for r in records:
        scores[(r["config"], r["task"], int(r["length"]))].append(float(r["score"]))
        hit_flags[(r["config"], r["task"], int(r["length"]))].append(r.get("turn_resident_hit"))
        if r.get("answer_rank") is not None:
            ranks[(r["config"], r["task"], int(r["length"]))].append(int(r["answer_rank"]))
        if r.get("depth") is not None:
            by_depth[(r["config"], r["task"], int(r["depth"]), int(r["length"]))].append(float(r["score"]))
        if r.get("latency_s") is not None:
            lat[r["config"]].append(float(r["latency_s"]))
    cell = {k: (sum(v) / len(v), len(v)) for k, v in scores.items()}
    overall: dict[tuple[str, int], float] = {}
    for c in configs:
        for n in lengths:
            m = mean(cell[(c, t, n)][0] for t in tasks if (c, t, n) in cell)
            if m is not None:
                overall[(c, n)] = m
    depth: dict[tuple[str, int, int], float] = {}
    for c in configs:
        for d in depths:
            for n in lengths:
                m = mean(sum(v) / len(v) for (c2, _, d2, n2), v in by_depth.items() if (c2, d2, n2) == (c, d, n))
                if m is not None:
                    depth[(c, d, n)] = m
    latency = {c: sum(v) / len(v) for c, v in lat.items() if v}
    estimates = {k: e for k, v in scores.items() if (e := estimate(v)) is not None}
    hits = {k: e for k, v in hit_flags.items() if (e := proportion(v)) is not None}
    return Summary(configs, tasks, lengths, cell, overall, depth, depths, latency, estimates, hits, dict(ranks))


def to_json(summary: Summary) -> dict:
    """The summary's numbers, machine-readable (what summary.json holds)."""
    cells = []
    for (c, t, n), e in summary.estimates.items():
        hit = summary.hits.get((c, t, n))
        ranks = summary.ranks.get((c, t, n))
        cells.append({"config": c, "task": t, "length": n, "score": e.as_dict(),
                      "turn_resident_hit": hit.as_dict() if hit else None,
                      "answer_rank": {"median": statistics.median(ranks), "max": max(ranks), "n": len(ranks)}
                      if ranks else None})
    return {
        "interval": "95% Wilson score interval on the mean, each sample's score/100 counted as its success "
                    "fraction, n = samples; the hit rate counts samples with a known turn_resident_hit",
        "configs": summary.configs, "tasks": summary.tasks, "lengths": summary.lengths,
        "cells": cells,
        "average": [{"config": c, "length": n, "mean": round(v, 4)} for (c, n), v in summary.overall.items()],
        "latency_s": {c: round(v, 3) for c, v in summary.latency.items()},
    }


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


@dataclass
class Row:
    """One row of the summary table: a (configuration, task) cell per length, or the configuration's
    average over tasks (`task` None); with hit rates, each length has a second cell for them."""

    config: str
    task: str | None
    cells: list[str]

    def shown(self, bold: Callable[[str], str]) -> list[str]:
        """The cells, the average's numbers marked with `bold` (markdown or console markup)."""
        return [bold(c) if self.task is None and c not in ("", "-") else c for c in self.cells]


def columns(summary: Summary) -> list[str]:
    """The length columns of the table (each followed by its hit-rate column when there are hits)."""
    heads = []
    for n in summary.lengths:
        heads.append(length_label(n))
        if summary.has_hits:
            heads.append(f"{length_label(n)} hit")
    return heads


def rows(summary: Summary) -> list[Row]:
    """Per configuration: a row per task, then its average row."""
    out = []
    for c in summary.configs:
        for t in summary.tasks:
            cells = []
            for n in summary.lengths:
                got = summary.estimates.get((c, t, n))
                cells.append(got.text() if got else "-")
                if summary.has_hits:
                    hit = summary.hits.get((c, t, n))
                    cells.append(hit.text() if hit else "-")
            out.append(Row(c, t, cells))
        averages = []
        for n in summary.lengths:
            averages.append(f"{summary.overall[(c, n)]:.1f}" if (c, n) in summary.overall else "-")
            if summary.has_hits:
                averages.append("")
        out.append(Row(c, None, averages))
    return out


def markdown(summary: Summary) -> str:
    """One table: rows = configuration x task (+ an average row), columns = lengths (+ hit rate per length)."""
    heads = columns(summary)
    lines = ["| configuration | task | " + " | ".join(heads) + " |", "|" + "---|" * (2 + len(heads))]
    for row in rows(summary):
        task = row.task if row.task is not None else "**average**"
        lines.append(f"| {row.config} | {task} | " + " | ".join(row.shown(lambda c: f"**{c}**")) + " |")
    lines.append("")
    lines.append("Scores are the percent of expected strings found in the answer (case-insensitive), averaged "
                 "over samples and depths: mean [95% Wilson interval] (samples); the interval counts each "
                 "sample's score/100 as its success fraction. The average row weighs tasks equally.")
    if summary.has_hits:
        lines.append("")
        lines.append("*hit*: percent of samples whose answer blocks were all resident after the turn's selection "
                     "(engine trace), with its 95% Wilson interval (samples with a trace line).")
    return "\n".join(lines) + "\n"


def _pyplot():
    plt = plots.pyplot()
    if plt is None:
        raise KvmemError("plots need matplotlib", hint=plots.PLOTS_EXTRA)
    return plt


def plot_accuracy(summary: Summary, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for c in summary.configs:
        xs = [n for n in summary.lengths if (c, n) in summary.overall]
        ax.plot(xs, [summary.overall[(c, n)] for n in xs], marker="o", label=c)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(summary.lengths)
    ax.set_xticklabels([length_label(n) for n in summary.lengths])
    ax.set_ylim(-3, 103)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("score (mean over tasks)")
    ax.set_title("Accuracy vs context length")
    ax.grid(True, alpha=0.3)
    ax.legend(title="configuration")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_heatmap(summary: Summary, path: Path) -> Path:
    """Depth x length per configuration (tasks with a needle depth only)."""
    plt = _pyplot()
    configs = [c for c in summary.configs if any(k[0] == c for k in summary.depth)] or summary.configs
    depths = summary.depths or [0]
    width = 1.0 + len(configs) * (1.2 + max(2.4, 0.9 * len(summary.lengths)))
    fig, axes = plt.subplots(1, len(configs), figsize=(width, 2.2 + 0.4 * len(depths)), dpi=110, squeeze=False,
                             layout="constrained")
    image = None
    for ax, c in zip(axes[0], configs, strict=True):
        grid = [[summary.depth.get((c, d, n), float("nan")) for n in summary.lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(summary.lengths)))
        ax.set_xticklabels([length_label(n) for n in summary.lengths])
        ax.set_yticks(range(len(depths)))
        ax.set_yticklabels([f"{d}%" for d in depths])
        ax.set_xlabel("context length")
        ax.set_ylabel("needle depth")
        ax.set_title(c)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:  # not NaN
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=list(axes[0]), shrink=0.9, label="score")
    fig.suptitle("Score by needle depth and length")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def config_order(out_dir: Path) -> list[str]:
    """The configurations in the order the commands of runs.json named them (their --budgets)."""
    try:
        runs = json.loads((Path(out_dir) / "runs.json").read_text("utf-8"))
    except (OSError, ValueError):
        return []
    labels = [c for run in runs if isinstance(run, dict) for c in run.get("configs") or []]
    return list(dict.fromkeys(labels))


def record_run(out_dir: Path, entry: dict) -> None:
    """Append one command's description (argv, plan, configuration labels) to OUT/runs.json."""
    path = Path(out_dir) / "runs.json"
    runs = []
    if path.exists():
        try:
            runs = json.loads(path.read_text("utf-8"))
        except json.JSONDecodeError:
            runs = []
    runs.append(entry)
    path.write_text(json.dumps(runs, indent=2) + "\n", encoding="utf-8")


def render(out_dir: Path, order: list[str] | None = None) -> tuple[Summary, list[Path]]:
    """Re-read OUT/results.jsonl and (re)write summary.md, summary.json and both PNGs (with matplotlib).

    `order` lists configurations first; by default the order runs.json recorded for the commands.
    """
    out_dir = Path(out_dir)
    summary = summarize(load_records(out_dir), order if order is not None else config_order(out_dir))
    md = out_dir / SUMMARY_MD
    md.write_text(markdown(summary), encoding="utf-8")
    js = out_dir / SUMMARY_JSON
    js.write_text(json.dumps(to_json(summary), indent=2) + "\n", encoding="utf-8")
    files = [md, js]
    if plots.available():  # without the plots extra: the tables only (the CLI says the PNGs were skipped)
        files += [plot_accuracy(summary, out_dir / ACCURACY_PNG), plot_heatmap(summary, out_dir / HEATMAP_PNG)]
    return summary, files
