"""Long-context serving benchmark: one engine + server flags per configuration, several contexts.

For each logical context N one llama-server (-c N + room) serves a whole cell:
- turn 1, once: a prompt that fills the context less room for turn 2 and generation (16 tokens
  generated). It gives prefill tok/s, one value per server.
- then `repeats` times the measured turn: turn 2 = the SAME turn-1 prefix (prompt + turn 1's
  generated tokens) + 512 NEW random tokens (other ones each repeat, seeded), then `gen` tokens
  generated, 1,024 by default, EOS ignored. The server's prompt cache (cache_prompt) keeps the
  common prefix and drops the previous repeat's suffix, so each repeat reads only its 512 new
  tokens (`turn2_prompt_tokens`, the server's timings.prompt_n, says so; `turn2_cached_tokens` the
  prefix it reused) before decoding at depth ~N.
Per repeat it records decode tok/s over the whole generation (the generation-time re-selections every
--kvmem-refresh tokens are paid inside it, as a user pays them), turn 2's prompt tok/s, and from the
part of the server log that this repeat wrote: each re-selection's ms (reason refresh/room), the turn
selection's ms (reason=turn; a `fits=1` line, nothing to select, counts with 0 ms), its stage-in ms,
GB/s and staged blocks. Per server: peak GPU memory (nvidia-smi), the KV buffer the engine allocated
(its log), peak host RSS, peak anonymous + shared RSS (RssAnon + RssShmem: RSS less the model file's pages;
the pinned host KV pool is counted there, as RssShmem, on the H200) and the host KV pool the engine reserved
(ARMED's host_mib).

With an image (`image`: PNG/JPEG bytes; the server needs --mmproj), turn 1 is the image first and then text
(seeded words) of the context's length, through /completion's multimodal prompt (the image's tokens come on top,
up to IMAGE_ROOM); turn 2 continues that prompt (its text, turn 1's answer, ~512 new words), so its generation
decodes after an image at depth. Turn 1's prefill tok/s then counts the image's encode and decode; the rows carry
the image's tokens and the server's own times to encode and to decode it (turn 1's, from its log).

Results are one row per repeat (`repeat` 0..n-1), so the report's min and median are over repeats;
the rows of one server share `server_run` and, with `prefill_shared`, the one turn-1 prefill
(its tok/s and selections are copied into each row), so the report takes prefill min/median over
distinct server runs only. `fresh_servers` keeps the older way, a server (and a prefill) per repeat,
for independent prefill repeats at the cost of one prefill each. Prompts are random token ids: the
numbers are about the mechanics, not about the model's answers (synthetic weights).
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from kvmem_llama import kvmem_log
from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation.records import ServerLog
from kvmem_llama.kvmem_log import parse_select, parse_turn
from kvmem_llama.serving.process import LOOPBACK, ServerProcess, free_port, llama_server_argv

TURN2_TOKENS = 512
TURN1_GEN = 16  # turn 1 measures prefill; it generates only enough to end the turn
KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB")
# how long a request's part of the log may take to get its end-of-request line (the server's own thread writes it)
REQUEST_DONE_WAIT_S = 10.0
REFRESH_REASONS = ("refresh", "room")
# the server logs when it starts encoding images (the projector) and how long each batch of their embeddings took
# to decode; the encode is the time between the two, less that decode
IMAGE_ENCODING = re.compile(r"encoding mtmd batch")
IMAGE_DECODED = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+) ms")
IMAGE_ROOM = 4096  # tokens an image may take on top of the context's text (a 1024x1024 image: ~1,024 in Qwen3-VL)
LOG_TIME = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")  # minutes.seconds.ms.us since the server started
WORDS = ("river stone light window garden music paper engine winter market bridge forest signal harbor lantern "
         "meadow copper silver thunder valley orchard canyon glacier meadow island compass").split()
SELECTION_FIELDS = ("select_ms", "refresh_ms", "staged_in_blocks", "stage_ms", "stage_in_gbps", "prompt_select_ms",
                    "score_ms", "capture_ms", "refresh_capture_ms", "phases", "turns")
# a selection's time by part, for engines that say (SELECT's plan_ms and the graph scorer's phases)
PHASE_FIELDS = ("reason", "ms", "stage_ms", "score_ms", "plan_ms", "score_steps", "score_build_ms", "score_upload_ms",
                "score_compute_ms", "gather_ms", "stage_wait_ms", "capture_ms", "capture_fetch_ms", "capture_write_ms",
                "capture_ubatches", "decode_ms", "decodes")


@dataclass
class BenchResult:
    """One repeat of the measured turn (turn 2). Rows with the same `server_run` came from one server and
    share its turn 1: `prefill_tps`, `turn1` and `setup_s` are that one prefill's, copied into each row."""

    config: str
    context: int
    prompt_tokens: int
    prefill_tps: float  # turn 1 (once per server run)
    decode_tps: float  # turn 2's generation, re-selections included
    turn2_prompt_tps: float
    peak_vram_mib: float | None  # peak of the server run so far (whole device)
    kv_buffer_mib: float
    host_rss_peak_mib: float  # peak of the server run so far
    host_anon_peak_mib: float | None = None  # peak RssAnon + RssShmem of the server run so far (Linux)
    host_pool_mib: float | None = None  # the host KV pool the engine reserved (ARMED host_mib; None: tiering off)
    repeat: int = 0
    decode_tokens: int = 0
    server_run: str = ""  # one id per server (and so per turn-1 prefill)
    prefill_shared: bool = False  # True: one prefill served several repeats, prefill_tps is not this repeat's own
    turn2_prompt_tokens: int = 0  # prompt tokens turn 2 read (timings.prompt_n): ~512 when the prefix was reused
    turn2_cached_tokens: int = 0  # prompt tokens taken from the server's prompt cache (timings.cache_n)
    turn2_prompt_ms: float | None = None  # turn 2's time to its first token (timings.prompt_ms)
    select_ms: list[float] = field(default_factory=list)  # turn 2's selections at the end of its prompt (reason=turn)
    refresh_ms: list[float] = field(default_factory=list)  # re-selections during generation (refresh, room)
    staged_in_blocks: list[int] = field(default_factory=list)  # of each turn selection
    stage_ms: list[float] = field(default_factory=list)  # the stage-in part of each turn selection
    stage_in_gbps: list[float] = field(default_factory=list)  # staged bytes / stage-in time
    prompt_select_ms: list[float] = field(default_factory=list)  # selections inside turn 2's prompt (reason=prefill)
    score_ms: list[float] = field(default_factory=list)  # the scorer's part of each turn selection (engines that say)
    # host time after the ubatches (captures + write-through) before each turn selection (the prompt's) and before
    # each re-selection (the generated tokens' since the last one), for engines that say
    capture_ms: list[float] = field(default_factory=list)
    refresh_capture_ms: list[float] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)  # every selection's PHASE_FIELDS, turns and re-selections
    turns: list[dict] = field(default_factory=list)  # TURN lines: where each prompt's last batch spent its time
    # turn 1's selections (shared, like prefill_tps): select_ms, refresh_ms, staged_in_blocks, stage_ms,
    # stage_in_gbps, prompt_select_ms, as above
    turn1: dict = field(default_factory=dict)
    setup_s: float = 0.0  # server start + turn 1 (shared by the rows of a server run)
    wall_s: float = 0.0  # this repeat's turn 2
    # with an image at the start of turn 1: its tokens, and the server's ms to encode it (the projector) and to
    # decode its embeddings (the model), from turn 1's part of the log
    image_tokens: int = 0
    image_encode_ms: float | None = None
    image_decode_ms: float | None = None
    error: str | None = None


