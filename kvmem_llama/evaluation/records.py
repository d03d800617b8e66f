"""What an evaluation run writes and reads: OUT/results.jsonl (one line per answered sample, written
at once, so a run resumes where it stopped) and the log of the server it asks (the part one request
appended, and the trace fields that say whether the answer's blocks were resident).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvmem_llama import kvmem_log

if TYPE_CHECKING:
    from kvmem_llama.evaluation.runner import Item

RESULTS = "results.jsonl"


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
    """Append-only JSONL writer that knows what is already done; safe to share between threads."""

    def __init__(self, out_dir: Path):
        self._lock = threading.Lock()
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
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:  # one line per write, never interleaved with another thread's
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            self.done.add(record_key(record["config"], record["task"], record["length"], record.get("depth"),
                                     record["sample"], record["seed"]))


# llama-server's line after a request's last token: everything that request logged is in by then
_REQUEST_DONE = re.compile(rb"stop processing|all slots are idle")


class ServerLog:
    """The log file one server writes; cuts out the bytes that one request appended."""

    def __init__(self, path: Path, start: int = 0):
        self.path = Path(path)
        self.start = start
        self._block_tokens: int | None = None
        self._looked = False

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def read(self, start: int) -> str:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(start)
                return fh.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def segment(self, start: int, settle: float = 1.0) -> str:
        """What the server logged since `start`, once its end-of-request line is in (or `settle` s passed).

        llama.cpp logs from a worker thread, so the last lines can land just after the answer.
        """
        deadline = time.monotonic() + settle
        while True:
            text = self.read(start)
            if _REQUEST_DONE.search(text.encode("utf-8", errors="replace")) or time.monotonic() > deadline:
                return text
            time.sleep(0.02)

    def block_tokens(self) -> int | None:
        """Tokens per KV block from the engine's ARMED line (None: tiering is not armed).

        The engine prints ARMED while loading, before the server answers: one look is enough.
        """
        if not self._looked:
            self._looked = True
            armed = [e for line in self.read(self.start).splitlines() if (e := kvmem_log.parse_armed(line))]
            if armed:
                self._block_tokens = int(armed[-1]["block_tokens"])
        return self._block_tokens


def answer_rank(order: list[int], blocks: list[int]) -> int:
    """The worst place (1 = best) of the answer blocks in the turn's attention order; 0 when none was ranked.

    Blocks the selection keeps by rule (sink, question, recent window) are not ranked: they count as 0.
    """
    place = {b: i + 1 for i, b in enumerate(order)}
    return max((place.get(b, 0) for b in blocks), default=0)


def trace_fields(segment: str, block_tokens: int | None, positions: list[int] | None) -> dict:
    """Hit-rate fields of one request from its log segment (see docs/eval/README.md)."""
    sels = kvmem_log.selects(segment)
    res = kvmem_log.residents(segment)
    blocks = sorted({p // block_tokens for p in positions}) if positions and block_tokens else None
    turn = next((r for r in res if r["reason"] == "turn"), None)
    turn_select = next((e for e in sels if e.get("reason") == "turn"), sels[0] if sels else None)
    ranked = next((e for e in kvmem_log.rankings(segment) if e["reason"] == "turn"), None)
    want = set(blocks or ())
    return {
        "answer_blocks": blocks,
        "turn_resident_hit": None if turn is None or blocks is None else want <= turn["blocks"],
        "answer_rank": None if ranked is None or blocks is None else answer_rank(ranked["attention"], blocks),
        "selects": len(sels),
        "selects_hit": None if not res or blocks is None else sum(1 for r in res if want <= r["blocks"]),
        "staged_in": None if turn_select is None else turn_select.get("staged_in"),
    }
