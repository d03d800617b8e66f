"""Long-context serving benchmark: one engine + server flags per configuration, several contexts.

For each logical context N it starts llama-server (-c N + room), sends turn 1 (a prompt that fills
the context less room for turn 2 and generation, 16 tokens generated) and turn 2 (512 more tokens on
the same prefix, then `gen` tokens, 1,024 by default, EOS ignored). It records prefill tok/s (turn 1),
decode tok/s over turn 2's whole generation at depth ~N (so the generation-time re-selections every
--kvmem-refresh tokens are paid inside it, as a user pays them), each re-selection's ms, the turn
selections' ms and stage-in GB/s, peak GPU memory (nvidia-smi), the KV buffer the engine allocated
(its log) and peak host RSS. Every cell runs `repeats` times, each with a fresh server; the report
gives min and median. Prompts are random token ids: the numbers are about the mechanics, not about
the model's answers (synthetic weights).
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
from kvmem_llama.serving.process import LOOPBACK, ServerProcess, free_port, llama_server_argv

TURN2_TOKENS = 512
TURN1_GEN = 16  # turn 1 measures prefill; it generates only enough to end the turn
KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB")


@dataclass
class BenchResult:
    config: str
    context: int
    prompt_tokens: int
    prefill_tps: float
    decode_tps: float  # turn 2's generation, re-selections included
    turn2_prompt_tps: float
    peak_vram_mib: float | None
    kv_buffer_mib: float
    host_rss_peak_mib: float
    repeat: int = 0
    decode_tokens: int = 0
    select_ms: list[float] = field(default_factory=list)  # selections at the end of a prompt (reason=turn)
    refresh_ms: list[float] = field(default_factory=list)  # re-selections during generation (refresh, room)
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
            gen_tokens: int = 1024, port: int | None = None, seed: int = 0, ready_timeout: float = 600,
            repeat: int = 0) -> BenchResult:
    log_path = log_dir / f"{config}-{context}-r{repeat}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    n_ctx = context + TURN2_TOKENS + TURN1_GEN + gen_tokens + 64
    args = ["-c", str(n_ctx), "-np", "1", "--no-webui", "-lv", "4", *server_args]  # -lv 4: the KV buffer sizes
    started = time.monotonic()
    port = port or free_port()  # a fixed default collides with a second bench or test run
    srv = ServerProcess.spawn(llama_server_argv(server, model, args, LOOPBACK, port), log_path,
                              host=LOOPBACK, port=port)
    assert srv.pid is not None
    sampler = _Sampler(srv.pid)
    sampler.start()
    url = srv.url
    rng = random.Random(seed + context)
    result = BenchResult(config, context, context - TURN1_GEN, 0.0, 0.0, 0.0, None, 0.0, 0.0, repeat=repeat)
    try:
        srv.wait_ready(ready_timeout)
        n_vocab = int(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["meta"]["n_vocab"])
        top = min(n_vocab - 1, 100_000)  # ordinary tokens, clear of special ones at the ends
        prompt = [rng.randrange(1000, top) for _ in range(context - TURN1_GEN)]
        first = _complete(url, prompt, TURN1_GEN)
        turn2 = prompt + first.get("tokens", []) + [rng.randrange(1000, top) for _ in range(TURN2_TOKENS)]
        second = _complete(url, turn2, gen_tokens)
        result.prefill_tps = first["timings"]["prompt_per_second"]
        result.decode_tps = second["timings"]["predicted_per_second"]
        result.decode_tokens = int(second["timings"]["predicted_n"])
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
        if select and select.get("reason") in ("refresh", "room"):
            result.refresh_ms.append(float(select["ms"]))
        elif select:
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


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def cells(rows: list[dict]) -> list[dict]:
    """One summary per (config, context): min and median over the repeats that did not fail."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["context"]), []).append(r)
    out = []
    for (config, context), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in runs if not r.get("error")]
        cell: dict = {"config": config, "context": context, "repeats": len(ok), "failed": len(runs) - len(ok),
                      "error": next((r["error"] for r in runs if r.get("error")), None)}
        if ok:
            for key in ("prefill_tps", "decode_tps"):
                values = [r[key] for r in ok]
                cell[f"{key}_min"], cell[f"{key}_median"] = min(values), _median(values)
            refresh = [ms for r in ok for ms in r.get("refresh_ms", [])]
            turns = [ms for r in ok for ms in r.get("select_ms", [])]
            gbps = [g for r in ok for g in r.get("stage_in_gbps", [])]
            cell["decode_tokens"] = max(r.get("decode_tokens", 0) for r in ok)
            cell["refreshes_per_run"] = _median([len(r.get("refresh_ms", [])) for r in ok])
            cell["refresh_ms_median"] = _median(refresh) if refresh else None
            cell["refresh_ms_max"] = max(refresh) if refresh else None
            cell["turn_select_ms_median"] = _median(turns) if turns else None
            cell["stage_in_gbps_median"] = _median(gbps) if gbps else None
            cell["peak_vram_mib"] = max((r["peak_vram_mib"] or 0.0) for r in ok) or None
            cell["kv_buffer_mib"] = max(r["kv_buffer_mib"] for r in ok)
            cell["host_rss_peak_mib"] = max(r["host_rss_peak_mib"] for r in ok)
        out.append(cell)
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    head = ("| config | context | runs | prefill tok/s min / median | decode tok/s min / median | generated "
            "| refreshes | refresh ms median (max) | turn select ms | stage-in GB/s | peak VRAM MiB | KV buffer MiB "
            "| host RSS MiB | note |\n|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|\n")
    lines = []
    for c in cells(rows):
        note = (c["error"] or "")[:60]
        if not c["repeats"]:
            lines.append(f"| {c['config']} | {c['context']:,} | 0 | - | - | - | - | - | - | - | - | - | - | {note} |")
            continue
        refresh = "-" if c["refresh_ms_median"] is None else \
            f"{c['refresh_ms_median']:.1f} ({c['refresh_ms_max']:.1f})"
        lines.append(
            f"| {c['config']} | {c['context']:,} | {c['repeats']} | {_fmt(c['prefill_tps_min'])} / "
            f"{_fmt(c['prefill_tps_median'])} | {_fmt(c['decode_tps_min'], 2)} / {_fmt(c['decode_tps_median'], 2)} | "
            f"{c['decode_tokens']} | {c['refreshes_per_run']:g} | {refresh} | {_fmt(c['turn_select_ms_median'])} | "
            f"{_fmt(c['stage_in_gbps_median'])} | {_fmt(c['peak_vram_mib'], 0)} | {_fmt(c['kv_buffer_mib'], 0)} | "
            f"{_fmt(c['host_rss_peak_mib'], 0)} | {note} |")
    return head + "\n".join(lines) + "\n"


def ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Each config's median decode and prefill speed relative to `baseline`'s at the same context."""
    summary = cells(rows)
    base = {c["context"]: c for c in summary if c["config"] == baseline and c["repeats"]}
    out = []
    for c in summary:
        b = base.get(c["context"])
        if b and c["repeats"] and b["decode_tps_median"] and b["prefill_tps_median"]:
            out.append({"config": c["config"], "context": c["context"],
                        "decode_vs_baseline": round(c["decode_tps_median"] / b["decode_tps_median"], 3),
                        "prefill_vs_baseline": round(c["prefill_tps_median"] / b["prefill_tps_median"], 3),
                        "kv_buffer_vs_baseline": round(c["kv_buffer_mib"] / b["kv_buffer_mib"], 3)
                        if b["kv_buffer_mib"] else None})
    return out


def plot(rows: list[dict], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    summary = cells(rows)
    for config in sorted({c["config"] for c in summary}):
        points = sorted((c["context"], c["decode_tps_median"]) for c in summary
                        if c["config"] == config and c["repeats"])
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("logical context (tokens)")
    ax.set_ylabel("decode tok/s (median, re-selections included)")
    ax.set_title("decode speed vs context")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