def anon_rss_mib(pid: int) -> float | None:
    """RssAnon + RssShmem of a process (MiB): its resident memory less file-backed pages (a model's mmap), from
    /proc/PID/status; None where there is no such file."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return None
    kib = [int(m) for m in re.findall(r"^Rss(?:Anon|Shmem):\s+(\d+) kB", status, flags=re.M)]
    return sum(kib) / 1024 if kib else None


class _Sampler(threading.Thread):
    """Peak GPU memory (whole device, nvidia-smi), peak RSS and peak anonymous RSS of one process, at 5 Hz."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_vram: float | None = None
        self.peak_rss = 0.0
        self.peak_anon: float | None = None
        self._stop_event = threading.Event()
        self._smi = shutil.which("nvidia-smi")

    def run(self) -> None:
        proc = psutil.Process(self.pid)
        while not self._stop_event.is_set():
            try:
                self.peak_rss = max(self.peak_rss, proc.memory_info().rss / 2**20)
            except psutil.Error:
                pass
            anon = anon_rss_mib(self.pid)
            if anon is not None:
                self.peak_anon = max(self.peak_anon or 0.0, anon)
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


def _complete(http: httpx.Client, prompt: list[int] | dict, n_predict: int, cache_prompt: bool = True) -> dict:
    reply = http.post("/completion", json={
        "prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
        "cache_prompt": cache_prompt, "samplers": ["top_k"], "top_k": 1, "return_tokens": True,
    })
    if reply.status_code != 200:
        raise KvmemError(f"/completion answered {reply.status_code}: {reply.text[:500]}")
    return reply.json()


