#!/usr/bin/env python3
"""Soak test of the tiered engine with parallel slots (issue 17). Not a CI test: it runs for --duration.

One llama-server (started the way `kvmem run` starts it: serving.launch, SmolLM2-135M, KV tiering on with a
--kvmem-budget well under the prompts, -np 4 --kv-unified, --metrics) gets a bounded random mix from
--clients concurrent clients. The tiering defaults (budget 1,536, 64-token blocks, sink 64, recent 128) serve all
four slots at once: with 128-token blocks a budget of 1,024 serves two (each busy slot keeps at least sink + recent
+ 2 blocks; the server lets the other requests wait, and `kvmem run` warns).

  long      a 4-7K-token haystack with a 7-digit needle, non-streamed; the answer is checked
  followup  a long haystack with two needles, then a second turn asking for the other one (same slot, cached
            prefix: the follow-up selection of the tiered cache)
  short     a short chat
  cancel    a streamed answer closed half-way (after max_tokens / 2 chunks)
  hangup    a long prompt over a raw socket that is closed 0.5-5 s later, mid-prefill
  wrong     a request naming another model: 404 expected (--strict-model-id)
  overlong  a prompt longer than a slot's context: 400 expected

Every answer is scanned for the needles of *other* requests (cross-slot text). Every --interval s it samples
the server's RSS, open fds and threads (psutil) and the llamacpp:kvmem_* counters of /metrics and /slots.
Every --idle-every s, and at the end, the clients pause until the slots are idle: the host-pool blocks of
/metrics must equal the sum of the slots' own, and after erasing the slots (POST /slots/ID?action=erase)
they must be back at the baseline of the fresh server (0).

Pass: no failed request that should have succeeded (and 404/400 where expected), no crash, RSS growth after
--warmup <= 5 %, the host pool back at baseline at every idle checkpoint, no cross-slot text.

    python benchmarks/soak.py                       # 30 minutes, 6 clients, results into docs/reliability/
    python benchmarks/soak.py --duration 120 --out /tmp/soak-debug

Writes OUT/soak.json, OUT/soak.md (tables) and OUT/soak.png (RSS, fds, threads, host blocks over time; needs
matplotlib, else skipped with a one-line hint).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvmem_llama import hardware, plots
from kvmem_llama.errors import KvmemError
from kvmem_llama.serving import launch
from kvmem_llama.serving.launch import ServerHandle

KINDS = {"long": 0.25, "followup": 0.15, "short": 0.22, "cancel": 0.12, "hangup": 0.10, "wrong": 0.08,
         "overlong": 0.08}
EXPECTED_STATUS = {"wrong": 404, "overlong": 400}
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
KEYS = ["Mercury", "Orion", "Falcon", "Granite", "Willow", "Cobalt", "Juniper", "Harbor", "Saffron", "Quartz",
        "Tundra", "Marlin", "Ember", "Lotus", "Nimbus", "Aspen"]
SHORT = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish.",
         "What is 2 + 2?", "Give me a word that rhymes with cat.", "What do bees make?"]
CODE = re.compile(r"\d{7}")
REQUEST_TIMEOUT = 1800.0


@dataclass
class Outcome:
    kind: str
    client: int
    t_start: float
    seconds: float
    ok: bool  # what should have happened happened
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    needles: int = 0  # needles asked for
    found: int = 0  # needles answered correctly
    cross_slot: list[str] = field(default_factory=list)  # other requests' codes that appeared in this answer
    answer: str = ""
    cut: bool = False  # in flight when the soak itself was interrupted: not counted as a failure


class Codes:
    """Unique 7-digit needle values, and whose they are."""

    def __init__(self, rng: random.Random):
        self.rng, self.lock, self.owner = rng, threading.Lock(), {}

    def new(self, request: int) -> str:
        with self.lock:
            while (code := str(self.rng.randint(1_000_000, 9_999_999))) in self.owner:
                pass
            self.owner[code] = request
            return code

    def foreign(self, text: str, request: int) -> list[str]:
        with self.lock:
            return [c for c in CODE.findall(text) if c in self.owner and self.owner[c] != request]


class Soak:
    def __init__(self, srv: ServerHandle, args: argparse.Namespace, tokens_per_sentence: float, slot_ctx: int):
        self.srv, self.args = srv, args
        self.url = srv.url
        self.tps, self.slot_ctx = tokens_per_sentence, slot_ctx
        self.codes = Codes(random.Random(args.seed))
        self.outcomes: list[Outcome] = []
        self.samples: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.in_flight = 0
        self.requests = 0
        self.crash: str | None = None
        self.interrupted = False
        self.t0 = time.monotonic()
        self.proc = psutil.Process(srv.pid)

    # --- prompts ---

    def haystack(self, rng: random.Random, tokens: int, needles: list[tuple[str, str]], shared: bool) -> str:
        n = max(20, int(tokens / self.tps))
        start = 0 if shared else rng.randrange(len(FILLER))
        sentences = [FILLER[(start + i) % len(FILLER)] for i in range(n)]
        if not shared:
            sentences.insert(0, f"Archive record {rng.randrange(10**6)}.")
        for key, value in needles:
            sentences.insert(rng.randint(int(n * 0.1), int(n * 0.9)), f"The secret code for {key} is {value}. "
                             "Remember it.")
        return " ".join(sentences)

    @staticmethod
    def question(key: str) -> str:
        return f"What is the secret code for {key}? Answer with the number only."

    def chat(self, http: httpx.Client, messages: list[dict], max_tokens: int = 24, model: str | None = None,
             ) -> httpx.Response:
        return http.post("/v1/chat/completions", json={
            "model": model or self.srv.model_id, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "top_k": 1})

    # --- request kinds (each returns an Outcome) ---

    def run_long(self, http: httpx.Client, rng: random.Random, rid: int, out: Outcome) -> None:
        key, code = rng.choice(KEYS), self.codes.new(rid)
        text = self.haystack(rng, rng.randint(4000, 7000), [(key, code)], shared=rng.random() < 0.5)
        resp = self.chat(http, [{"role": "user", "content": f"{text}\n\n{self.question(key)}"}])
        self.answered(resp, out, rid, [code])

    def run_followup(self, http: httpx.Client, rng: random.Random, rid: int, out: Outcome) -> None:
        first, second = rng.sample(KEYS, 2)
        codes = [self.codes.new(rid), self.codes.new(rid)]
        text = self.haystack(rng, rng.randint(4000, 6500), [(first, codes[0]), (second, codes[1])], shared=False)
        messages = [{"role": "user", "content": f"{text}\n\n{self.question(first)}"}]
        resp = self.chat(http, messages)
        self.answered(resp, out, rid, [codes[0]])
        if not out.ok:
            return
        messages += [{"role": "assistant", "content": out.answer},
                     {"role": "user", "content": f"And {self.question(second)[0].lower()}{self.question(second)[1:]}"}]
        turn1 = out.answer
        resp = self.chat(http, messages)
        self.answered(resp, out, rid, [codes[1]])
        out.answer = f"{turn1} || {out.answer}"

    def run_short(self, http: httpx.Client, rng: random.Random, rid: int, out: Outcome) -> None:
        resp = self.chat(http, [{"role": "user", "content": rng.choice(SHORT)}], max_tokens=32)
        self.answered(resp, out, rid, [])

    def run_cancel(self, http: httpx.Client, rng: random.Random, rid: int, out: Outcome) -> None:
        max_tokens = rng.choice([64, 128, 200])
        body = {"model": self.srv.model_id, "stream": True, "max_tokens": max_tokens, "temperature": 0.7,
                "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]}
        chunks, text = 0, []
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = resp.read().decode(errors="replace")[:200]
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
                text.append(delta)
                chunks += 1
                if chunks >= max_tokens // 2:
                    break  # closing the stream here cancels the rest
        out.answer = "".join(text)
        out.cross_slot = self.codes.foreign(out.answer, rid)
        out.ok = chunks > 0

    def run_hangup(self, http: httpx.Client, rng: random.Random, rid: int, out: Outcome) -> None:
        key, code = rng.choice(KEYS), self.codes.new(rid)
        text = self.haystack(rng, rng.randint(4000, 7000), [(key, code)], shared=False)
        body = json.dumps({"model": self.srv.model_id, "max_tokens": 24,
                           "messages": [{"role": "user", "content": f"{text}\n\n{self.question(key)}"}]}).encode()
        host, port = self.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(rng.uniform(0.5, 5.0))
        out.ok = True  # what matters is that the server goes on (checked by everything after it)

    def run_wrong(self, http: httpx.Client, rng: random.Random, rid: int, out: Outcome) -> None:
        resp = self.chat(http, [{"role": "user", "content": "hi"}], model=rng.choice(["gpt-4o", "qwen27b", "x"]))
        out.status = resp.status_code
        out.ok = resp.status_code == 404
        out.answer = resp.text[:200]

    def run_overlong(self, http: httpx.Client, rng: random.Random, rid: int, out: Outcome) -> None:
        text = self.haystack(rng, int(self.slot_ctx * 1.15), [], shared=False)
        resp = self.chat(http, [{"role": "user", "content": text}])
        out.status = resp.status_code
        out.ok = resp.status_code == 400 and "exceed" in resp.text
        out.answer = resp.text[:200]

    def answered(self, resp: httpx.Response, out: Outcome, rid: int, codes: list[str]) -> None:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.ok, out.error = False, resp.text[:300]
            return
        data = resp.json()
        out.answer = data["choices"][0]["message"].get("content") or ""
        out.prompt_tokens = max(out.prompt_tokens or 0, data.get("usage", {}).get("prompt_tokens", 0))
        out.needles += len(codes)
        out.found += sum(c in out.answer for c in codes)
        out.cross_slot += self.codes.foreign(out.answer, rid)
        out.ok = bool(out.answer.strip())  # a 200 with an empty answer is not a success

    # --- clients ---

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        kinds, weights = list(KINDS), list(KINDS.values())
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT, trust_env=False,
                          headers=self.srv.headers) as http:
            while not self.stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.5)
                    continue
                kind = rng.choices(kinds, weights)[0]
                with self.lock:
                    if self.paused.is_set() or self.stop.is_set():
                        continue
                    self.requests += 1
                    rid = self.requests
                    self.in_flight += 1
                out = Outcome(kind, index, time.monotonic() - self.t0, 0.0, False)
                t = time.monotonic()
                try:
                    getattr(self, f"run_{kind}")(http, rng, rid, out)
                except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
                    out.ok, out.error = False, f"{type(exc).__name__}: {exc}"[:300]
                    out.cut = self.interrupted
                finally:
                    out.seconds = time.monotonic() - t
                    with self.lock:
                        self.in_flight -= 1
                        self.outcomes.append(out)
                if kind in EXPECTED_STATUS and out.ok is False and out.error is None:
                    out.error = f"expected HTTP {EXPECTED_STATUS[kind]}, got {out.status}: {out.answer[:120]}"
                self.log(f"client {index} {kind:8s} {'ok ' if out.ok else 'FAIL'} {out.seconds:6.1f}s "
                         f"status={out.status} tokens={out.prompt_tokens} needles={out.found}/{out.needles}"
                         + (f" cross={out.cross_slot}" if out.cross_slot else "")
                         + (f" error={out.error}" if out.error else ""))

    # --- sampling ---

    def sample(self, label: str = "") -> dict[str, Any]:
        row: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1), "label": label}
        try:
            with self.proc.oneshot():
                row.update(rss=self.proc.memory_info().rss, fds=self.proc.num_fds(), threads=self.proc.num_threads(),
                           cpu_s=round(sum(self.proc.cpu_times()[:2]), 1))
        except psutil.Error as exc:
            self.crash = self.crash or f"server process gone: {exc} (exit code {self.srv.returncode()})"
            return row
        try:
            with httpx.Client(base_url=self.url, timeout=30, trust_env=False, headers=self.srv.headers) as http:
                metrics = http.get("/metrics").text
                slots = http.get("/slots").json()
            row["metrics"] = {m[1]: float(m[2]) for m in re.finditer(r"^llamacpp:(\w+) (\S+)$", metrics, re.M)}
            row["slots"] = [{"id": s["id"], "busy": s["is_processing"], **(s.get("kvmem") or {})} for s in slots]
        except (httpx.HTTPError, ValueError) as exc:
            row["http_error"] = f"{type(exc).__name__}: {exc}"
        with self.lock:
            row["in_flight"], row["requests"] = self.in_flight, self.requests
        self.samples.append(row)
        return row

    def sampler(self) -> None:
        while not self.stop.wait(self.args.interval):
            row = self.sample()
            if self.srv.returncode() is not None:
                self.crash = f"llama-server exited with code {self.srv.returncode()}"
                self.stop.set()
            m = row.get("metrics", {})
            self.log(f"[{row['t']:7.1f}s] rss {row.get('rss', 0) / 2**20:7.1f} MiB fds {row.get('fds')} threads "
                     f"{row.get('threads')} host_blocks {m.get('kvmem_blocks_host')} gpu_blocks "
                     f"{m.get('kvmem_blocks_gpu')} selections {m.get('kvmem_selections_total')} in_flight "
                     f"{row.get('in_flight')} done {len(self.outcomes)}")

    def idle_checkpoint(self, label: str) -> None:
        """Pause the clients, wait for idle slots, check the pool's accounting, erase, check the baseline."""
        self.paused.set()
        self.log(f"checkpoint {label}: pausing the clients")
        deadline = time.monotonic() + self.args.idle_timeout
        while time.monotonic() < deadline and self.crash is None:
            with self.lock:
                busy = self.in_flight
            row = self.sample(f"{label}: waiting")
            if busy == 0 and not any(s.get("busy") for s in row.get("slots", [{"busy": True}])):
                break
            time.sleep(2)
        idle = self.sample(f"{label}: idle")
        m = idle.get("metrics", {})
        per_slot = sum(s.get("blocks_host", 0) for s in idle.get("slots", []))
        erased = self.erase_slots()
        time.sleep(1)
        after = self.sample(f"{label}: erased")
        ma = after.get("metrics", {})
        point = {
            "label": label, "t": after["t"], "idle": not any(s.get("busy") for s in idle.get("slots", [])),
            "host_blocks_idle": m.get("kvmem_blocks_host"), "slot_blocks_idle": per_slot,
            "host_blocks_erased": ma.get("kvmem_blocks_host"), "host_bytes_erased": ma.get("kvmem_host_bytes"),
            "erase_status": erased, "rss_erased": after.get("rss"),
        }
        point["ok"] = (point["idle"] and point["host_blocks_idle"] == per_slot and point["host_blocks_erased"] == 0
                       and point["host_bytes_erased"] == 0 and all(code == 200 for code in erased))
        self.checkpoints.append(point)
        self.log(f"checkpoint {label}: {point}")
        self.paused.clear()

    def log(self, line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    def erase_slots(self) -> list[int]:
        """POST /slots/ID?action=erase for every slot (needs --slot-save-path): the slot's KV is dropped."""
        with httpx.Client(base_url=self.url, timeout=60, trust_env=False, headers=self.srv.headers) as http:
            ids = [s["id"] for s in http.get("/slots").json()]
            return [http.post(f"/slots/{i}", params={"action": "erase"}).status_code for i in ids]

    def run(self) -> None:
        self.erase_slots()  # the readiness self-test left its prompt in a slot: start from an empty pool
        baseline = self.sample("baseline")
        self.log(f"baseline: rss {baseline.get('rss', 0) / 2**20:.1f} MiB, host blocks "
                 f"{baseline.get('metrics', {}).get('kvmem_blocks_host')}")
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.args.clients)]
        threads.append(threading.Thread(target=self.sampler, daemon=True))
        for t in threads:
            t.start()
        end = self.t0 + self.args.duration
        next_idle = self.t0 + self.args.idle_every
        while time.monotonic() < end and self.crash is None:
            time.sleep(1)
            if time.monotonic() >= next_idle and end - time.monotonic() > self.args.idle_every / 3:
                self.idle_checkpoint(f"{(time.monotonic() - self.t0) / 60:.0f} min")
                next_idle = time.monotonic() + self.args.idle_every
        self.log("duration reached: no new requests; waiting for those in flight")
        if self.crash is None:
            self.idle_checkpoint("end")
        self.stop.set()
        for t in threads:
            t.join(5)


