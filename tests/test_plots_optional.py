"""matplotlib is the `plots` extra: `kvmem eval report` and `kvmem bench report` write their tables
without it and say in one line that the PNGs were skipped and how to get them; with it, the PNGs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from kvmem_llama import plots
from kvmem_llama.bench import BenchResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HINT = "pip install 'kvmem-llama[plots]'"


def kvmem(*args: str, matplotlib: bool) -> subprocess.CompletedProcess:
    """The real CLI; matplotlib=False makes `import matplotlib` fail as it does where it is not installed."""
    block = "sys.modules['matplotlib'] = None; " if not matplotlib else ""
    code = (f"import sys; {block}sys.argv = ['kvmem', *sys.argv[1:]]; "
            "from kvmem_llama.cli.main import main; main()")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def eval_results(folder: Path) -> Path:
    folder.mkdir()
    records = [{"task": "niah_single_noise", "length": n, "depth": d, "sample": 0, "seed": 0, "config": "off",
                "expected": ["x"], "got": "x", "score": 100.0 if d < 90 else 0.0, "latency_s": 1.0}
               for n in (1024, 2048) for d in (10, 50, 90)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return folder


def bench_results(folder: Path) -> Path:
    folder.mkdir()
    rows = [BenchResult(config, 4096, 4000, 900.0, speed, 800.0, None, 96.0, 300.0, repeat=0, decode_tokens=64)
            for config, speed in (("upstream", 20.0), ("ours", 25.0))]
    (folder / "results.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows), encoding="utf-8")
    return folder


def test_eval_report_without_matplotlib_writes_the_tables_and_says_so(tmp_path: Path) -> None:
    out = eval_results(tmp_path / "eval")
    proc = kvmem("eval", "report", str(out), matplotlib=False)
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.md").read_text("utf-8").count("| off |") >= 1 and (out / "summary.json").exists()
    assert not list(out.glob("*.png"))
    assert "accuracy_vs_length.png and depth_heatmap.png skipped: matplotlib is not installed" in proc.stdout
    assert HINT in proc.stdout


def test_bench_report_without_matplotlib_writes_the_tables_and_says_so(tmp_path: Path) -> None:
    out = bench_results(tmp_path / "bench")
    proc = kvmem("bench", "report", "--out", str(out), matplotlib=False)
    assert proc.returncode == 0, proc.stderr
    assert "| ours | 4,096 | 1 |" in (out / "results.md").read_text("utf-8")
    assert not (out / "decode_vs_context.png").exists()
    assert f"decode_vs_context.png skipped: matplotlib is not installed ({HINT})" in proc.stdout


@pytest.mark.skipif(not plots.available(), reason=f"matplotlib is not installed: {HINT}")
def test_reports_with_matplotlib_draw_the_pngs_and_print_no_hint(tmp_path: Path) -> None:
    out = eval_results(tmp_path / "eval")
    proc = kvmem("eval", "report", str(out), matplotlib=True)
    assert proc.returncode == 0, proc.stderr
    for name in ("accuracy_vs_length.png", "depth_heatmap.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    bench = bench_results(tmp_path / "bench")
    proc2 = kvmem("bench", "report", "--out", str(bench), matplotlib=True)
    assert proc2.returncode == 0, proc2.stderr
    assert (bench / "decode_vs_context.png").read_bytes()[:8] == PNG_MAGIC
    assert HINT not in proc.stdout + proc2.stdout
