"""Long-context serving benchmark: one engine + server flags per configuration, several contexts.

For each logical context N it starts llama-server (-c N + room), sends turn 1 (a prompt that fills
the context less room for turn 2 and generation) and turn 2 (512 more tokens, the same prefix), and
records prefill tok/s (turn 1), decode tok/s (turn 2, at depth ~N), peak GPU memory (nvidia-smi),
the KV buffer the engine allocated (its log), peak host RSS, and the kvmem_score SELECT lines
(selection + stage-in ms per turn). Prompts are random token ids: the numbers are about the
mechanics, not about the model's answers (synthetic weights).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from kvmem_llama.errors import KvmemError
from kvmem_llama.kvmem_log import parse_armed, parse_select
from kvmem_llama.serving.process import LOOPBACK, ServerProcess, llama_server_argv

TURN2_TOKENS = 512
KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB")


@dataclass
class BenchResult:
    config: str
    context: int
    prompt_tokens: int
    prefill_tps: float
    decode_tps: float
    turn2_prompt_tps: float
    peak_vram_mib: float | None
    kv_buffer_mib: float
    host_rss_peak_mib: float
    select_ms: list[float] = field(default_factory=list)
    staged_in_blocks: list[int] = field(default_factory=list)
    stage_ms: list[float] = field(default_factory=list)  # the stage-in part of each selection
    stage_in_gbps: list[float] = field(default_factory=list)  # staged bytes / stage-in time
    wall_s: float = 0.0
    error: str | None = None


class _Sampler(threading.Thread):
    """Peak GPU memory (whole device, nvidia-smi) and peak RSS of one process, sampled at 5 Hz."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_vram: float | None = None
        self.peak_rss = 0.0
        self._stop_event = threading.Event()
        self._smi = shutil.which("nvidia-smi")

    def run(self) -> None:
        proc = psutil.Process(self.pid)
        while not self._stop_event.is_set():
            try:
                self.peak_rss = max(self.peak_rss, proc.memory_info().rss / 2**20)
            except psutil.Error:
                pass
            if self._smi:
                out = subprocess.run([self._smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True)
                values = [float(v) for v in out.stdout.split() if v.replace(".", "").isdigit()]
                if values:
                    self.peak_vram = max(self.peak_vram or 0.0, sum(values))
            self._stop_event.wait(0.2)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def _complete(url: str, tokens: list[int], n_predict: int) -> dict:
    reply = httpx.post(f"{url}/completion", timeout=3600, json={
        "prompt": tokens, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
        "cache_prompt": True, "samplers": ["top_k"], "top_k": 1, "return_tokens": True,
    })
    if reply.status_code != 200:
        raise KvmemError(f"/completion answered {reply.status_code}: {reply.text[:500]}")
    return reply.json()


def run_one(server: Path, model: Path, config: str, context: int, server_args: list[str], log_dir: Path,
            gen_tokens: int = 64, port: int = 18181, seed: int = 0, ready_timeout: float = 600) -> BenchResult:
    log_path = log_dir / f"{config}-{context}.log"
    n_ctx = context + TURN2_TOKENS + 2 * gen_tokens + 64
    args = ["-c", str(n_ctx), "-np", "1", "--no-webui", "-lv", "4", *server_args]  # -lv 4: the KV buffer sizes
    started = time.monotonic()
    srv = ServerProcess.spawn(llama_server_argv(server, model, args, LOOPBACK, port), log_path,
                              host=LOOPBACK, port=port)
    assert srv.pid is not None
    sampler = _Sampler(srv.pid)
    sampler.start()
    url = srv.url
    rng = random.Random(seed + context)
    result = BenchResult(config, context, context - gen_tokens, 0.0, 0.0, 0.0, None, 0.0, 0.0)
    try:
        srv.wait_ready(ready_timeout)
        n_vocab = int(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["meta"]["n_vocab"])
        top = min(n_vocab - 1, 100_000)  # ordinary tokens, clear of special ones at the ends
        prompt = [rng.randrange(1000, top) for _ in range(context - gen_tokens)]
        first = _complete(url, prompt, gen_tokens)
        turn2 = prompt + first.get("tokens", []) + [rng.randrange(1000, top) for _ in range(TURN2_TOKENS)]
        second = _complete(url, turn2, gen_tokens)
        result.prefill_tps = first["timings"]["prompt_per_second"]
        result.decode_tps = second["timings"]["predicted_per_second"]
        result.turn2_prompt_tps = second["timings"]["prompt_per_second"]
    except (KvmemError, httpx.HTTPError, KeyError) as exc:
        result.error = str(exc)[:1000]
    finally:
        sampler.stop()
        srv.stop(timeout=30)
    text = log_path.read_text(errors="replace")
    result.kv_buffer_mib = sum(float(m) for m in KV_BUFFER.findall(text))
    block_bytes = 0
    for line in text.splitlines():
        if armed := parse_armed(line):
            # K + V of one block over all tiered layers, at f16 (2 bytes); quantized KV moves less
            block_bytes = armed["block_tokens"] * armed["layers"] * armed["kv_heads"] * armed["head_dim"] * 2 * 2
        select = parse_select(line)
        if select:
            result.select_ms.append(float(select["ms"]))
            result.staged_in_blocks.append(int(select["staged_in"]))
            if "stage_ms" in select and "stage_mib" in select:
                # engines that time the copies themselves (the bytes moved are the cache type's)
                result.stage_ms.append(float(select["stage_ms"]))
                if select["staged_in"] and select["stage_ms"] > 0:
                    gbps = float(select["stage_mib"]) * 2**20 / (float(select["stage_ms"]) / 1000) / 1e9
                    result.stage_in_gbps.append(round(gbps, 2))
            elif block_bytes and select["staged_in"] and select["ms"] > 0:
                gbps = select["staged_in"] * block_bytes / (select["ms"] / 1000) / 1e9
                result.stage_in_gbps.append(round(gbps, 2))
    result.peak_vram_mib = sampler.peak_vram
    result.host_rss_peak_mib = round(sampler.peak_rss, 1)
    result.wall_s = round(time.monotonic() - started, 1)
    return result


def append_results(path: Path, results: list[BenchResult]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        for r in results:
            fh.write(json.dumps(asdict(r)) + "\n")


def load_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def markdown_table(rows: list[dict]) -> str:
    head = ("| config | context | prefill tok/s | decode tok/s | peak VRAM MiB | KV buffer MiB | host RSS MiB "
            "| select ms (turns) | stage-in GB/s | note |\n|---|---:|---:|---:|---:|---:|---:|---|---|---|\n")
    lines = []
    for r in sorted(rows, key=lambda r: (r["context"], r["config"])):
        sel = ", ".join(f"{ms:.1f}" for ms in r.get("select_ms", [])[-2:]) or "-"
        vram = f"{r['peak_vram_mib']:.0f}" if r.get("peak_vram_mib") else "-"
        note = (r.get("error") or "")[:60]
        gbps = ", ".join(f"{g:.1f}" for g in r.get("stage_in_gbps", [])[-2:]) or "-"
        lines.append(f"| {r['config']} | {r['context']:,} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | {vram} | "
                     f"{r['kv_buffer_mib']:.0f} | {r['host_rss_peak_mib']:.0f} | {sel} | {gbps} | {note} |")
    return head + "\n".join(lines) + "\n"


def ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Each config's decode and prefill speed relative to `baseline` at the same context."""
    base = {r["context"]: r for r in rows if r["config"] == baseline and not r.get("error")}
    out = []
    for r in rows:
        b = base.get(r["context"])
        if b and not r.get("error") and b["decode_tps"] and b["prefill_tps"]:
            out.append({"config": r["config"], "context": r["context"],
                        "decode_vs_baseline": round(r["decode_tps"] / b["decode_tps"], 3),
                        "prefill_vs_baseline": round(r["prefill_tps"] / b["prefill_tps"], 3),
                        "kv_buffer_vs_baseline": round(r["kv_buffer_mib"] / b["kv_buffer_mib"], 3)
                        if b["kv_buffer_mib"] else None})
    return out


def plot(rows: list[dict], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in sorted({r["config"] for r in rows}):
        points = sorted((r["context"], r["decode_tps"]) for r in rows if r["config"] == config and not r.get("error"))
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("logical context (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_title("decode speed vs context")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