# --- report ---


def summarize(soak: Soak, args: argparse.Namespace, command: str, wall_s: float) -> dict[str, Any]:
    outcomes = soak.outcomes
    kinds: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        rows = [o for o in outcomes if o.kind == kind]
        secs = sorted(o.seconds for o in rows)
        kinds[kind] = {
            "requests": len(rows), "ok": sum(o.ok for o in rows), "failed": sum(not o.ok and not o.cut for o in rows),
            "p50_s": round(statistics.median(secs), 1) if secs else None,
            "max_s": round(secs[-1], 1) if secs else None,
            "needles": sum(o.needles for o in rows), "found": sum(o.found for o in rows),
            "prompt_tokens": [min((o.prompt_tokens for o in rows if o.prompt_tokens), default=None),
                              max((o.prompt_tokens for o in rows if o.prompt_tokens), default=None)],
        }
    warm = [s for s in soak.samples if "rss" in s and s["t"] >= args.warmup]
    rss_warm = warm[0]["rss"] if warm else None
    rss_max = max((s["rss"] for s in warm), default=None)
    growth = (rss_max - rss_warm) / rss_warm if rss_warm and rss_max else None
    # pool pages, once touched, stay resident: RSS minus the host pool's high-water mark is what a leak would move
    high = 0.0
    for s in soak.samples:
        high = max(high, s.get("metrics", {}).get("kvmem_host_bytes", 0.0))
        if "rss" in s:
            s["rss_minus_pool_high_water"] = s["rss"] - high
    other = [s["rss_minus_pool_high_water"] for s in warm]
    other_growth = (max(other) - other[0]) / other[0] if other and other[0] > 0 else None
    pool_high = max((s.get("metrics", {}).get("kvmem_host_bytes", 0.0) for s in soak.samples), default=0.0)
    first, last = soak.samples[0], soak.samples[-1]
    cross = [(o.kind, o.cross_slot) for o in outcomes if o.cross_slot]
    failed = [asdict(o) for o in outcomes if not o.ok and not o.cut]
    criteria = {
        "ran_the_full_duration": not soak.interrupted and soak.crash is None,
        "no_failed_requests": not failed,
        "no_crash": soak.crash is None,
        "rss_growth_after_warmup_le_5pct": growth is not None and growth <= 0.05,
        "host_pool_back_at_baseline_when_idle": bool(soak.checkpoints) and all(c["ok"] for c in soak.checkpoints),
        "no_cross_slot_text": not cross,
    }
    return {
        "command": command, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": round(wall_s, 1), "server_argv": soak.srv.argv, "notes": soak.srv.notes,
        "interrupted": soak.interrupted,
        "engine": soak.srv.engine.key if soak.srv.engine else None,
        "machine": {"cpus": os.cpu_count(), "load_avg_end": os.getloadavg()},
        "kinds": kinds, "requests": len(outcomes),
        "needle_accuracy": _ratio(sum(k["found"] for k in kinds.values()), sum(k["needles"] for k in kinds.values())),
        "rss": {"baseline": first.get("rss"), "at_warmup_end": rss_warm, "max_after_warmup": rss_max,
                "end": last.get("rss"), "growth_after_warmup": growth, "pool_high_water_bytes": pool_high,
                "minus_pool_high_water_growth_after_warmup": other_growth},
        "fds": {"baseline": first.get("fds"), "end": last.get("fds"),
                "max": max((s.get("fds", 0) for s in soak.samples), default=None)},
        "threads": {"baseline": first.get("threads"), "end": last.get("threads"),
                    "max": max((s.get("threads", 0) for s in soak.samples), default=None)},
        "checkpoints": soak.checkpoints, "crash": soak.crash, "cross_slot": cross, "failed": failed,
        "criteria": criteria, "passed": all(criteria.values()),
        "samples": soak.samples, "outcomes": [asdict(o) for o in outcomes],
    }


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 3) if b else None