def _block_bytes(armed: dict | None) -> int:
    """K + V of one block over all tiered layers at f16 (2 bytes), from the ARMED event; 0 without one."""
    if armed is None:
        return 0
    return armed["block_tokens"] * armed["layers"] * armed["kv_heads"] * armed["head_dim"] * 2 * 2


def _host_pool_mib(armed: dict | None) -> float | None:
    """The host KV pool's MiB from the ARMED event, None without one (tiering off)."""
    return float(armed["host_mib"]) if armed and "host_mib" in armed else None


def record_selections(text: str, result: BenchResult, block_bytes: int) -> None:
    """Put the SELECT lines of one request's part of the log into `result`: reason refresh/room into
    refresh_ms, prefill into prompt_select_ms, turn (or an engine that names no reason) into select_ms
    with its stage-in. A `fits=1` line (the history fits, nothing selected) is a selection of 0 ms."""
    for line in text.splitlines():
        turn = parse_turn(line)
        if turn is not None:
            result.turns.append({key: value for key, value in turn.items() if key != "event"})
            continue
        select = parse_select(line)
        if select is None:
            continue
        reason = select.get("reason")
        if "plan_ms" in select:
            result.phases.append({key: select[key] for key in PHASE_FIELDS if key in select})
        if reason in REFRESH_REASONS:
            result.refresh_ms.append(float(select["ms"]))
            if "capture_ms" in select:
                result.refresh_capture_ms.append(float(select["capture_ms"]))
            continue
        if reason == "prefill":
            result.prompt_select_ms.append(float(select["ms"]))
            continue
        result.select_ms.append(float(select["ms"]))
        result.staged_in_blocks.append(int(select["staged_in"]))
        if "score_ms" in select:
            result.score_ms.append(float(select["score_ms"]))
        if "capture_ms" in select:
            result.capture_ms.append(float(select["capture_ms"]))
        if "stage_ms" in select and "stage_mib" in select:
            # engines that time the copies themselves (the bytes moved are the cache type's)
            result.stage_ms.append(float(select["stage_ms"]))
            if select["staged_in"] and select["stage_ms"] > 0:
                gbps = float(select["stage_mib"]) * 2**20 / (float(select["stage_ms"]) / 1000) / 1e9
                result.stage_in_gbps.append(round(gbps, 2))
        elif block_bytes and select["staged_in"] and select["ms"] > 0:
            gbps = select["staged_in"] * block_bytes / (select["ms"] / 1000) / 1e9
            result.stage_in_gbps.append(round(gbps, 2))


