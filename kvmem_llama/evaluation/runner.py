"""Running an evaluation: the plan, the samples, one JSON line per answered sample, resuming.

Results go to `OUT/results.jsonl`, one line per sample, flushed as soon as it is scored, so
an interrupted run loses at most the sample in flight; running the same command again skips
every (configuration, task, length, depth, sample, seed) already in the file.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation import corpus
from kvmem_llama.evaluation.client import EvalClient
from kvmem_llama.evaluation.scoring import score
from kvmem_llama.evaluation.servers import Config, serve
from kvmem_llama.evaluation.tasks import TASKS, Sample, fit_sample

RESULTS = "results.jsonl"


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
                depths: list[int | None] = sorted(self.depths, reverse=True) if TASKS[task].uses_depth else [None]
                for i in range(self.samples):
                    out.extend(Item(task, length, depth, i) for depth in depths)
        return out

    def max_output(self) -> int:
        return max(TASKS[t].max_tokens for t in self.tasks)


def record_key(config: str, task: str, length: int, depth: int | None, sample: int, seed: int) -> tuple:
    return (config, task, int(length), None if depth is None else int(depth), int(sample), int(seed))


def load_records(out_dir: Path) -> list[dict]:
    """Every well-formed line of OUT/results.jsonl (a torn last line from a kill is skipped)."""
    path = Path(out_dir) / RESULTS
    if not path.exists():
        return []
    records = []
    for line in path.read_text("utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "score" in rec:
            records.append(rec)
    return records


class ResultsLog:
    """Append-only JSONL writer that knows what is already done."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / RESULTS
        self.done = {record_key(r["config"], r["task"], r["length"], r.get("depth"), r["sample"], r["seed"])
                     for r in load_records(self.out_dir)}
        self._repair_tail()

    def _repair_tail(self) -> None:
        # a run killed mid-write leaves a partial line; end it so the next record starts clean
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb+") as fh:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def is_done(self, config: str, item: Item, seed: int) -> bool:
        return record_key(config, item.task, item.length, item.depth, item.index, seed) in self.done

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.done.add(record_key(record["config"], record["task"], record["length"], record.get("depth"),
                                 record["sample"], record["seed"]))


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


@dataclass
class Evaluation:
    plan: Plan
    out_dir: Path
    reporter: Reporter = field(default_factory=SilentReporter)

    def __post_init__(self) -> None:
        self.log = ResultsLog(self.out_dir)
        self._samples: dict[Item, Sample] = {}  # the same prompts for every configuration

    def sample(self, client: EvalClient, item: Item) -> Sample:
        if item not in self._samples:
            self._samples[item] = fit_sample(item.task, item.length, item.depth, item.index, self.plan.seed,
                                             client.count_tokens)
        return self._samples[item]

    def run_one(self, client: EvalClient, item: Item, config: str, meta: dict) -> dict:
        self.reporter.sample(item, config)
        s = self.sample(client, item)
        answer = client.chat(s.prompt, s.max_tokens, seed=self.plan.seed)
        record = {
            "task": s.task, "length": s.length, "depth": s.depth, "sample": s.index, "seed": s.seed,
            "config": config, **meta,
            "expected": s.expected, "got": answer.text, "score": score(s.expected, answer.text, s.answer_pool),
            "latency_s": round(answer.latency_s, 3),
            "prompt_tokens": s.tokens, "server_prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens, "cached_tokens": answer.cached_tokens,
            "finish_reason": answer.finish_reason,
            "haystack_units": s.units,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "python": corpus.corpus_info()["python"],
        }
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

    def run_endpoint(self, client: EvalClient, config: str, meta: dict | None = None) -> Iterator[dict]:
        """Every pending sample against one already running endpoint."""
        pending = self._pending(config)
        total = len(self.plan.items())
        self.reporter.begin(total, total - len(pending))
        if not pending:
            return
        self._check_context(client)
        info = {"budget": None, "method": None, "model": client.model, "endpoint": client.root, **(meta or {})}
        for item in pending:
            yield self.run_one(client, item, config, info)

    def run_configs(self, model: str, configs: list[Config], log_dir: Path,
                    extra_args: list[str] | None = None, timeout: float = 1800.0) -> Iterator[dict]:
        """Start a server per configuration (per length when the budget is a fraction) and run it."""
        total = len(self.plan.items()) * len(configs)
        pending_all = sum(len(self._pending(c.label)) for c in configs)
        self.reporter.begin(total, total - pending_all)
        ctx = _round_up(max(self.plan.lengths) + self.plan.max_output() + 128, 256)
        for config in configs:
            groups = [[length] for length in self.plan.lengths] if config.per_length else [self.plan.lengths]
            for lengths in groups:
                pending = self._pending(config.label, lengths)
                if not pending:
                    continue
                length_for_budget = lengths[0] if config.per_length else max(lengths)
                tag = config.label.replace("/", "_").replace(" ", "-")
                log_path = log_dir / f"server-{tag}-{length_for_budget}.log"
                self.reporter.server(config.label, length_for_budget if config.per_length else None, None)
                with serve(model, config, length_for_budget, ctx, log_path, extra_args) as (url, model_id):
                    self.reporter.server(config.label, length_for_budget if config.per_length else None, url)
                    with EvalClient(url, model_id, timeout=timeout) as client:
                        meta = {"budget": config.budget_text, "method": None if config.off else config.method,
                                "budget_tokens": config.budget_tokens(length_for_budget) if not config.off else 0,
                                "model": model, "endpoint": url}
                        for item in pending:
                            yield self.run_one(client, item, config.label, meta)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
