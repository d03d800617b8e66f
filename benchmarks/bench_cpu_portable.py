#!/usr/bin/env python3
"""CPU speed of a portable engine (ggml's runtime CPU dispatch) against another engine, e.g. a native one.

Each engine's llama-bench runs the same model `--repeats` times, alternating engines, one repetition per
run (`-r 1`), so both see the same machine state; the table gives min / median tok/s of prompt processing
(pp) and generation (tg) per engine and the ratio of medians.

    kvmem engines                                 # keys; an engine built before issue 22 is a native one
    python benchmarks/bench_cpu_portable.py --baseline KEY [--engine KEY] [--threads 2] [--repeats 3]

Prints a table and writes JSON (default: bench_cpu_portable.json in the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmem_llama import cpu_backend
from kvmem_llama.default_model import default_model_path
from kvmem_llama.engine import Engine, lookup_engine, require_engine


def bench_once(engine: Engine, model: Path, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    cmd = [str(engine.binary("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{engine.key}: llama-bench failed ({out.returncode}):\n{out.stderr[-2000:]}")
    rates = {}
    for row in json.loads(out.stdout):
        kind = "pp" if row["n_prompt"] > 0 and row["n_gen"] == 0 else "tg"
        rates[kind] = float(row["avg_ts"])
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="engine key (or prefix) to compare against")
    ap.add_argument("--engine", help="engine key (default: the current CPU engine)")
    ap.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--json", type=Path, default=Path("bench_cpu_portable.json"))
    args = ap.parse_args()

    ours = lookup_engine(args.engine) if args.engine else require_engine("cpu")
    base = lookup_engine(args.baseline)
    model = args.model or default_model_path()
    engines = {"portable": ours, "baseline": base}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            runs[name].append(bench_once(engine, model, args.threads, args.prompt, args.gen))

    cells = {}
    for name, engine in engines.items():
        cells[name] = {"engine": engine.key, "cpu_variant": cpu_backend.choose_variant(engine.path).chosen}
        for kind in ("pp", "tg"):
            values = [r[kind] for r in runs[name]]
            cells[name][kind] = {"min": min(values), "median": statistics.median(values), "runs": values}
    table = Table(title=f"{model.name}, {args.threads} threads, pp{args.prompt} / tg{args.gen}, {args.repeats} runs")
    for column in ("engine", "CPU variant", "pp tok/s min", "pp median", "tg tok/s min", "tg median"):
        table.add_column(column)
    for name, cell in cells.items():
        table.add_row(f"{name} {cell['engine'][:24]}", cell["cpu_variant"] or "built in",
                      f"{cell['pp']['min']:.1f}", f"{cell['pp']['median']:.1f}",
                      f"{cell['tg']['min']:.1f}", f"{cell['tg']['median']:.1f}")
    console = Console()
    console.print(table)
    ratio = {kind: cells["portable"][kind]["median"] / cells["baseline"][kind]["median"] for kind in ("pp", "tg")}
    console.print(f"portable / baseline (medians): pp {ratio['pp']:.3f}, tg {ratio['tg']:.3f}")
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "model": model.name, "threads": args.threads, "repeats": args.repeats, "prompt": args.prompt,
              "gen": args.gen, "cells": cells, "ratio_of_medians": ratio}
    args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