def markdown(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [f"Command: `{result['command']}`", "",
             f"Engine {result['engine']}; server flags: `{_server_flags(result['server_argv'])}`", "",
             f"Wall time {result['wall_s'] / 60:.1f} min, {result['requests']} requests, "
             f"{result['machine']['cpus']} CPUs (load average at the end "
             f"{', '.join(f'{x:.1f}' for x in result['machine']['load_avg_end'])}).", "",
             "| kind | requests | as expected | failed | p50 s | max s | needles found | prompt tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for kind, k in result["kinds"].items():
        needles = f"{k['found']}/{k['needles']}" if k["needles"] else "-"
        toks = "-" if k["prompt_tokens"][0] is None else f"{k['prompt_tokens'][0]:,}-{k['prompt_tokens'][1]:,}"
        lines.append(f"| {kind} | {k['requests']} | {k['ok']} | {k['failed']} | {k['p50_s'] or '-'} | "
                     f"{k['max_s'] or '-'} | {needles} | {toks} |")
    rss, fds, thr = result["rss"], result["fds"], result["threads"]
    growth = rss["growth_after_warmup"]
    lines += ["", "| measure | value |", "|---|---|",
              f"| RSS baseline / at warm-up end / max after / end | {_mib(rss['baseline'], mib)} / "
              f"{_mib(rss['at_warmup_end'], mib)} / {_mib(rss['max_after_warmup'], mib)} / {_mib(rss['end'], mib)} |",
              f"| RSS growth after warm-up | {growth * 100:+.2f} % |" if growth is not None else
              "| RSS growth after warm-up | n/a |",
              f"| host pool high-water mark (bytes in use) | {_mib(rss['pool_high_water_bytes'], mib)} |",
              "| RSS minus that high-water mark, growth after warm-up | "
              + (f"{rss['minus_pool_high_water_growth_after_warmup'] * 100:+.2f} % |"
                 if rss["minus_pool_high_water_growth_after_warmup"] is not None else "n/a |"),
              f"| open fds baseline / max / end | {fds['baseline']} / {fds['max']} / {fds['end']} |",
              f"| threads baseline / max / end | {thr['baseline']} / {thr['max']} / {thr['end']} |",
              f"| needle accuracy (long + follow-up turns) | {result['needle_accuracy']} |"]
    for c in result["checkpoints"]:
        lines.append(f"| idle checkpoint {c['label']} | host blocks {c['host_blocks_idle']} = slots' "
                     f"{c['slot_blocks_idle']}; after erase {c['host_blocks_erased']} blocks, "
                     f"{c['host_bytes_erased']} bytes; RSS {_mib(c['rss_erased'], mib)} |")
    lines += ["", "| criterion | result |", "|---|---|"]
    lines += [f"| {name.replace('_', ' ')} | {'PASS' if ok else 'FAIL'} |" for name, ok in result["criteria"].items()]
    if result["interrupted"]:
        lines.append(f"\nInterrupted after {result['wall_s'] / 60:.1f} min, before --duration ended.")
    if result["crash"]:
        lines.append(f"\nCrash: {result['crash']}")
    for f in result["failed"][:10]:
        lines.append(f"\nFailed: {f['kind']} at {f['t_start']:.0f} s: {f['error']}")
    return "\n".join(lines) + "\n"


def _server_flags(argv: list[str]) -> str:
    """The flags that shape the run (not the paths, the port or the sampling profile)."""
    keep = ("-c", "-np", "--kv-unified", "--kvmem-budget", "--kvmem-block", "--kvmem-sink", "--kvmem-recent", "-t",
            "--threads-http", "--metrics")
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg in keep:
            takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("-")
            out += [arg, argv[i + 1]] if takes_value else [arg]
    return " ".join(out)


def _mib(value: float | None, mib: int) -> str:
    return "-" if value is None else f"{value / mib:.1f} MiB"


def plot(result: dict[str, Any], path: Path) -> str | None:
    plt = plots.pyplot()
    if plt is None:
        return plots.skipped(f"{path.name}")
    samples = [s for s in result["samples"] if "rss" in s]
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, [s["rss"] / 2**20 for s in samples], color="tab:blue", label="RSS")
    axes[0].plot(t, [s.get("rss_minus_pool_high_water", 0) / 2**20 for s in samples], color="tab:purple",
                 label="RSS minus the host pool's high-water mark")
    axes[0].set_ylabel("MiB")
    axes[0].legend(loc="upper left")
    axes[0].axvline(result["args"]["warmup"] / 60, color="gray", ls="--", lw=0.8)
    axes[1].plot(t, [s["fds"] for s in samples], label="open fds", color="tab:orange")
    axes[1].plot(t, [s["threads"] for s in samples], label="threads", color="tab:green")
    axes[1].legend(loc="upper left")
    axes[2].plot(t, [s.get("metrics", {}).get("kvmem_blocks_host") for s in samples], label="host pool blocks")
    axes[2].plot(t, [s.get("metrics", {}).get("kvmem_blocks_gpu") for s in samples], label="working-set blocks")
    axes[2].plot(t, [s.get("in_flight") for s in samples], label="requests in flight", ls=":")
    axes[2].legend(loc="upper left")
    axes[2].set_xlabel("minutes")
    for c in result["checkpoints"]:
        for ax in axes:
            ax.axvline(c["t"] / 60, color="red", ls=":", lw=0.8)
    fig.suptitle("kvmem soak: SmolLM2-135M, tiering on, -np 4 --kv-unified (red: idle checkpoints)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --- main ---


def calibrate(srv: ServerHandle) -> tuple[float, int]:
    """Tokens per filler sentence (the server's tokenizer) and the context of one slot."""
    text = " ".join(FILLER[i % len(FILLER)] for i in range(500))
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False, headers=srv.headers) as http:
        tokens = len(http.post("/tokenize", json={"content": text}).json()["tokens"])
        slot_ctx = int(http.get("/slots").json()[0]["n_ctx"])
    return tokens / 500, slot_ctx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=1800, help="seconds of load (default 30 min)")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (4-8)")
    ap.add_argument("--budget", type=int, default=1536, help="--kvmem-budget in tokens (prompts are 4-7K)")
    ap.add_argument("--block", type=int, default=64, help="--kvmem-block")
    ap.add_argument("--sink", type=int, default=64, help="--kvmem-sink")
    ap.add_argument("--recent", type=int, default=128, help="--kvmem-recent")
    ap.add_argument("--ctx", type=int, default=32768, help="-c: the unified KV of the 4 slots")
    ap.add_argument("--interval", type=float, default=10, help="sampling interval, s")
    ap.add_argument("--warmup", type=float, default=None,
                    help="RSS growth is measured from here, s (default: a third of --duration)")
    ap.add_argument("--idle-every", type=float, default=900, help="an idle checkpoint every N s (and at the end)")
    ap.add_argument("--idle-timeout", type=float, default=1200, help="how long a checkpoint waits for idle slots")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--engine", help="engine key (default: the one `kvmem run` picks)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "reliability")
    args = ap.parse_args(argv)
    if not 1 <= args.clients <= 32:
        ap.error("--clients: 1-32")
    return args


