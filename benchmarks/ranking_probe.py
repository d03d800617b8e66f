#!/usr/bin/env python3
"""Where does each way of scoring a block put the needle among its decoys? (issue 25: ranking). CPU, SmolLM2-135M.

The fidelity probe (benchmarks/fidelity_probe.py) found that with the needle's block resident the working set
answers as well as every block does: what is lost is retrieval. This probe asks which scores would retrieve it.
For each `niah_decoy8` sample the tiered engine (--kvmem-trace) gives the turn's candidate blocks and its own
attention order; a numpy copy of the model (benchmarks/numpy_llama.py) prefills the prompt as the engine does
(windowed ubatches) and keeps every layer's keys and the question's query rows (the prompt's last 128 tokens).
Then each method scores every block before the question and ranks the engine's candidates:

  engine      the engine's own attention order (the trace)
  mass-cN     the engine's `mass` on N-token chunk means of the pre-RoPE keys (N = 16 is the engine's): per
              (layer, head, query row) a softmax over the blocks of each block's best chunk logit, squared, summed
  exact       real attention: per (layer, head, row) the softmax over every token before the question (post-RoPE,
              as cached); a block's share is the sum over its tokens; squared, summed
  exact-sum   the same shares summed without squaring
  exact-lastN the exact shares of the question's last N rows only
  mass-c16-lastN, exact-pre-lastN   the engine's `mass` with the last N rows; `exact-lastN` without RoPE (keys and
              rows as the engine's summaries are made)
  full        (a ceiling, not an engine method; with --prefill windowed) `exact` with the keys and question rows
              of a full prefill: what the question's rows attend to when every token was seen
  answer      (a ceiling) `exact` over the full prefill's keys for the rows of the teacher-forced answer "The special
              magic number for KEY mentioned in the provided text is" that lead to the value: what the model
              attends to when it writes the value

Per method: the needle's place among the candidates (1 = first), whether it is in the top k (k = the picks the
engine had at that budget), and how many decoy blocks rank above it. Prints a table (Wilson intervals) and writes
one JSON line per sample.

    python benchmarks/ranking_probe.py --length 4000 --budget 1024 --samples 6 --out /tmp/ranking
    python benchmarks/ranking_probe.py --report /tmp/ranking/rows.jsonl
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_probe import (  # noqa: E402
    BLOCK,
    QUESTION,
    RESERVE,
    UBATCH,
    answer_lead,
    each_sample,
    question_key,
    read_rows,
    sample_arguments,
    tokenize,
)
from numpy_llama import Llama  # noqa: E402

from kvmem_llama import kvmem_log  # noqa: E402
from kvmem_llama.engine import require_engine  # noqa: E402
from kvmem_llama.evaluation.client import EvalClient  # noqa: E402
from kvmem_llama.evaluation.stats import wilson  # noqa: E402
from kvmem_llama.models import resolve_model  # noqa: E402
from kvmem_llama.serving.process import start_llama_server  # noqa: E402

CHUNKS = (16, 4, 1)
LAST_ROWS = (8, 32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = x.max(axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis, keepdims=True)


def mass(lm: Llama, keys: list[np.ndarray], queries: list[np.ndarray], n_blocks: int, chunk: int) -> np.ndarray:
    """The engine's `mass` over `chunk`-token chunk means of pre-RoPE keys [T, kv, hd] and query rows [R, H, hd]."""
    g = lm.n_head // lm.n_kv
    out = np.zeros(n_blocks)
    for k, q in zip(keys, queries, strict=True):
        means = k[:n_blocks * BLOCK].reshape(n_blocks * BLOCK // chunk, chunk, lm.n_kv, lm.hd).mean(1)
        for kv in range(lm.n_kv):
            qs = q[:, kv * g:(kv + 1) * g].reshape(-1, lm.hd)  # [R*g, hd]
            logits = (qs @ means[:, kv].T / np.sqrt(lm.hd)).reshape(len(qs), n_blocks, -1).max(-1)
            out += (softmax(logits) ** 2).sum(0)
    return out


def shares(lm: Llama, keys: list[np.ndarray], queries: list[np.ndarray], n_blocks: int) -> np.ndarray:
    """Real attention's share of each block: [layer, query head, row, block] over every token before the question."""
    g = lm.n_head // lm.n_kv
    n = n_blocks * BLOCK
    out = np.zeros((len(keys), lm.n_head, len(queries[0]), n_blocks))
    for il, (k, q) in enumerate(zip(keys, queries, strict=True)):
        for h in range(lm.n_head):
            p = softmax(q[:, h] @ k[:n, h // g].T / np.sqrt(lm.hd))  # [R, n]
            out[il, h] = p.reshape(len(p), n_blocks, BLOCK).sum(-1)
    return out


def squared(sh: np.ndarray) -> np.ndarray:
    """Per block, the squares of its shares summed over (layer, head, row), as `mass` sums them."""
    return (sh ** 2).sum((0, 1, 2))


def places(scores: np.ndarray, candidates: list[int], needle: int, decoys: set[int]) -> dict:
    order = sorted(candidates, key=lambda b: -scores[b])
    return place_in(order, needle, decoys)


def place_in(order: list[int], needle: int, decoys: set[int]) -> dict:
    i = order.index(needle)
    return {"place": i + 1, "decoys_above": sum(b in decoys for b in order[:i])}


def key_blocks(url: str, prompt_text: str, key: str, value: str) -> tuple[int, set[int]]:
    """The needle's block and the blocks of the decoy sentences (the key named without the value)."""
    needle_at = prompt_text.index(value)
    needle = len(tokenize(url, prompt_text[:needle_at])) // BLOCK
    question_at = prompt_text.rindex("What is the special magic number")
    decoys = set()
    for m in re.finditer(re.escape(key), prompt_text[:question_at]):
        if not 0 <= needle_at - m.start() < 200:
            decoys.add(len(tokenize(url, prompt_text[:m.start()])) // BLOCK)
    return needle, decoys - {needle}


def probe_sample(lm: Llama, on, on_client: EvalClient, s, budget: int, windowed: bool) -> dict:
    value = s.expected[0]
    key = question_key(s.prompt)
    prompt_text = on_client.apply_template([{"role": "user", "content": s.prompt}])
    tokens = np.array(tokenize(on.url, prompt_text))
    with_lead = np.array(tokenize(on.url, prompt_text + answer_lead(key)))
    needle, decoys = key_blocks(on.url, prompt_text, key, value)

    before = len(on.log_text())
    answer = on_client.chat(s.prompt, 24).text
    log = on.log_text()[before:]
    ranked = [e for e in kvmem_log.rankings(log) if e["reason"] == "turn"]
    turns = [e for e in kvmem_log.residents(log) if e["reason"] == "turn"]
    if not ranked or not turns:
        raise SystemExit("the tiered server logged no turn selection: is the prompt longer than the budget?")
    candidates = ranked[-1]["attention"]
    resident = set(turns[-1]["blocks"])
    picks = len([b for b in candidates if b in resident])
    row = {"index": s.index, "depth": s.depth, "tokens": len(tokens), "value": value, "answer": answer,
           "needle_block": needle, "decoy_blocks": sorted(decoys), "candidates": len(candidates), "picks": picks,
           "needle_resident": needle in resident, "needle_candidate": needle in candidates}
    if needle not in candidates:  # in the sink or the recent window: resident whatever the scores say
        return row

    start = time.time()
    t0 = len(tokens) - QUESTION
    full_queries: list[np.ndarray] = []
    _, full_keys, _ = lm.full(with_lead, queries=full_queries)
    if windowed:  # as the engine prefills: the keys and question rows it scores with
        queries: list[np.ndarray] = []
        _, keys, _ = lm.full(tokens, window=budget + RESERVE - UBATCH - BLOCK, sink=BLOCK, block=BLOCK,
                             queries=queries)
        queries = [q[t0:] for q in queries]
    else:
        keys, queries = full_keys, [q[t0:len(tokens)] for q in full_queries]
    rows_pos = np.arange(t0, len(tokens))
    n_blocks = t0 // BLOCK
    key_pos = np.arange(n_blocks * BLOCK)
    raw_keys = [lm.rope(k[:n_blocks * BLOCK], -key_pos) for k in keys]
    raw_queries = [lm.rope(q, -rows_pos) for q in queries]
    methods = {"engine": place_in(candidates, needle, decoys)}
    for chunk in CHUNKS:
        methods[f"mass-c{chunk}"] = places(mass(lm, raw_keys, raw_queries, n_blocks, chunk), candidates, needle,
                                           decoys)
    sh = shares(lm, keys, queries, n_blocks)
    methods["exact"] = places(squared(sh), candidates, needle, decoys)
    methods["exact-sum"] = places(sh.sum((0, 1, 2)), candidates, needle, decoys)
    for n in LAST_ROWS:
        methods[f"exact-last{n}"] = places(squared(sh[:, :, -n:]), candidates, needle, decoys)
    # what the last rows' gain comes from: the engine's chunk means with those rows, and exact without positions
    n = LAST_ROWS[0]
    methods[f"mass-c16-last{n}"] = places(mass(lm, raw_keys, [q[-n:] for q in raw_queries], n_blocks, 16),
                                          candidates, needle, decoys)
    methods[f"exact-pre-last{n}"] = places(squared(shares(lm, raw_keys, [q[-n:] for q in raw_queries], n_blocks)),
                                           candidates, needle, decoys)
    if windowed:
        full_rows = [q[t0:len(tokens)] for q in full_queries]
        methods["full"] = places(squared(shares(lm, full_keys, full_rows, n_blocks)), candidates, needle, decoys)
    answer = shares(lm, full_keys, [q[len(tokens):] for q in full_queries], n_blocks)
    methods["answer"] = places(squared(answer), candidates, needle, decoys)
    # the (layer, head) pairs whose most attended block, on the row that writes the value, is the needle's / a decoy's
    top = answer[:, :, -1].argmax(-1)
    heads = {"needle": int((top == needle).sum()), "decoy": int(np.isin(top, list(decoys)).sum()),
             "all": int(top.size)}
    row.update(prefill="windowed" if windowed else "full", methods=methods, answer_heads=heads,
               numpy_s=round(time.time() - start, 1))
    return row


def report(rows: list[dict]) -> str:
    ranked = [r for r in rows if "methods" in r]
    names = list(ranked[0]["methods"]) if ranked else []
    lines = [f"{len(rows)} samples; the needle's block a candidate in {len(ranked)} (the others sat in the sink or "
             f"the recent window); resident after the engine's turn in {sum(r['needle_resident'] for r in rows)}; "
             f"right answers with tiering on {sum(r['value'] in r['answer'] for r in rows)}. Candidates "
             f"{min(r['candidates'] for r in rows)}-{max(r['candidates'] for r in rows)}, engine picks "
             f"{min(r['picks'] for r in rows)}-{max(r['picks'] for r in rows)}.", "",
             "| method | needle first | in the top k (the engine's picks) | in the top 2k | mean place | "
             "decoys above it (mean) |", "|---|---|---|---|---:|---:|"]

    def cell(flags: list[bool]) -> str:
        n, k = len(flags), sum(flags)
        lo, hi = wilson(k / n, n)
        return f"{k}/{n} [{100 * lo:.0f}, {100 * hi:.0f}]"

    for name in names:
        m = [(r["methods"][name], r["picks"]) for r in ranked]
        lines.append(f"| {name} | {cell([p['place'] == 1 for p, _ in m])} | {cell([p['place'] <= k for p, k in m])} "
                     f"| {cell([p['place'] <= 2 * k for p, k in m])} | {np.mean([p['place'] for p, _ in m]):.1f} "
                     f"| {np.mean([p['decoys_above'] for p, _ in m]):.1f} |")
    heads = [r["answer_heads"] for r in ranked]
    if heads:
        lines += ["", f"On the row that writes the value (full prefill), the block a head attends to most is the "
                  f"needle's for {np.mean([h['needle'] for h in heads]):.1f} and a decoy's for "
                  f"{np.mean([h['decoy'] for h in heads]):.1f} of {heads[0]['all']} (layer, head) pairs (means)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sample_arguments(ap, 6, "ranking-probe")
    ap.add_argument("--model", default="smollm2", help="a model name (smollm2, qwen2.5-coder:0.5b) or a llama/qwen2 "
                    "GGUF path (default smollm2)")
    ap.add_argument("--prefill", choices=("windowed", "full"), default="windowed",
                    help="where the scored keys and question rows come from: a prefill as the engine's (windowed, "
                    "the default) or the full prefill the ceilings use (one numpy prefill a sample instead of two)")
    args = ap.parse_args()
    if args.report:
        print(report(read_rows(args.report)))
        return
    engine = require_engine("cpu")
    model = resolve_model(args.model).path
    lm = Llama(str(model))
    args.out.mkdir(parents=True, exist_ok=True)
    server_args = ["-t", "2", "-c", str(args.length + 1024), "-np", "1", "--kvmem-budget", str(args.budget),
                   "--kvmem-trace", "-lv", "4"]
    rows: list[dict] = []
    with start_llama_server(engine.server, model, server_args, args.out / "on.log") as on, \
            EvalClient(on.url) as client:
        for row in each_sample(args, client,
                               lambda s: probe_sample(lm, on, client, s, args.budget, args.prefill == "windowed")):
            rows.append(row)
            places_now = {n: p["place"] for n, p in row.get("methods", {}).items()}
            print(f"sample {row['index']} depth {row['depth']}: needle block {row['needle_block']}, decoys "
                  f"{row['decoy_blocks']}, places {places_now}", flush=True)
    print(report(rows))


if __name__ == "__main__":
    main()
