#!/usr/bin/env python3
"""CPU benchmark of KV tiering: tiering off vs on at several prompt lengths (issue 3).

For each length and mode, one context runs two turns through the cffi binding:
  turn 1: the long prompt (prefill), then `--gen` greedy tokens (decode);
  turn 2: a short follow-up question on the same sequence, which triggers a selection.
Reported: prompt tok/s, decode tok/s, and for tiering on the per-turn selection + stage-in ms
(the engine's own `last_select_ms`, i.e. scoring + host->working-set copies) with block counts.

    python benchmarks/bench_cpu_tiering.py                       # 2K/4K/8K, budget = 1/8 of the prompt
    python benchmarks/bench_cpu_tiering.py --sizes 2048 --json out.json

Prints a table and writes JSON (default: bench_cpu_tiering.json in the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmem_llama.binding import KvmemConfig, Llama
from kvmem_llama.default_model import default_model_path
from kvmem_llama.engine import require_engine

BLOCK = 64


def essay(rng: random.Random, n_sentences: int) -> str:
    words = "river stone light window garden music paper engine winter market bridge forest signal".split()
    return " ".join(
        f"In chapter {i} the {rng.choice(words)} met the {rng.choice(words)} near the {rng.choice(words)}."
        for i in range(n_sentences)
    )


def prompt_tokens(llm: Llama, n_tokens: int) -> list[int]:
    rng = random.Random(n_tokens)
    text = essay(rng, n_tokens // 10 + 50)
    tokens = llm.tokenize(text)
    while len(tokens) < n_tokens:
        text += " " + essay(rng, 50)
        tokens = llm.tokenize(text)
    return tokens[:n_tokens]


def run_one(model: Path, libllama: Path, n_prompt: int, budget: int, n_gen: int, threads: int) -> dict:
    kvmem = None
    if budget:
        kvmem = KvmemConfig(budget=budget, block=BLOCK, sink=BLOCK, recent=2 * BLOCK, gen_reserve=2 * BLOCK)
    n_ctx = n_prompt + 512
    with Llama.load(model, n_ctx=n_ctx, n_batch=2048, n_threads=threads, libllama=libllama, kvmem=kvmem) as llm:
        tokens = prompt_tokens(llm, n_prompt)
        follow_up = llm.tokenize("\nQuestion: which chapter mentions the bridge and the forest? Answer:",
                                 add_special=False)
        turn1 = llm.generate(tokens, max_tokens=n_gen)
        stats1 = llm.kvmem_stats()
        t0 = time.perf_counter()
        turn2 = llm.generate(follow_up, max_tokens=n_gen)
        turn2_ms = (time.perf_counter() - t0) * 1000
        stats2 = llm.kvmem_stats()
    row = {
        "prompt_tokens": n_prompt,
        "tiering": bool(budget),
        "budget": budget,
        "prompt_tok_s": round(n_prompt / (turn1.prompt_ms / 1000), 2),
        "decode_tok_s": round(turn1.decode_tps, 2),
        "turn2_prompt_tokens": len(follow_up),
        "turn2_prompt_ms": round(turn2.prompt_ms, 2),
        "turn2_decode_tok_s": round(turn2.decode_tps, 2),
        "turn2_total_ms": round(turn2_ms, 2),
    }
    if budget:
        row.update({
            "select_ms_turn1": round(stats1.last_select_ms, 3),
            "select_ms_turn2": round(stats2.last_select_ms, 3),
            "selections": stats2.selections,
            "blocks_host": stats2.blocks_host,
            "blocks_gpu": stats2.blocks_gpu,
            "staged_in": stats2.staged_in,
            "evicted": stats2.evicted,
            "host_mib": round(stats2.host_bytes / 2**20, 1),
        })
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192], help="prompt lengths in tokens")
    ap.add_argument("--budget-fraction", type=float, default=1 / 8, help="tiering budget as a fraction of the prompt")
    ap.add_argument("--min-budget", type=int, default=5 * BLOCK, help="smallest budget (sink+recent+2 blocks)")
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", type=Path, default=Path("bench_cpu_tiering.json"))
    args = ap.parse_args()

    engine = require_engine("cpu")
    model = args.model or default_model_path()
    console = Console()
    rows = []
    for n in args.sizes:
        budget = max(args.min_budget, int(n * args.budget_fraction) // BLOCK * BLOCK)
        for b in (0, budget):
            with console.status(f"{n} tokens, tiering {'on (budget ' + str(b) + ')' if b else 'off'} ..."):
                rows.append(run_one(model, engine.libllama, n, b, args.gen, args.threads))

    table = Table(title=f"KV tiering on CPU — {model.name}, {args.threads} threads")
    for col in ("prompt", "tiering", "prompt tok/s", "decode tok/s", "turn-2 select ms", "turn-1 select ms",
                "blocks host/gpu", "staged in", "evicted"):
        table.add_column(col, justify="right")
    for r in rows:
        on = r["tiering"]
        table.add_row(
            str(r["prompt_tokens"]), f"on ({r['budget']})" if on else "off", f"{r['prompt_tok_s']:.1f}",
            f"{r['decode_tok_s']:.1f}", f"{r['select_ms_turn2']:.2f}" if on else "-",
            f"{r['select_ms_turn1']:.2f}" if on else "-",
            f"{r['blocks_host']}/{r['blocks_gpu']}" if on else "-", str(r["staged_in"]) if on else "-",
            str(r["evicted"]) if on else "-",
        )
    console.print(table)
    result = {
        "engine": engine.info if isinstance(engine.info, dict) else str(engine.info),
        "model": str(model),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "block_tokens": BLOCK,
        "rows": rows,
    }
    args.json.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
