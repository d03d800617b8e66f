#!/usr/bin/env python3
"""A tiered session saved and restored against reading it again (issue 27), as a user of llama-server sees it.

One tiered llama-server (budget = context / 8, `--slot-save-path`); per repeat: a cold prefill of the history
(the slot erased first: what a restart costs without a saved session), the slot saved to disk, erased and
restored, then the follow-up question: the time to its first token after the restore and how many prompt tokens
the server read for it. `--drop-caches` (root) empties the page cache before each restore, so
the file is read from the disk and not from memory.

    python benchmarks/bench_sessions.py                                   # SmolLM2, 8K
    python benchmarks/bench_sessions.py --model qwen2.5-coder:0.5b --tokens 32000 --repeats 3 --drop-caches

Prints a table and writes JSON (default: bench_sessions.json in the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kvmem_llama.engine import require_engine
from kvmem_llama.models import resolve_model
from kvmem_llama.serving.process import start_llama_server

QUESTION = "\n\nQuestion: in which chapter did the bridge meet the forest? Answer:"


def history_text(n_sentences: int) -> str:
    rng = random.Random(n_sentences)
    words = "river stone light window garden music paper engine winter market bridge forest signal".split()
    return " ".join(f"In chapter {i} the {rng.choice(words)} met the {rng.choice(words)} near the "
                    f"{rng.choice(words)}." for i in range(n_sentences))


def post(url: str, path: str, body: dict, **params) -> dict:
    resp = httpx.post(f"{url}{path}", params=params, json=body, timeout=3600)
    if resp.status_code != 200:
        raise SystemExit(f"{path} {params}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def history_tokens(url: str, n_tokens: int) -> list[int]:
    n = n_tokens // 14 + 10
    while True:
        tokens = post(url, "/tokenize", {"content": history_text(n), "add_special": True})["tokens"]
        if len(tokens) >= n_tokens:
            return tokens[:n_tokens]
        n = int(n * 1.2) + 10


def complete(url: str, prompt: list[int]) -> dict:
    return post(url, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True})


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_repeat(url: str, history: list[int], question: list[int], dropping: bool) -> dict:
    post(url, "/slots/0", {}, action="erase")
    cold = complete(url, history)
    saved = post(url, "/slots/0", {"filename": "bench.bin"}, action="save")
    post(url, "/slots/0", {}, action="erase")
    dropped = drop_caches() if dropping else False
    restored = post(url, "/slots/0", {"filename": "bench.bin"}, action="restore")
    resumed = complete(url, history + question)
    mib = saved["n_written"] / 2**20
    return {
        "prefill_s": cold["timings"]["prompt_ms"] / 1000,
        "save_s": saved["timings"]["save_ms"] / 1000,
        "restore_s": restored["timings"]["restore_ms"] / 1000,
        "file_mib": round(mib, 1),
        "write_mb_s": round(saved["n_written"] / 1e6 / (saved["timings"]["save_ms"] / 1000), 1),
        "read_mb_s": round(restored["n_read"] / 1e6 / (restored["timings"]["restore_ms"] / 1000), 1),
        "page_cache_dropped": dropped,
        "resumed_prompt_n": resumed["timings"]["prompt_n"],
        "resumed_first_token_s": (resumed["timings"]["prompt_ms"] + resumed["timings"]["predicted_ms"]) / 1000,
        "prefill_prompt_n": cold["timings"]["prompt_n"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="catalog name or GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=7000, help="history length in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each restore (root)")
    ap.add_argument("--json", type=Path, default=Path("bench_sessions.json"))
    args = ap.parse_args()

    engine = require_engine("cpu")
    model = resolve_model(args.model, pull=False).path
    ctx = args.tokens + 512
    budget = max(640, ctx // 8 // 128 * 128)
    flags = ["-c", str(ctx), "-np", "1", "-t", str(args.threads), "-b", "2048", "-ub", "512",
             "--kvmem-budget", str(budget)]
    console = Console(width=200)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-sessions-") as tmp:
        log = Path(tmp) / "server.log"
        with start_llama_server(engine.server, model, [*flags, "--slot-save-path", tmp], log, timeout=600) as srv:
            history = history_tokens(srv.url, args.tokens)
            question = post(srv.url, "/tokenize", {"content": QUESTION})["tokens"]
            for r in range(args.repeats):
                with console.status(f"repeat {r + 1}/{args.repeats}: {len(history):,} tokens ..."):
                    rows.append(one_repeat(srv.url, history, question, args.drop_caches))

    def mm(key: str) -> str:
        values = [row[key] for row in rows]
        return f"{min(values):.2f} / {statistics.median(values):.2f}"

    table = Table(title=f"tiered session restore vs re-read: {model.name}, {len(history):,} tokens, budget {budget}, "
                        f"{args.threads} threads, {args.repeats} repeats (min / median)")
    for col in ("prefill s (tokens)", "save s", "restore s", "file MiB", "write MB/s", "read MB/s",
                "follow-up after restore: first token s (tokens read)"):
        table.add_column(col, justify="right")
    table.add_row(f"{mm('prefill_s')} ({rows[0]['prefill_prompt_n']:,})", mm("save_s"), mm("restore_s"),
                  f"{rows[0]['file_mib']:,.1f}", mm("write_mb_s"), mm("read_mb_s"),
                  f"{mm('resumed_first_token_s')} ({rows[0]['resumed_prompt_n']})")
    console.print(table)
    out = {"model": str(model), "tokens": len(history), "budget": budget, "flags": flags, "engine": engine.key,
           "cpu": platform.processor() or platform.machine(), "threads": args.threads, "repeats": rows,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.json.write_text(json.dumps(out, indent=2))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
