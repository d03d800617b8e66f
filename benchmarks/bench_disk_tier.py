#!/usr/bin/env python3
"""N conversations through a host KV pool that holds about one (issue 27): with the disk tier, without it.

One tiered llama-server with N slots (`-np N --kv-unified`), its host pool capped (`--kvmem-host-mib`) to about
one conversation; each slot reads its own document and answers, one after the other, then each asks a follow-up.
Without a disk tier the server purges an idle slot when the pool is full, so a follow-up reads its document again;
with `--kvmem-disk-path` the idle slots' blocks wait on disk and come back. Per configuration: the server's host
memory (RSS, and its anonymous + shared part, where the pool is) after every conversation, the disk the tier
holds, and for each follow-up the prompt tokens it read and its time to first token.

    python benchmarks/bench_disk_tier.py                         # SmolLM2, 4 conversations of ~2,800 tokens

Prints a table and writes JSON (default: bench_disk_tier.json in the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from kvmem_llama.engine import require_engine
from kvmem_llama.models import resolve_model
from kvmem_llama.serving.process import start_llama_server


def document(seed: int, n_sentences: int) -> str:
    rng = random.Random(seed)
    words = "river stone light window garden music paper engine winter market bridge forest signal".split()
    sentences = [f"In chapter {i} the {rng.choice(words)} met the {rng.choice(words)} near the {rng.choice(words)}."
                 for i in range(n_sentences)]
    sentences.insert(n_sentences // 3, f"The code word of document {seed} is ORCHID-{seed * 37 % 100}.")
    return " ".join(sentences)


def complete(url: str, prompt: str, slot: int) -> dict:
    resp = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0, "top_k": 1,
                                                 "cache_prompt": True, "id_slot": slot}, timeout=3600)
    resp.raise_for_status()
    return resp.json()


def memory_mib(pid: int) -> tuple[float, float]:
    """RSS, and its anonymous + shared part (RssAnon + RssShmem: the pool, not the model file's pages), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {k: int(v) for k, v in re.findall(r"^(Rss\w+):\s+(\d+) kB", status, re.M)}
    rss = psutil.Process(pid).memory_info().rss / 2**20
    return rss, (kb.get("RssAnon", 0) + kb.get("RssShmem", 0)) / 1024


def run(server, model: Path, flags: list[str], n: int, sentences: int, log: Path) -> dict:
    with start_llama_server(server, model, flags, log, timeout=600) as srv:
        rows = []
        history = {}
        for slot in range(n):
            prompt = document(slot + 1, sentences) + " Question: what is the code word of this document? Answer:"
            reply = complete(srv.url, prompt, slot)
            history[slot] = prompt + reply["content"]
            metrics = {m[1]: float(m[2]) for m in re.finditer(r"^llamacpp:(kvmem_\w+) (\S+)$",
                                                                httpx.get(f"{srv.url}/metrics", timeout=30).text, re.M)}
            rss, anon = memory_mib(srv.pid)
            disk_mib = metrics.get("kvmem_disk_bytes", 0) / 2**20
            rows.append({"conversation": slot + 1, "read": reply["timings"]["prompt_n"], "rss_mib": round(rss, 1),
                         "anon_shmem_mib": round(anon, 1), "disk_mib": round(disk_mib, 1)})
        follow_ups = []
        for slot in range(n):
            t0 = time.monotonic()
            reply = complete(srv.url, history[slot] + " Question: and once more, the code word? Answer:", slot)
            wall = time.monotonic() - t0
            t = reply["timings"]
            follow_ups.append({"slot": slot, "read": t["prompt_n"], "first_token_s": round(
                (t["prompt_ms"] + t["predicted_ms"] / max(1, t["predicted_n"])) / 1000, 3), "wall_s": round(wall, 3)})
        text = srv.log_text()
    return {"flags": flags, "after_each": rows, "follow_ups": follow_ups, "purged": text.count("purging slot"),
            "moved_lines": [line for line in text.splitlines() if "kvmem_disk:" in line and "back from" in line]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="catalog name or GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--sentences", type=int, default=190, help="document length (190: ~2,800 SmolLM2 tokens)")
    ap.add_argument("--host-mib", type=int, default=72, help="--kvmem-host-mib (72: one SmolLM2 conversation)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, default=Path("bench_disk_tier.json"))
    args = ap.parse_args()

    engine = require_engine("cpu")
    model = resolve_model(args.model, pull=False).path
    n = args.conversations
    base = ["-c", str(4096 * n), "-np", str(n), "--kv-unified", "-t", str(args.threads), "-b", "512", "-ub", "512",
            "--kvmem-budget", "512", "--kvmem-block", "64", "--kvmem-sink", "64", "--kvmem-recent", "128",
            "--kvmem-host-mib", str(args.host_mib), "--metrics"]
    console = Console(width=200)
    out = {"model": str(model), "engine": engine.key, "conversations": n, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-disk-") as tmp:
        disk = Path(tmp) / "disk"
        disk.mkdir()
        configs = {"no disk tier": base,
                   "disk tier": [*base, "--kvmem-disk-path", str(disk), "--kvmem-disk-mib", str(args.host_mib * n)]}
        for name, flags in configs.items():
            with console.status(f"{name}: {n} conversations ..."):
                out[name] = run(engine.server, model, flags, n, args.sentences, Path(tmp) / f"{name}.log")
    table = Table(title=f"{n} conversations through a {args.host_mib} MiB host pool: {model.name}, {engine.key}, "
                        f"{args.threads} threads")
    for col in ("config", "RSS MiB after each (anon+shmem)", "disk MiB after each", "purged",
                "follow-ups: tokens read", "follow-up first token s (median)"):
        table.add_column(col, justify="right")
    for name in configs:
        r = out[name]
        table.add_row(name, ", ".join(f"{x['rss_mib']:.0f} ({x['anon_shmem_mib']:.0f})" for x in r["after_each"]),
                      ", ".join(f"{x['disk_mib']:.0f}" for x in r["after_each"]), str(r["purged"]),
                      ", ".join(str(x["read"]) for x in r["follow_ups"]),
                      f"{statistics.median(x['first_token_s'] for x in r['follow_ups']):.2f}")
    console.print(table)
    for line in out["disk tier"]["moved_lines"]:
        console.print(f"[dim]{line.strip()}[/]")
    args.json.write_text(json.dumps(out, indent=2))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