def _words(http: httpx.Client, n_tokens: int, seed: str) -> str:
    """Seeded words that the server's tokenizer makes about n_tokens tokens (the count is scaled until it lands
    within 8 tokens under)."""
    rng = random.Random(seed)
    pool = [rng.choice(WORDS) for _ in range(2 * n_tokens)]
    count = n_tokens
    text = ""
    for _ in range(6):
        text = " " + " ".join(pool[:count])
        made = len(http.post("/tokenize", json={"content": text}).json()["tokens"])
        if n_tokens - 8 < made <= n_tokens:
            break
        count = max(1, min(len(pool), count * n_tokens // max(made, 1) - (made > n_tokens)))
    return text


def _log_ms(line: str) -> float | None:
    m = LOG_TIME.match(line)
    return None if m is None else int(m[1]) * 60_000 + int(m[2]) * 1000 + int(m[3]) + int(m[4]) / 1000


def image_events(text: str) -> tuple[float | None, float | None]:
    """The ms a log part spent encoding images (the projector) and decoding their embeddings, None when none."""
    encode = decode = 0.0
    seen, started = False, None
    for line in text.splitlines():
        if IMAGE_ENCODING.search(line):
            started = _log_ms(line)
        elif decoded := IMAGE_DECODED.search(line):
            seen, ms, now = True, float(decoded[1]), _log_ms(line)
            decode += ms
            if started is not None and now is not None:
                encode += max(0.0, now - started - ms)
            started = None
    return (round(encode, 1), decode) if seen else (None, None)


def _turn2_tokens(seed: int, context: int, repeat: int, top: int) -> list[int]:
    """The 512 new tokens of one repeat's turn 2: other ones each repeat, the same ones each time it is run."""
    rng = random.Random(f"turn2-{seed}-{context}-{repeat}")
    return [rng.randrange(1000, top) for _ in range(TURN2_TOKENS)]


def run_cell(server: Path, model: Path, config: str, context: int, server_args: list[str], log_dir: Path,
             gen_tokens: int = 1024, repeats: int = 1, *, first_repeat: int = 0, port: int | None = None,
             seed: int = 0, ready_timeout: float = 600, image: bytes | None = None, image_at: int = 0,
             on_result: Callable[[BenchResult], None] | None = None) -> list[BenchResult]:
    """One server: turn 1 (the prefill) once, then `repeats` turn 2s on its prefix; one row per repeat,
    numbered from `first_repeat`. `on_result` gets each row as soon as it is complete. `image`: turn 1 starts
    with it (module docstring), after `image_at` tokens of text (past the sink, the image's block can leave)."""
    repeat_ids = list(range(first_repeat, first_repeat + repeats))
    name = f"r{repeat_ids[0]}" if repeats == 1 else f"r{repeat_ids[0]}-{repeat_ids[-1]}"
    log_path = log_dir / f"{config}-{context}-{name}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    n_ctx = context + TURN2_TOKENS + TURN1_GEN + gen_tokens + 64 + (IMAGE_ROOM if image is not None else 0)
    args = ["-c", str(n_ctx), "-np", "1", "--no-webui", "-lv", "4", *server_args]  # -lv 4: the KV buffer sizes
    run_id = f"{config}-{context}-{uuid.uuid4().hex[:8]}"
    shared = repeats > 1
    results: list[BenchResult] = []

    def emit(result: BenchResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    def row(repeat: int) -> BenchResult:
        return BenchResult(config, context, context - TURN1_GEN, 0.0, 0.0, 0.0, None, 0.0, 0.0, repeat=repeat,
                           server_run=run_id, prefill_shared=shared)

    started = time.monotonic()
    port = port or free_port()  # a fixed default collides with a second bench or test run
    srv = ServerProcess.spawn(llama_server_argv(server, model, args, LOOPBACK, port), log_path,
                              host=LOOPBACK, port=port)
    assert srv.pid is not None
    sampler = _Sampler(srv.pid)
    sampler.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=3600, trust_env=False) as http:
            turn1_row = row(repeat_ids[0])
            log = ServerLog(log_path)
            turn1_start = 0
            try:
                srv.wait_ready(ready_timeout)
                n_vocab = int(http.get("/v1/models", timeout=10).json()["data"][0]["meta"]["n_vocab"])
                top = min(n_vocab - 1, 100_000)  # ordinary tokens, clear of special ones at the ends
                rng = random.Random(seed + context)
                if image is None:
                    prompt: list[int] | dict = [rng.randrange(1000, top) for _ in range(context - TURN1_GEN)]
                else:
                    media = base64.b64encode(image).decode()
                    marker = http.get("/props", timeout=10).json()["media_marker"]  # the server's own, random
                    before = _words(http, image_at, f"before-{seed}-{context}") if image_at > 0 else ""
                    text = _words(http, context - TURN1_GEN - image_at, f"turn1-{seed}-{context}")
                    n_text = len(http.post("/tokenize", json={"content": before + text}).json()["tokens"])
                    prompt = {"prompt_string": before + marker + text, "multimodal_data": [media]}
                turn1_start = log.size()
                first = _complete(http, prompt, TURN1_GEN)
                if image is not None:
                    turn1_row.image_tokens = int(first["timings"]["prompt_n"]) - n_text
                if isinstance(prompt, list):
                    prefix: list[int] | dict = prompt + first.get("tokens", [])
                else:
                    prefix = {**prompt, "prompt_string": prompt["prompt_string"] + first.get("content", "")}
                prefill_tps = float(first["timings"]["prompt_per_second"])
            except (KvmemError, httpx.HTTPError, KeyError, ValueError) as exc:
                turn1_row.error = str(exc)[:1000]
            # the whole log so far (start-up: ARMED, the KV buffers), once turn 1's end-of-request line is in
            log.segment(turn1_start, settle=0.0 if turn1_row.error else REQUEST_DONE_WAIT_S)
            text = log.read(0)
            kv_buffer_mib = sum(float(m) for m in KV_BUFFER.findall(text))
            armed = kvmem_log.armed(text)
            block_bytes, host_pool_mib = _block_bytes(armed), _host_pool_mib(armed)
            record_selections(text, turn1_row, block_bytes)
            image_ms = image_events(log.read(turn1_start))
            turn1_selections = {key: getattr(turn1_row, key) for key in SELECTION_FIELDS}
            setup_s = round(time.monotonic() - started, 1)
            for repeat in repeat_ids:
                result = row(repeat)
                result.kv_buffer_mib, result.setup_s, result.host_pool_mib = kv_buffer_mib, setup_s, host_pool_mib
                if turn1_row.error:
                    result.error = turn1_row.error
                else:
                    result.prefill_tps = prefill_tps
                    result.turn1 = {key: list(values) for key, values in turn1_selections.items()}
                    t0 = time.monotonic()
                    start = log.size()
                    result.image_tokens = turn1_row.image_tokens
                    result.image_encode_ms, result.image_decode_ms = image_ms
                    try:
                        if isinstance(prefix, list):
                            turn2: list[int] | dict = prefix + _turn2_tokens(seed, context, repeat, top)
                        else:
                            new_words = _words(http, TURN2_TOKENS, f"turn2-{seed}-{context}-{repeat}")
                            turn2 = {**prefix, "prompt_string": prefix["prompt_string"] + new_words}
                        second = _complete(http, turn2, gen_tokens)
                        timings = second["timings"]
                        result.decode_tps = float(timings["predicted_per_second"])
                        result.decode_tokens = int(timings["predicted_n"])
                        result.turn2_prompt_tps = float(timings["prompt_per_second"])
                        result.turn2_prompt_ms = float(timings["prompt_ms"])
                        result.turn2_prompt_tokens = int(timings.get("prompt_n", 0))
                        result.turn2_cached_tokens = int(timings.get("cache_n", 0))
                    except (KvmemError, httpx.HTTPError, KeyError, ValueError) as exc:
                        result.error = str(exc)[:1000]
                    result.wall_s = round(time.monotonic() - t0, 1)
                    text = log.segment(start, settle=0.0 if result.error else REQUEST_DONE_WAIT_S)
                    record_selections(text, result, block_bytes)
                result.peak_vram_mib = sampler.peak_vram
                result.host_rss_peak_mib = round(sampler.peak_rss, 1)
                result.host_anon_peak_mib = None if sampler.peak_anon is None else round(sampler.peak_anon, 1)
                emit(result)
    finally:
        sampler.stop()
        srv.stop(timeout=30)
    return results


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


def _server_runs(rows: list[dict]) -> list[dict]:
    """The first row of each server run: what a run measures once (turn 1's prefill). Rows without a
    `server_run` (results of older versions, a server per repeat) are each a run of their own."""
    runs: dict[str, dict] = {}
    for i, r in enumerate(rows):
        runs.setdefault(r.get("server_run") or f"row-{i}", r)
    return list(runs.values())


def cells(rows: list[dict]) -> list[dict]:
    """One summary per (config, context): min and median over the repeats that did not fail; prefill over
    distinct server runs only (the repeats of one server share its one prefill)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["context"]), []).append(r)
    out = []
    for (config, context), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in runs if not r.get("error")]
        servers = _server_runs(ok)
        cell: dict = {"config": config, "context": context, "repeats": len(ok), "failed": len(runs) - len(ok),
                      "servers": len(servers), "error": next((r["error"] for r in runs if r.get("error")), None)}
        if ok:
            prefill = [r["prefill_tps"] for r in servers]
            cell["prefill_tps_min"], cell["prefill_tps_median"] = min(prefill), _median(prefill)
            decode = [r["decode_tps"] for r in ok]
            cell["decode_tps_min"], cell["decode_tps_median"] = min(decode), _median(decode)
            refresh = [ms for r in ok for ms in r.get("refresh_ms", [])]
            turns = [ms for r in ok for ms in r.get("select_ms", [])]
            turn1 = [ms for r in servers for ms in r.get("turn1", {}).get("select_ms", [])]
            turn1_gbps = [g for r in servers for g in r.get("turn1", {}).get("stage_in_gbps", [])]
            stage = [ms for r in ok for ms in r.get("stage_ms", [])]
            score = [ms for r in ok for ms in r.get("score_ms", [])]
            refresh_score = [p["score_ms"] for r in ok for p in r.get("phases", [])
                             if p.get("reason") in REFRESH_REASONS]
            capture = [ms for r in ok for ms in r.get("capture_ms", [])]
            gbps = [g for r in ok for g in r.get("stage_in_gbps", [])]
            read = [r["turn2_prompt_tokens"] for r in ok if r.get("turn2_prompt_tokens")]
            cell["decode_tokens"] = max(r.get("decode_tokens", 0) for r in ok)
            cell["turn2_prompt_tokens_max"] = max(read) if read else None
            ttft = [r["turn2_prompt_ms"] for r in ok if r.get("turn2_prompt_ms") is not None]
            cell["ttft_ms_median"] = _median(ttft) if ttft else None
            for key in ("snapshot_ms", "restore_ms", "recompute_ms", "ms"):
                values = [t[key] for r in ok for t in r.get("turns", []) if key in t]
                cell[f"turn_batch_{key}_median"] = _median(values) if values else None
            cell["refreshes_per_run"] = _median([len(r.get("refresh_ms", [])) for r in ok])  # per repeat
            cell["refresh_ms_median"] = _median(refresh) if refresh else None
            cell["refresh_ms_max"] = max(refresh) if refresh else None
            cell["turn_select_ms_median"] = _median(turns) if turns else None
            cell["turn_select_ms_max"] = max(turns) if turns else None
            cell["turn1_select_ms_median"] = _median(turn1) if turn1 else None
            cell["stage_ms_median"] = _median(stage) if stage else None
            cell["score_ms_median"] = _median(score) if score else None
            cell["refresh_score_ms_median"] = _median(refresh_score) if refresh_score else None
            cell["capture_ms_median"] = _median(capture) if capture else None  # turn 2's 512-token prompt
            cell["stage_in_gbps_median"] = _median(gbps) if gbps else None
            cell["turn1_stage_in_gbps_median"] = _median(turn1_gbps) if turn1_gbps else None
            cell["peak_vram_mib"] = max((r["peak_vram_mib"] or 0.0) for r in ok) or None
            cell["kv_buffer_mib"] = max(r["kv_buffer_mib"] for r in ok)
            cell["host_rss_peak_mib"] = max(r["host_rss_peak_mib"] for r in ok)
            anon = [r["host_anon_peak_mib"] for r in ok if r.get("host_anon_peak_mib") is not None]
            cell["host_anon_peak_mib"] = max(anon) if anon else None
            pools = [r["host_pool_mib"] for r in ok if r.get("host_pool_mib") is not None]
            cell["host_pool_mib"] = max(pools) if pools else None
        out.append(cell)
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _host_rss(cell: dict) -> str:
    anon = cell.get("host_anon_peak_mib")
    return _fmt(cell["host_rss_peak_mib"], 0) + ("" if anon is None else f" ({anon:,.0f})")


def _fmt_pair(median: float | None, top: float | None) -> str:
    return "-" if median is None else f"{median:.1f} ({top:.1f})"


TABLE_NOTE = ("runs: repeats of turn 2 that did not fail; servers: server runs among them, each with one turn-1 "
              "prefill, so prefill min / median is over servers, every other column over repeats. turn-2 read: "
              "the most prompt tokens a repeat's turn 2 read (~512 when the prompt cache kept the prefix); "
              "turn-2 TTFT: its time to the first token (the server's prompt_ms, median over repeats). "
              "turn select ms (scoring, planning and staging), score ms, stage ms and stage-in GB/s: turn 2's "
              "selections at the end of its prompt (medians over repeats), GB/s in brackets turn 1's (over servers). "
              "host RSS MiB: peak resident memory, in brackets RssAnon + RssShmem (without the model file's pages; "
              "the pinned host KV pool is counted there); host KV pool MiB: what the engine reserved for the pool. "
              "Host KV memory at a context: the bracket less tiering-off's at the same context.")


def markdown_table(rows: list[dict]) -> str:
    head = ("| config | context | runs | servers | prefill tok/s min / median | decode tok/s min / median | generated "
            "| turn-2 read | turn-2 TTFT ms | refreshes | refresh ms median (max) | turn select ms median (max) "
            "| score ms median | stage ms median | stage-in GB/s (turn 1) | peak VRAM MiB | KV buffer MiB "
            "| host RSS MiB (anon) | host KV pool MiB | note |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
    lines = []
    for c in cells(rows):
        note = (c["error"] or "")[:60]
        if not c["repeats"]:
            lines.append(f"| {c['config']} | {c['context']:,} | 0 | 0 |" + " - |" * 15 + f" {note} |")
            continue
        read = "-" if c["turn2_prompt_tokens_max"] is None else f"{c['turn2_prompt_tokens_max']:,}"
        gbps = _fmt(c["stage_in_gbps_median"])
        if c["turn1_stage_in_gbps_median"] is not None:
            gbps += f" ({_fmt(c['turn1_stage_in_gbps_median'])})"
        lines.append(
            f"| {c['config']} | {c['context']:,} | {c['repeats']} | {c['servers']} | {_fmt(c['prefill_tps_min'])} / "
            f"{_fmt(c['prefill_tps_median'])} | {_fmt(c['decode_tps_min'], 2)} / {_fmt(c['decode_tps_median'], 2)} | "
            f"{c['decode_tokens']} | {read} | {_fmt(c.get('ttft_ms_median'), 0)} | {c['refreshes_per_run']:g} | "
            f"{_fmt_pair(c['refresh_ms_median'], c['refresh_ms_max'])} | "
            f"{_fmt_pair(c['turn_select_ms_median'], c['turn_select_ms_max'])} | {_fmt(c['score_ms_median'])} | "
            f"{_fmt(c['stage_ms_median'])} | "
            f"{gbps} | {_fmt(c['peak_vram_mib'], 0)} | {_fmt(c['kv_buffer_mib'], 0)} | "
            f"{_host_rss(c)} | {_fmt(c.get('host_pool_mib'), 0)} | {note} |")
    return head + "\n".join(lines) + "\n\n" + TABLE_NOTE + "\n"


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