def _sigterm(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    command = shlex.join(["python", "benchmarks/soak.py", *(sys.argv[1:] if argv is None else argv)])
    if args.warmup is None:
        args.warmup = args.duration / 3
    slot_dir = tempfile.mkdtemp(prefix="kvmem-soak-slots-")  # --slot-save-path enables POST /slots/ID?action=erase
    extra = ["-np", "4", "--kv-unified", "--kvmem-budget", str(args.budget), "--kvmem-block", str(args.block),
             "--kvmem-sink", str(args.sink), "--kvmem-recent", str(args.recent), "--metrics", "-t", str(args.threads),
             "--threads-http", str(args.clients + 4), "--slot-save-path", slot_dir]
    t_start = time.monotonic()
    try:
        # no readiness self-test: its one needle is the soak's first of many, and a miss of the 135M model there
        # (seen once: "The vault code is a mathematical formula ...") would end the soak before it starts
        srv = launch.start_server(None, ctx=args.ctx, extra_args=extra, ready_timeout=900, name="soak", mode="chat",
                                  engine=args.engine, hw=hardware.detect(vram="0"), self_test=False)
    except KvmemError as exc:
        print(f"error: {exc}" + (f"\nhint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return 2
    print(f"server {srv.url} pid {srv.pid} log {srv.log_path}\n  {shlex.join(srv.argv)}", flush=True)
    for note in srv.notes:
        print(f"note: {note}", flush=True)
    try:
        tps, slot_ctx = calibrate(srv)
        soak = Soak(srv, args, tps, slot_ctx)
        soak.log(f"{tps:.2f} tokens per filler sentence, {slot_ctx} tokens per slot; self-test: {srv.self_test}")
        try:
            soak.run()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop here and still write what was measured
            soak.interrupted = True
            soak.stop.set()
            soak.log("interrupted: writing the results so far")
        exit_code = srv.returncode()
    finally:
        srv.stop()
    result = summarize(soak, args, command, time.monotonic() - t_start)
    result["server_exit_code_before_stop"] = exit_code
    result["server_log"] = str(srv.log_path)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, separators=(",", ":"), default=str) + "\n")
    (args.out / "soak.md").write_text(markdown(result))
    hint = plot(result, args.out / "soak.png")
    print(markdown(result))
    print(hint or f"wrote {args.out / 'soak.png'}")
    print(f"wrote {args.out / 'soak.json'}, {args.out / 'soak.md'}: {'PASS' if result['passed'] else 'FAIL'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

