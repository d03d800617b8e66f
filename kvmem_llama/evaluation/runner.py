"""Running an evaluation: the plan, the samples, one JSON line per answered sample, resuming.

Results go to `OUT/results.jsonl`, one line per sample, flushed as soon as it is scored, so
an interrupted run loses at most the sample in flight; running the same command again skips
every (configuration, task, length, depth, sample, seed) already in the file.

With the server's log at hand (`--run`, or `--server-log` for an endpoint) each sample also
records where its answer sits in the KV cache (token positions, blocks) and whether the
tiering engine had those blocks resident after the turn's selection (`--kvmem-trace` lines).
With `jobs` > 1 several configurations (servers) run at once, one thread each; a lock keeps
every results line whole.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation import corpus
from kvmem_llama.evaluation.client import Completion, EvalClient
from kvmem_llama.evaluation.records import ResultsLog, ServerLog, trace_fields
from kvmem_llama.evaluation.scoring import score
from kvmem_llama.evaluation.servers import Config, serve, training_context
from kvmem_llama.evaluation.tasks import TASKS, Sample, fit_sample


@dataclass(frozen=True)
class Item:
    task: str
    length: int
    depth: int | None
    index: int


@dataclass
class Plan:
    tasks: list[str]
    lengths: list[int]
    depths: list[int]
    samples: int
    seed: int

    def items(self, lengths: list[int] | None = None) -> list[Item]:
        out: list[Item] = []
        for length in lengths or self.lengths:
            for task in self.tasks:
                # deepest first: the depths of one sample share the haystack up to the needle, so a
                # server's prompt cache reuses the longest prefix in this order
                if TASKS[task].uses_depth:
                    depths: list[int | None] = sorted(self.depths, reverse=True)
                    for i in range(self.samples):
                        out.extend(Item(task, length, depth, i) for depth in depths)
                else:  # as many samples per cell as a depth task gets: samples x depths
                    out.extend(Item(task, length, None, i) for i in range(self.samples * len(self.depths)))
        return out

    def max_output(self) -> int:
        return max(TASKS[t].max_tokens for t in self.tasks)


class Reporter(Protocol):
    """What a front end (the CLI's progress bar) hears about."""

    def begin(self, total: int, done: int) -> None: ...
    def server(self, config: str, length: int | None, url: str | None) -> None: ...
    def sample(self, item: Item, config: str) -> None: ...
    def result(self, record: dict) -> None: ...


class SilentReporter:
    def begin(self, total: int, done: int) -> None:
        pass

    def server(self, config: str, length: int | None, url: str | None) -> None:
        pass

    def sample(self, item: Item, config: str) -> None:
        pass

    def result(self, record: dict) -> None:
        pass


def _check_budgets(work: list[ServerJob]) -> None:
    """A budget the engine would refuse stops the run before any server starts (not after the others' results)."""
    small = [(job.config, n) for job in work if not job.config.off for n in job.lengths
             if job.config.budget_tokens(n) < job.config.min_budget()]
    if small:
        cells = ", ".join(f"{c.label} at {n} ({c.budget_tokens(n)} tokens)" for c, n in small)
        least = max(c.min_budget() for c, _ in small)
        raise KvmemError(f"a KV budget is too small for the engine: {cells}; it needs at least {least} tokens "
                         "(the sink and the recent window in whole blocks, one retrieved block and the partial tail)",
                         hint="use a larger budget for those lengths, longer lengths, or a second run for them")


@dataclass(frozen=True)
class ServerJob:
    """One server of a `--run`: a configuration at the lengths it serves."""

    index: int
    config: Config
    lengths: list[int]

    @property
    def budget_length(self) -> int:
        return self.lengths[0] if self.config.per_length else max(self.lengths)


@dataclass
class Evaluation:
    plan: Plan
    out_dir: Path
    reporter: Reporter = field(default_factory=SilentReporter)

    def __post_init__(self) -> None:
        self.log = ResultsLog(self.out_dir)
        self._samples: dict[Item, Sample] = {}  # the same prompts for every configuration
        self._fit_locks: dict[Item, threading.Lock] = {}
        self._hints: dict[tuple[str, int, int], int] = {}  # haystack size per (task, length, index)
        self._positions: dict[str, list[int] | None] = {}  # rendered prompt digest -> answer token positions
        self._lock = threading.Lock()
        self._n_ctx_train: int | None = None  # of the --run model

    def sample(self, client: EvalClient, item: Item) -> Sample:
        with self._lock:
            lock = self._fit_locks.setdefault(item, threading.Lock())
        with lock:  # two servers needing the same sample fit it once
            if item not in self._samples:
                hint = self._hints.get((item.task, item.length, item.index))
                s = fit_sample(item.task, item.length, item.depth, item.index, self.plan.seed, client.count_tokens,
                               hint=hint)
                self._hints[(item.task, item.length, item.index)] = s.units
                self._samples[item] = s
            return self._samples[item]

    def answer_positions(self, client: EvalClient, messages: list[dict], s: Sample) -> list[int] | None:
        """Token positions of the answers in the prompt the server builds from `messages` (None: unknown)."""
        if not s.answer_offsets:
            return None
        rendered = client.apply_template(messages)
        if rendered is None:
            return None
        key = hashlib.sha256(rendered.encode("utf-8")).hexdigest()
        if key not in self._positions:
            base = rendered.rfind(s.prompt)  # the scored user turn, as the template placed it
            if base < 0:
                self._positions[key] = None
            else:
                self._positions[key] = client.token_index(rendered, [base + o for o in s.answer_offsets])
        return self._positions[key]

    def run_one(self, client: EvalClient, item: Item, config: str, meta: dict,
                server_log: ServerLog | None = None) -> dict:
        self.reporter.sample(item, config)
        s = self.sample(client, item)
        messages: list[dict] = []
        earlier: list[Completion] = []
        multi = bool(s.history)
        for turn in s.history:  # niah_followup: document A first; its answer becomes part of the chat
            messages.append({"role": "user", "content": turn})
            before = server_log.size() if server_log is not None else 0
            first = client.chat_messages(messages, s.history_max_tokens, seed=self.plan.seed, cache_prompt=True)
            if server_log is not None:
                server_log.segment(before)  # let its trailing lines land: they are not the scored turn's
            earlier.append(first)
            messages.append({"role": "assistant", "content": first.text})
        messages.append({"role": "user", "content": s.prompt})
        start = server_log.size() if server_log is not None else 0
        answer = client.chat_messages(messages, s.max_tokens, seed=self.plan.seed,
                                      cache_prompt=True if multi else None)
        segment = server_log.segment(start) if server_log is not None else None
        record = {
            "task": s.task, "length": s.length, "depth": s.depth, "sample": s.index, "seed": s.seed,
            "config": config, **meta,
            "expected": s.expected, "got": answer.text, "score": score(s.expected, answer.text, s.answer_pool),
            "latency_s": round(answer.latency_s, 3),
            "prompt_tokens": s.tokens, "server_prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens, "cached_tokens": answer.cached_tokens,
            "finish_reason": answer.finish_reason,
            "haystack_units": s.units,
        }
        if earlier:
            record["earlier_answers"] = [c.text for c in earlier]
            record["earlier_latency_s"] = [round(c.latency_s, 3) for c in earlier]
            record["earlier_prompt_tokens"] = [c.prompt_tokens for c in earlier]
        positions = self.answer_positions(client, messages, s)
        record["answer_positions"] = positions
        block_tokens = server_log.block_tokens() if server_log is not None else None
        if segment is not None:
            record.update(trace_fields(segment, block_tokens, positions))
        else:
            record.update({"answer_blocks": None, "turn_resident_hit": None, "answer_rank": None, "selects": None,
                           "selects_hit": None, "staged_in": None})
        record["block_tokens"] = block_tokens
        record["time"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        record["python"] = corpus.corpus_info()["python"]
        self.log.append(record)
        self.reporter.result(record)
        return record

    def _pending(self, config: str, lengths: list[int] | None = None) -> list[Item]:
        return [it for it in self.plan.items(lengths) if not self.log.is_done(config, it, self.plan.seed)]

    def _check_context(self, client: EvalClient) -> None:
        n_ctx = client.context_size()
        need = max(self.plan.lengths) + self.plan.max_output() + 64  # + chat template
        if n_ctx is not None and n_ctx < need:
            raise KvmemError(f"the server's context is {n_ctx} tokens; these lengths need about {need}",
                             hint=f"start the server with -c {need} or more, or lower --lengths")

    def run_endpoint(self, client: EvalClient, config: str, meta: dict | None = None,
                     server_log: Path | None = None) -> Iterator[dict]:
        """Every pending sample against one already running endpoint (`server_log`: its log file, if known)."""
        pending = self._pending(config)
        total = len(self.plan.items())
        self.reporter.begin(total, total - len(pending))
        if not pending:
            return
        self._check_context(client)
        info = {"budget": None, "method": None, "model": client.model, "endpoint": client.root, **(meta or {})}
        log = ServerLog(server_log) if server_log is not None else None
        for item in pending:
            yield self.run_one(client, item, config, info, log)

    def server_jobs(self, configs: list[Config]) -> list[ServerJob]:
        """The servers a `--run` needs for what is still pending, in configuration order."""
        jobs: list[ServerJob] = []
        for config in configs:
            groups = [[length] for length in self.plan.lengths] if config.per_length else [self.plan.lengths]
            for lengths in groups:
                if self._pending(config.label, lengths):
                    jobs.append(ServerJob(len(jobs), config, lengths))
        return jobs

    def _run_job(self, job: ServerJob, model: str, log_dir: Path, extra_args: list[str] | None, timeout: float,
                 stop: threading.Event, on_server: Callable[[Callable[[], None]], None] | None,
                 engine: str | None = None) -> Iterator[dict]:
        config, length = job.config, job.budget_length
        pending = self._pending(config.label, job.lengths)
        if not pending:
            return
        ctx = self._server_ctx(job.lengths)
        tag = re.sub(r"[^A-Za-z0-9._=-]+", "-", config.label.replace("/", "_"))
        log_path = log_dir / f"server-{tag}-{length}.log"
        # registered server names must differ between servers running at once (each has its own log)
        name = f"eval-{os.getpid()}-{job.index}-{re.sub(r'[^A-Za-z0-9]+', '-', config.label)[:32]}".rstrip("-")
        at = length if config.per_length else None
        self.reporter.server(config.label, at, None)
        with serve(model, config, length, ctx, log_path, extra_args, name=name, on_start=on_server,
                   engine=engine) as served:
            self.reporter.server(config.label, at, served.url)
            log = ServerLog(served.log_path, served.log_offset) if served.log_path is not None else None
            with EvalClient(served.url, served.model_id, timeout=timeout) as client:
                meta = {"budget": config.budget_text, "method": None if config.off else config.method,
                        "budget_tokens": config.budget_tokens(length) if not config.off else 0,
                        "engine_options": dict(config.options) or None, "model": model, "endpoint": served.url}
                for item in pending:
                    if stop.is_set():
                        return
                    yield self.run_one(client, item, config.label, meta, log)

    def _server_ctx(self, lengths: list[int], n_ctx_train: int | None = None) -> int:
        """The -c of a server for these lengths: prompt + answer + the chat template, rounded up.

        llama-server caps a slot at the model's training context (and readiness then refuses
        it as not the context asked for): the rounding headroom stops there.
        """
        need = max(lengths) + self.plan.max_output() + 64
        ctx = _round_up(need + 64, 256)
        limit = n_ctx_train if n_ctx_train is not None else self._n_ctx_train
        if limit and ctx > limit:
            if need > limit:
                raise KvmemError(f"the model's training context is {limit} tokens; a {max(lengths)}-token prompt "
                                 f"needs about {need} with the answer and the chat template",
                                 hint=f"use --lengths up to {limit - self.plan.max_output() - 64}")
            ctx = limit
        return ctx

    def run_configs(self, model: str, configs: list[Config], log_dir: Path,
                    extra_args: list[str] | None = None, timeout: float = 1800.0, jobs: int = 1,
                    engine: str | None = None) -> Iterator[dict]:
        """Start a server per configuration (per length when the budget is a fraction) and run it.

        `jobs` > 1 runs that many servers at once (one thread each, own port and log). The first
        error stops them all: the other servers are shut down, which ends their requests in flight.
        """
        total = len(self.plan.items()) * len(configs)
        pending_all = sum(len(self._pending(c.label)) for c in configs)
        self.reporter.begin(total, total - pending_all)
        work = self.server_jobs(configs)
        self._n_ctx_train = training_context(model) if work else None
        for job in work:  # a length the model cannot take stops the run before any server starts
            self._server_ctx(job.lengths)
        _check_budgets(work)
        stop = threading.Event()
        if jobs <= 1 or len(work) <= 1:
            for job in work:
                yield from self._run_job(job, model, log_dir, extra_args, timeout, stop, None, engine)
            return

        todo: queue.Queue[ServerJob] = queue.Queue()
        for job in work:
            todo.put(job)
        results: queue.Queue[tuple[str, object]] = queue.Queue()
        stoppers: list[Callable[[], None]] = []
        stoppers_lock = threading.Lock()

        def register(stop_server: Callable[[], None]) -> None:
            with stoppers_lock:
                stoppers.append(stop_server)
            if stop.is_set():  # started while the run was being stopped
                stop_server()

        def worker() -> None:
            try:
                while not stop.is_set():
                    try:
                        job = todo.get_nowait()
                    except queue.Empty:
                        break
                    for record in self._run_job(job, model, log_dir, extra_args, timeout, stop, register, engine):
                        results.put(("record", record))
            except BaseException as exc:  # handed to the main thread, which re-raises the first one
                results.put(("error", exc))
            finally:
                results.put(("done", None))

        threads = [threading.Thread(target=worker, name=f"kvmem-eval-{i}", daemon=True)
                   for i in range(min(jobs, len(work)))]
        for t in threads:
            t.start()
        running = len(threads)
        try:
            while running:
                try:
                    kind, value = results.get(timeout=0.5)
                except queue.Empty:
                    continue
                if kind == "done":
                    running -= 1
                elif kind == "error":
                    if not stop.is_set():
                        raise value  # type: ignore[misc]
                else:
                    yield value  # type: ignore[misc]
        finally:
            if running:
                stop.set()
                with stoppers_lock:
                    for stop_server in stoppers:
                        with contextlib.suppress(Exception):
                            stop_server()
                for t in threads:
                    t.join(timeout=30)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
