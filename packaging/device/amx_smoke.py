#!/usr/bin/env python3
"""On the GPU host: the CUDA engine's CPU side (issue 22). llama-server of the sm_90 engine with all layers on
the GPU, with most layers left on the CPU (`-ngl 4`: those run ggml's CPU variant), and with tiering on; each
answers greedily, and the log says which backends were loaded and that no AMX buffer was made.

    python3 packaging/device/amx_smoke.py        # prints one JSON line per run and writes amx_smoke.json
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import httpx

from kvmem_llama import cpu_backend
from kvmem_llama.default_model import default_model_path
from kvmem_llama.engine import find_engine
from kvmem_llama.serving.process import start_llama_server

RUNS = {
    "gpu-all": ["-ngl", "99"],
    "cpu-most": ["-ngl", "4"],
    "gpu-tiered": ["-ngl", "99", "--kvmem-budget", "1024", "--kvmem-block", "64", "--kvmem-sink", "64",
                   "--kvmem-recent", "128"],
}
PROMPT = "The capital of France is"


def main() -> None:
    engine = find_engine("cuda-sm90")
    if engine is None:
        raise SystemExit("no current cuda-sm90 engine: run `kvmem build --sm 90`")
    model = default_model_path()
    results = {"engine": engine.key, "cpu_variant": cpu_backend.choose_variant(engine.path).describe(),
               "amx_modules": [p.name for p in cpu_backend.modules_with_amx(engine.path)], "runs": {}}
    for name, args in RUNS.items():
        log_path = Path(tempfile.mkdtemp()) / f"{name}.log"
        with start_llama_server(engine.server, model, ["-c", "2048", "-np", "1", "-lv", "4", *args], log_path) as srv:
            body = httpx.post(f"{srv.url}/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0},
                              timeout=120).json()
            log = srv.log_text()
        results["runs"][name] = {
            "answer": body.get("content"),
            "tokens_per_s": body.get("timings", {}).get("predicted_per_second"),
            "backends": re.findall(r"loaded (\w+) backend from (\S+)", log),
            "amx_buffer": bool(re.search(r"\bAMX model buffer", log)),
            "buffers": re.findall(r"(\S+) model buffer size", log),
            "armed": "kvmem_score: ARMED" in log,
        }
        print(json.dumps({name: results["runs"][name]}))
    Path("amx_smoke.json").write_text(json.dumps(results, indent=2) + "\n")
    ok = all(r["answer"] and not r["amx_buffer"] for r in results["runs"].values()) and not results["amx_modules"]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
