#!/usr/bin/env python3
"""How much of the answer does attention over a tiered working set lose, and would stand-ins for the evicted
blocks give it back? (issue 25: the fidelity of attention over the working set). CPU, SmolLM2-135M.

For each `niah_decoy8` sample the real engine (tiering on, --kvmem-trace) says which blocks its turn keeps
resident, and a numpy copy of the model (benchmarks/numpy_llama.py) scores the teacher-forced answer sentence
"The special magic number for KEY mentioned in the provided text is VALUE." under several attention sets:

  full              tiering off: full prefill, every position
  window-all        the prompt prefilled in 512-token ubatches that see the sink and the newest tokens the working
                    set holds (as the engine prefills), then the question and answer over every position
  resident          the same prefill; the question (the prompt's last 128 tokens, recomputed as the engine does
                    after its turn selection) and the answer over the engine's resident blocks only
  standins          resident + one stand-in per evicted block: its mean key and mean value (post-RoPE, as cached),
                    the key's logit raised by log(block tokens) so it weighs like the block's tokens would
  mass-only         the stand-ins with zero values: the evicted blocks' attention mass, none of their content
  oracle[+...]      when the engine's turn missed the needle's block: the same three with that block resident too
                    (one block more than the engine kept)

Per condition: the value tokens' log-probability, whether each is the greedy choice, and the mean KL divergence
from `full` over the answer's tokens. Prints a table (means with 95% t intervals, paired differences) and writes
one JSON line per sample.

    python benchmarks/fidelity_probe.py --length 4000 --budget 1024 --samples 3 --out /tmp/fidelity
    python benchmarks/fidelity_probe.py --report /tmp/fidelity/rows.jsonl     # the table again
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from numpy_llama import Llama  # noqa: E402

from kvmem_llama import kvmem_log  # noqa: E402
from kvmem_llama.default_model import default_model_path  # noqa: E402
from kvmem_llama.engine import require_engine  # noqa: E402
from kvmem_llama.evaluation.client import EvalClient  # noqa: E402
from kvmem_llama.evaluation.stats import Z95  # noqa: E402
from kvmem_llama.evaluation.tasks import fit_sample  # noqa: E402
from kvmem_llama.serving.process import start_llama_server  # noqa: E402

TASK = "niah_decoy8"
BLOCK = 128  # the engine's default block
QUESTION = 128  # the engine's default --kvmem-query-tokens: the span its turn recomputes
UBATCH = 512  # llama-server's default ubatch
RESERVE = 256  # the engine's generation reserve: cells beyond the budget
PAIRS = [("resident", "standins"), ("resident", "mass-only"), ("oracle", "oracle+standins"),
         ("oracle", "oracle+mass-only"), ("window-all", "oracle"), ("window-all", "resident"), ("full", "window-all")]

StandIns = Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def tokenize(url: str, text: str, special: bool = True) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": special}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def turn_resident_blocks(log: str) -> list[int]:
    """The blocks of the last `kvmem_trace: resident ... reason=turn` line."""
    turns = [e for e in kvmem_log.residents(log) if e["reason"] == "turn"]
    if not turns:
        raise SystemExit("the tiered server logged no turn selection: is the prompt longer than the budget?")
    return sorted(turns[-1]["blocks"])


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def positions(blocks: list[int]) -> np.ndarray:
    return np.array([p for b in sorted(blocks) for p in range(b * BLOCK, (b + 1) * BLOCK)], dtype=np.int64)


def stand_ins(Ks: list[np.ndarray], Vs: list[np.ndarray], blocks: list[int], zero_values: bool) -> StandIns:
    def layer(il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = np.stack([Ks[il][b * BLOCK:(b + 1) * BLOCK].mean(0) for b in blocks])
        v = np.stack([Vs[il][b * BLOCK:(b + 1) * BLOCK].mean(0) for b in blocks])
        return k, np.zeros_like(v) if zero_values else v, np.full(len(blocks), math.log(BLOCK), dtype=np.float32)
    return layer


def score(lm: Llama, tokens: np.ndarray, n_prompt: int, v0: int, v1: int, Ks, Vs, keep: np.ndarray,
          extra: StandIns | None, ref: np.ndarray | None) -> tuple[dict, np.ndarray]:
    """The answer's tokens [n_prompt, len) scored after recomputing the prompt's last QUESTION tokens over `keep`
    (+ stand-ins); the value is tokens [v0, v1)."""
    t0 = n_prompt - QUESTION
    lp = log_softmax(lm.logits(lm.tail(tokens, t0, Ks, Vs, keep, extra)[:len(tokens) - t0 - 1]))
    rows = np.arange(v0 - 1 - t0, v1 - 1 - t0)  # row i predicts token t0 + i + 1
    answer = lp[n_prompt - 1 - t0:]
    kl = 0.0 if ref is None else float((np.exp(ref) * (ref - answer)).sum(-1).mean())
    return {"value_logprob": float(lp[rows, tokens[v0:v1]].sum()),
            "value_greedy": bool((lp[rows].argmax(-1) == tokens[v0:v1]).all()), "kl": kl}, answer


def question_key(prompt: str) -> str:
    return re.search(r"What is the special magic number for (.+?) mentioned in the provided text\?", prompt).group(1)


def answer_lead(key: str) -> str:
    """The answer's words before the value, as the engine's answers put them."""
    return f"The special magic number for {key} mentioned in the provided text is"


def probe_sample(lm: Llama, off, on, off_client: EvalClient, on_client: EvalClient, s, budget: int) -> dict:
    value = s.expected[0]
    prompt_text = off_client.apply_template([{"role": "user", "content": s.prompt}])
    answer = f"{answer_lead(question_key(s.prompt))} {value}."
    prompt = tokenize(off.url, prompt_text)
    tokens = np.array(tokenize(off.url, prompt_text + answer))
    if list(tokens[:len(prompt)]) != prompt:
        raise SystemExit("the answer's tokens do not extend the prompt's")
    v0 = len(tokenize(off.url, prompt_text + answer[:answer.rindex(value)]))
    v1 = len(tokens) - 1  # the final "." is not the value
    needle_block = len(tokenize(off.url, prompt_text[:prompt_text.index(value)])) // BLOCK

    before = len(on.log_text())
    engine_on = on_client.chat(s.prompt, 24).text
    engine_off = off_client.chat(s.prompt, 24).text
    t0 = len(prompt) - QUESTION
    done = t0 // BLOCK  # blocks wholly before the recomputed question
    kept = [b for b in turn_resident_blocks(on.log_text()[before:]) if b < done]
    partial = np.arange(done * BLOCK, t0)  # the open block before the question stays resident in the engine too
    evicted = [b for b in range(done) if b not in kept]

    start = time.time()
    window = budget + RESERVE - UBATCH - BLOCK
    _, Kf, Vf = lm.full(tokens[:len(prompt)])
    _, Kw, Vw = lm.full(tokens[:len(prompt)], window=window, sink=BLOCK, block=BLOCK)
    keep = np.concatenate([positions(kept), partial])
    conds: dict[str, tuple] = {
        "full": (Kf, Vf, np.arange(t0), None),
        "window-all": (Kw, Vw, np.arange(t0), None),
        "resident": (Kw, Vw, keep, None),
        "standins": (Kw, Vw, keep, stand_ins(Kw, Vw, evicted, False)),
        "mass-only": (Kw, Vw, keep, stand_ins(Kw, Vw, evicted, True)),
    }
    if needle_block < done and needle_block not in kept:
        okeep = np.concatenate([positions(kept + [needle_block]), partial])
        oev = [b for b in evicted if b != needle_block]
        conds["oracle"] = (Kw, Vw, okeep, None)
        conds["oracle+standins"] = (Kw, Vw, okeep, stand_ins(Kw, Vw, oev, False))
        conds["oracle+mass-only"] = (Kw, Vw, okeep, stand_ins(Kw, Vw, oev, True))
    out, ref = {}, None
    for name, (K, V, kp, extra) in conds.items():
        out[name], answer_lp = score(lm, tokens, len(prompt), v0, v1, K, V, kp, extra, ref)
        ref = answer_lp if ref is None else ref
    return {"index": s.index, "depth": s.depth, "tokens": len(prompt), "budget": budget, "value": value,
            "needle_block": needle_block, "resident": kept, "needle_resident": needle_block in kept or
            needle_block >= done, "evicted": len(evicted), "engine_on": engine_on, "engine_off": engine_off,
            "numpy_s": round(time.time() - start, 1), "conds": out}


def t_interval(x: list[float]) -> tuple[float, float]:
    a = np.asarray(x, dtype=float)
    if len(a) < 2:
        return float(a.mean()), float("nan")
    df, z = len(a) - 1, Z95
    # small df from the table; beyond, the Cornish-Fisher expansion is within 0.003
    t95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]
    t = t95[df - 1] if df <= len(t95) else z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    return float(a.mean()), t * float(a.std(ddof=1)) / math.sqrt(len(a))


def report(rows: list[dict]) -> str:
    names: list[str] = []
    for r in rows:
        names += [n for n in r["conds"] if n not in names]
    right_on = sum(r["value"] in r["engine_on"] for r in rows)
    right_off = sum(r["value"] in r["engine_off"] for r in rows)
    lines = [f"{len(rows)} samples; the engine answered right with tiering on {right_on}, off {right_off}; the "
             f"needle's block resident after its turn: {sum(r['needle_resident'] for r in rows)}", "",
             "| condition | n | value logprob | value greedy | KL to full (nats/token) |", "|---|---:|---|---:|---|"]
    for n in names:
        sub = [r["conds"][n] for r in rows if n in r["conds"]]
        lp, kl = t_interval([c["value_logprob"] for c in sub]), t_interval([c["kl"] for c in sub])
        greedy = sum(c["value_greedy"] for c in sub)
        lines.append(f"| {n} | {len(sub)} | {lp[0]:.2f} ± {lp[1]:.2f} | {greedy}/{len(sub)} "
                     f"| {kl[0]:.3f} ± {kl[1]:.3f} |")
    lines += ["", "| paired difference | n | value logprob | KL |", "|---|---:|---|---|"]
    for a, b in PAIRS:
        both = [r["conds"] for r in rows if a in r["conds"] and b in r["conds"]]
        if both:
            dlp = t_interval([c[b]["value_logprob"] - c[a]["value_logprob"] for c in both])
            dkl = t_interval([c[b]["kl"] - c[a]["kl"] for c in both])
            lines.append(f"| {b} − {a} | {len(both)} | {dlp[0]:+.2f} ± {dlp[1]:.2f} | {dkl[0]:+.3f} ± {dkl[1]:.3f} |")
    return "\n".join(lines)


def sample_arguments(ap: argparse.ArgumentParser, samples: int, out: str) -> None:
    """The options every probe of `niah_decoy8` samples takes (benchmarks/ranking_probe.py too)."""
    ap.add_argument("--length", type=int, default=4000, help="prompt tokens (default 4000)")
    ap.add_argument("--budget", type=int, default=1024, help="--kvmem-budget of the tiered engine (default 1024)")
    ap.add_argument("--samples", type=int, default=samples, help=f"haystacks (default {samples}); each at every depth")
    ap.add_argument("--first-sample", type=int, default=0, help="index of the first haystack (default 0): more "
                    "samples for an earlier run's rows.jsonl")
    ap.add_argument("--depths", default="15,35,55,75,95", help="needle depths in percent (default 15,35,55,75,95)")
    ap.add_argument("--out", type=Path, default=Path(out), help="folder for rows.jsonl and the logs")
    ap.add_argument("--report", type=Path, help="print the table of an earlier rows.jsonl and exit")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def each_sample(args: argparse.Namespace, client: EvalClient, probe: Callable) -> Iterator[dict]:
    """probe(sample) for every haystack at every depth (the depths of one haystack share it), each row appended to
    OUT/rows.jsonl as it comes."""
    for index in range(args.first_sample, args.first_sample + args.samples):
        hint = None
        for depth in (int(d) for d in args.depths.split(",")):
            s = fit_sample(TASK, args.length, depth, index, 0, client.count_tokens, hint=hint)
            hint = s.units
            row = probe(s)
            with open(args.out / "rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            yield row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sample_arguments(ap, 3, "fidelity-probe")
    args = ap.parse_args()
    if args.report:
        print(report(read_rows(args.report)))
        return
    engine, model = require_engine("cpu"), default_model_path()
    lm = Llama(str(model))
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["-t", "2", "-c", str(args.length + 1024), "-np", "1"]
    rows: list[dict] = []
    with start_llama_server(engine.server, model, common, args.out / "off.log") as off, \
            start_llama_server(engine.server, model, [*common, "--kvmem-budget", str(args.budget), "--kvmem-trace",
                                                      "-lv", "4"], args.out / "on.log") as on, \
            EvalClient(off.url) as off_client, EvalClient(on.url) as on_client:
        for row in each_sample(args, off_client,
                               lambda s: probe_sample(lm, off, on, off_client, on_client, s, args.budget)):
            rows.append(row)
            print(f"sample {row['index']} depth {row['depth']}: needle resident {row['needle_resident']}, value "
                  "logprob " + ", ".join(f"{n} {v['value_logprob']:.2f}" for n, v in row["conds"].items()),
                  flush=True)
    print(report(rows))


if __name__ == "__main__":
    main()
