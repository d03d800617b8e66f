#!/usr/bin/env python3
"""A tiered session saved and restored against reading it again (issue 27), as a user of llama-server sees it.

One tiered llama-server (budget = context / 8, `--slot-save-path`); per repeat: a cold prefill of the history
(the slot erased first: what a restart costs without a saved session), the slot saved to disk, erased and
restored, then the follow-up question: the time to its first token after the restore and how many prompt tokens
the server read for it. `--drop-caches` (root) empties the page cache before each restore, so
the file is read from the disk and not from memory.

`--restart` measures a restart instead, with one prefill (at 261K tokens a prefill takes minutes): the history is
read once and saved; the never-stopped server answers the follow-up (`--gen` greedy tokens); the server is killed
(SIGKILL) and started again; then per repeat the slot is restored (page cache emptied first with `--drop-caches`)
and answers the follow-up, whose tokens must be those of the never-stopped server.

    python benchmarks/bench_sessions.py                                   # SmolLM2, 8K
    python benchmarks/bench_sessions.py --model qwen2.5-coder:0.5b --tokens 32000 --repeats 3 --drop-caches
    python benchmarks/bench_sessions.py --engine cuda-sm90 --model /tmp/qwen35-27b.gguf --tokens 261400 \
        --ctx 262144 --budget 32768 --server-args "-ngl 99 -fa on -b 2048 -ub 2048" --restart --drop-caches

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


def complete(url: str, prompt: list[int], n_predict: int = 1) -> dict:
    return post(url, "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1,
                                     "cache_prompt": True, "return_tokens": True})


def answer_tokens(reply: dict) -> list[int]:
    return list(reply.get("tokens") or [])


def first_token_s(reply: dict) -> float:
    """The time to the reply's first token: reading its prompt (with the turn's selection), then one token."""
    t = reply["timings"]
    return (t["prompt_ms"] + t["predicted_ms"] / max(1, t["predicted_n"])) / 1000


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


def restore_once(url: str, history: list[int], question: list[int], n_gen: int, dropping: bool) -> dict:
    post(url, "/slots/0", {}, action="erase")
    dropped = drop_caches() if dropping else False
    restored = post(url, "/slots/0", {"filename": "bench.bin"}, action="restore")
    resumed = complete(url, history + question, n_gen)
    return {
        "restore_s": restored["timings"]["restore_ms"] / 1000,
        "read_mb_s": round(restored["n_read"] / 1e6 / (restored["timings"]["restore_ms"] / 1000), 1),
        "page_cache_dropped": dropped,
        "resumed_prompt_n": resumed["timings"]["prompt_n"],
        "resumed_first_token_s": first_token_s(resumed),
        "resume_s": restored["timings"]["restore_ms"] / 1000 + first_token_s(resumed),
        "tokens": answer_tokens(resumed),
    }


def restart_run(start, n_tokens: int, repeats: int, n_gen: int, dropping: bool, console: Console) -> dict:
    """One prefill and save, the never-stopped follow-up, SIGKILL, a new server, `repeats` restores."""
    srv = start()
    try:
        history = history_tokens(srv.url, n_tokens)
        question = post(srv.url, "/tokenize", {"content": QUESTION})["tokens"]
        with console.status(f"reading {len(history):,} tokens ..."):
            cold = complete(srv.url, history)
        saved = post(srv.url, "/slots/0", {"filename": "bench.bin"}, action="save")
        reference = complete(srv.url, history + question, n_gen)
        srv.process.kill()  # a crash: nothing is saved on the way out
        srv.process.wait()
    finally:
        srv.stop()
    t0 = time.monotonic()
    srv = start()
    try:
        ready_s = time.monotonic() - t0
        rows = []
        for r in range(repeats):
            with console.status(f"restore {r + 1}/{repeats} ..."):
                rows.append(restore_once(srv.url, history, question, n_gen, dropping))
    finally:
        srv.stop()
    for row in rows:
        row["same_tokens"] = row.pop("tokens") == answer_tokens(reference)
    return {
        "history_tokens": len(history), "prefill_s": cold["timings"]["prompt_ms"] / 1000,
        "save_s": saved["timings"]["save_ms"] / 1000, "file_mib": round(saved["n_written"] / 2**20, 1),
        "write_mb_s": round(saved["n_written"] / 1e6 / (saved["timings"]["save_ms"] / 1000), 1),
        "never_stopped_first_token_s": first_token_s(reference), "never_stopped_prompt_n":
        reference["timings"]["prompt_n"], "reference_tokens": answer_tokens(reference), "server_ready_s": ready_s,
        "restores": rows,
    }


def print_restart(console: Console, title: str, run: dict) -> None:
    rows = run["restores"]

    def mm(key: str) -> str:
        values = [row[key] for row in rows]
        return f"{min(values):.2f} / {statistics.median(values):.2f}"

    table = Table(title=title)
    for col in ("prefill s", "save s (MB/s)", "file MiB", "restart: server ready s", "restore s", "read MB/s",
                "follow-up first token s (tokens read)", "restore + first token s", "same tokens",
                "never-stopped first token s"):
        table.add_column(col, justify="right")
    same = sum(row["same_tokens"] for row in rows)
    table.add_row(f"{run['prefill_s']:.1f}", f"{run['save_s']:.2f} ({run['write_mb_s']:,.0f})",
                  f"{run['file_mib']:,.1f}", f"{run['server_ready_s']:.1f}", mm("restore_s"), mm("read_mb_s"),
                  f"{mm('resumed_first_token_s')} ({rows[0]['resumed_prompt_n']})", mm("resume_s"),
                  f"{same}/{len(rows)}", f"{run['never_stopped_first_token_s']:.2f}")
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="catalog name or GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=7000, help="history length in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each restore (root)")
    ap.add_argument("--engine", default="cpu", help="engine key (cpu, cuda-sm90, ...)")
    ap.add_argument("--ctx", type=int, default=0, help="context (default: tokens + 512)")
    ap.add_argument("--budget", type=int, default=0, help="--kvmem-budget (default: context / 8)")
    ap.add_argument("--server-args", default="", help="llama-server flags instead of -t/-b/-ub (e.g. -ngl 99 -fa on)")
    ap.add_argument("--restart", action="store_true", help="one prefill; restores after a SIGKILL and a restart")
    ap.add_argument("--gen", type=int, default=16, help="--restart: greedy tokens of the follow-up to compare")
    ap.add_argument("--dir", type=Path, default=None, help="where the session file goes (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=Path("bench_sessions.json"))
    args = ap.parse_args()

    engine = require_engine(args.engine)
    model = resolve_model(args.model, pull=False).path
    ctx = args.ctx or args.tokens + 512
    budget = args.budget or max(640, ctx // 8 // 128 * 128)
    extra = args.server_args.split() or ["-t", str(args.threads), "-b", "2048", "-ub", "512"]
    flags = ["-c", str(ctx), "-np", "1", *extra, "--kvmem-budget", str(budget)]
    console = Console(width=200)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-sessions-", dir=args.dir) as tmp:
        log = Path(tmp) / "server.log"
        if args.restart:
            def start():
                return start_llama_server(engine.server, model, [*flags, "--slot-save-path", tmp], log, timeout=900)

            run = restart_run(start, args.tokens, args.repeats, args.gen, args.drop_caches, console)
            print_restart(console, f"tiered session after a restart: {model.name}, {run['history_tokens']:,} tokens, "
                          f"budget {budget}, {engine.key}, {args.repeats} restores (min / median)", run)
            out = {"model": str(model), "budget": budget, "flags": flags, "engine": engine.key, **run,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            args.json.write_text(json.dumps(out, indent=2))
            console.print(f"wrote {args.json}")
            return
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
