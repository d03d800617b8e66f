#!/usr/bin/env python3
"""The smoke test of an engine package: llama-server answers, KV tiering is ARMED, and its greedy tokens equal
those of another engine (the CPU engine's, recorded with --write where that engine runs).

    python packaging/device/engine_smoke.py --server ENGINE/bin/llama-server --model smollm2.gguf \\
        --write expected.json                                   # the reference engine (here: the CPU one)
    python packaging/device/engine_smoke.py --server ENGINE/bin/llama-server --model smollm2.gguf \\
        --expect expected.json --out smoke.json -- -ngl 99 -fa on   # the package under test

Prints what it found and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from kvmem_llama.serving.process import start_llama_server

PROMPT = "The three primary colors are"
N_PREDICT = 24
# tiering armed with a budget below the context (the prompt is far shorter than the budget: nothing is selected, so
# the tokens are those of full attention on both engines)
TIERING = ["-np", "1", "--no-webui", "-c", "4096", "--kvmem-budget", "1024"]


def smoke(server: str, model: str, extra: list[str], workdir: Path, port: int) -> dict:
    log = workdir / "smoke-server.log"
    proc = start_llama_server(server, model, [*TIERING, *extra], log, port=port, timeout=180)
    try:
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{base}/health", timeout=30).status_code
        answer = httpx.post(f"{base}/completion", timeout=300, json={
            "prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": False,
            "return_tokens": True}).json()
        version = httpx.get(f"{base}/props", timeout=30).json().get("build_info")
    finally:
        proc.stop()
    armed = [line.strip() for line in log.read_text(errors="replace").splitlines() if "kvmem_score: ARMED" in line]
    return {"server": server, "args": [*TIERING, *extra], "health": health, "build_info": version,
            "armed": armed[0] if armed else None, "prompt": PROMPT, "tokens": answer.get("tokens"),
            "content": answer.get("content")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/engine-smoke"))
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", type=Path, help="record this engine's answer as the reference")
    what.add_argument("--expect", type=Path, help="compare with a recorded reference")
    parser.add_argument("--out", type=Path, help="where the result goes (JSON)")
    parser.add_argument("extra", nargs="*", help="extra llama-server flags (after --)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    got = smoke(args.server, args.model, args.extra, args.workdir, args.port)
    if args.write:
        args.write.write_text(json.dumps(got, indent=1) + "\n")
    checks = {"answers": got["health"] == 200 and bool(got["tokens"]), "tiering_armed": got["armed"] is not None}
    if args.expect:
        reference = json.loads(args.expect.read_text())
        got["reference"] = {"server": reference["server"], "tokens": reference["tokens"]}
        checks["same_greedy_tokens"] = got["tokens"] == reference["tokens"]
    got["checks"] = checks
    if args.out:
        args.out.write_text(json.dumps(got, indent=1) + "\n")
    for name, ok in checks.items():
        print(f"{name}: {'PASS' if ok else 'FAIL'}")
    print(f"armed: {got['armed']}\ntokens: {got['tokens']}\ncontent: {got['content']!r}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
