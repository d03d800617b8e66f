#!/usr/bin/env python3
"""Correctness of KV tiering on a GPU engine, with a real model (SmolLM2-135M-Instruct).

1. identity: with --kvmem-budget >= the context, greedy output equals tiering off (token for token);
2. needle:   a ~7K-token haystack with one key -> 7-digit number at depths 10/50/90 %, budget ~1/8 of
             the prompt: retrieval must answer every depth; recency-only is reported alongside.

    python benchmarks/gpu_checks.py --server ENGINE/bin/llama-server --model smollm2.gguf --out DIR [-- extra flags]

Prints a table and writes DIR/gpu_checks.json. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import httpx

from kvmem_llama.serving.process import ServerProcess, start_llama_server


def start(server: str, model: str, args: list[str], log: Path, port: int) -> ServerProcess:
    return start_llama_server(server, model, ["-np", "1", "--no-webui", *args], log, port=port, timeout=120)


def complete(port: int, prompt: str | list[int], n: int) -> dict:
    return httpx.post(f"http://127.0.0.1:{port}/completion", timeout=600, json={
        "prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False, "return_tokens": True,
    }).json()


SENTENCES = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
SMALL_BLOCKS = ["--kvmem-block", "64", "--kvmem-sink", "64", "--kvmem-recent", "128", "--kvmem-gen-reserve", "128"]


def haystack_prompt(n_sentences: int, depth: float, key: str, value: str) -> str:
    """The needle prompt of tests/test_kvmem_engine.py (ChatML, answer prefilled), ~7.2K tokens at 1500."""
    sentences = [SENTENCES[i % len(SENTENCES)] for i in range(n_sentences)]
    sentences.insert(int(n_sentences * depth), f"The secret code for {key} is {value}. Remember it.")
    user = " ".join(sentences) + f"\n\nWhat is the secret code for {key}? Answer with the number only."
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\nThe secret code for {key} is"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--budget", type=int, default=896)
    parser.add_argument("--identity-only", action="store_true", help="skip the needle (e.g. a synthetic model)")
    parser.add_argument("extra", nargs="*", help="extra llama-server flags (e.g. -ngl 99 -fa on)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = ["-c", "8192", *args.extra]
    results: dict = {"identity": {}, "needle": []}
    ok = True

    # 1. identity
    prompt = "Here is a long story about a lighthouse keeper. " + " ".join(SENTENCES * 120) + " The keeper said:"
    outputs = {}
    for label, flags in (("off", []), ("on-budget-8192", ["--kvmem-budget", "8192", "--kvmem-block", "128"])):
        with start(args.server, args.model, base + flags, args.out / f"identity-{label}.log", args.port):
            reply = complete(args.port, prompt, 32)
            outputs[label] = reply["tokens"]
            results["identity"][label] = {"prompt_tokens": reply["timings"]["prompt_n"], "tokens": reply["tokens"]}
    same = outputs["off"] == outputs["on-budget-8192"]
    results["identity"]["equal"] = same
    ok &= same
    print(f"identity (budget >= context vs off): {'EQUAL' if same else 'DIFFERENT'} "
          f"({results['identity']['off']['prompt_tokens']} prompt tokens, 32 generated)")

    if args.identity_only:
        (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=2))
        return 0 if ok else 1

    # 2. needle at three depths, retrieval vs recency
    rng = random.Random(7)
    cases = [(depth, rng.choice(["Mercury", "Orion", "Falcon", "Granite"]), str(rng.randint(1_000_000, 9_999_999)))
             for depth in (0.1, 0.5, 0.9)]
    for method in ("full-kv", "retrieval", "recency"):
        tiering = ["--kvmem-budget", str(args.budget), *SMALL_BLOCKS, "--kvmem-method", method]
        flags = [] if method == "full-kv" else tiering
        with start(args.server, args.model, base + flags, args.out / f"needle-{method}.log", args.port):
            for depth, key, number in cases:
                answer = complete(args.port, haystack_prompt(1500, depth, key, number), 12)["content"]
                found = number in answer
                results["needle"].append({"method": method, "depth": depth, "found": found, "answer": answer})
                if method != "recency":
                    ok &= found
                print(f"needle {method:9s} depth {int(depth * 100):2d}%: {'found' if found else 'MISSED'} "
                      f"({answer.strip()[:60]!r})")
    selects = [ln for ln in (args.out / "needle-retrieval.log").read_text().splitlines() if "kvmem_score: SELECT" in ln]
    results["select_lines"] = selects[-6:]
    (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=2))
    print(f"SELECT lines: {len(selects)}; {'ALL PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
