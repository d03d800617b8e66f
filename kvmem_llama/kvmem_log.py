"""Parse the engine's stable `kvmem_score:` log lines (see design notes, section 4).

    kvmem_score: ARMED blocks=.. block_tokens=.. layers=.. kv_heads=.. head_dim=.. budget_blocks=.. host_mib=..
                 method=.. prefill=.. gpu_type=K/V pool_type=K/V summaries_mib=.. score_mib=.. score_on=..
    kvmem_score: SELECT seq=.. n_blocks=.. budget_blocks=.. share=.. sink=.. recent=.. scored=.. staged_in=..
                 staged_out=.. reused=.. query_tokens=.. ms=.. stage_ms=.. stage_mib=.. reason=.. pos=..
                 question=.. method=.. lexical=.. score_ms=.. capture_ms=.. plan_ms=.. score_steps=..
                 score_build_ms=.. score_upload_ms=.. score_compute_ms=.. gather_ms=.. stage_wait_ms=..
                 captured_q=.. image_blocks=.. image_resident=.. capture_fetch_ms=.. capture_write_ms=..
                 capture_ubatches=.. decode_ms=.. decodes=..
                 [fits=1: the whole history is resident, nothing scored; no score_*, plan_ms or stage_wait_ms]
    kvmem_score: TURN seq=.. tokens=.. segments=.. snapshots=.. snapshot_ms=.. restore_ms=.. recompute_tokens=..
                 recompute_ms=.. ms=..
    kvmem_score: FOLLOW seq=.. n_blocks=.. staged_in=.. staged_out=.. resident=.. target_resident=.. common=..
    kvmem_score: DRAFT follows the target's selection: blocks=.. layers=.. host_mib=..
    kvmem_score: DISABLED (<reason>)
    kvmem_trace: resident seq=.. pos=.. reason=.. layers=.. blocks=<ranges>       (with --kvmem-trace)
    kvmem_trace: ranked seq=.. reason=.. attention=<blocks> lexical=<blocks>     (with --kvmem-trace)

SELECT is a selection of the blocks of one sequence: `reason` is turn (a prompt's end), refresh or room
(during generation), or prefill (inside a prompt, retrieval prefill mode); `pos` the position from which
the new working set applies; `question` the blocks of the last user message kept resident; `share` the
sequence's part of the budget in blocks when parallel sequences share it; `ms` the whole selection, of which
`gather_ms` a turn's gathering of its question's query rows (next to the graph scorer: one upload from the
host ring to the device; the host scorer copies them; on a fits=1 line too, whose `ms` stays 0: nothing was
selected), `score_ms` the scorer (with the graph scorer, uploading a re-selection's newest rows), `stage_ms` the
copies (`stage_wait_ms` of it the wait for the device's copies after the host has queued them and kept the cells'
books) and `plan_ms` the rest of the planning (query rows, lexical picks, ranking). The graph scorer's part by
phase (zeros with the host scorer): `score_steps` graph steps of query rows per layer, `score_build_ms` building
and allocating the graph, `score_upload_ms` the block indices, `score_compute_ms` the graph and its scores back.
`capture_ms` is the host time spent after ubatches (captures and write-through) since the previous SELECT
line (over `capture_ubatches` ubatches; `capture_fetch_ms` of it reading the captured rows back with the wait for
their copies, `capture_write_ms` the write-through of completed blocks), `decode_ms` the wall time of the `decodes`
passes of llama's own decode in that time (the model's graph with our hooks, `capture_ms` included; what the time
between two selections holds beyond them and the selection is the decode driver's and the application's),
`captured_q` the query rows captured in that
time (none while a generating sequence's history stays
resident for as long as its rows would be read: its re-selections are no-ops until then). `image_blocks` counts the
sequence's blocks that hold an image (its tokens share an M-RoPE position, so it lies in one block that moves,
is scored and comes back whole, weighing its host slots), `image_resident` those of them in the working set.
TURN is the batch that ends a prompt (what the first token waits for), once per scored turn next to its SELECT
line (also when the working set already held the picks: `recompute_tokens=0`; none when the history fits):
`tokens` in it, decoded in `segments` passes (cut where a hybrid model's recurrent state is snapshotted), the host's
time taking `snapshots` snapshots (`snapshot_ms`: the copies are queued on the device's stream, not waited for) and
restoring one (`restore_ms`), the recomputed question span (`recompute_tokens`, `recompute_ms`), and `ms` the whole
batch with its selection. `seq` is -1 for a batch of several sequences.
ARMED's `score_mib` is the scoring graph's device memory, taken at startup for the largest selection, with
its query rows (one question and one selection's newest rows, whatever the number of slots).
FOLLOW is an MTP draft context bringing its resident blocks in line with the target's; DRAFT announces such
a follower. The resident trace line lists the blocks resident after a selection (`layers` tells a target's
cache from its draft model's in one log).

Each parse function takes one line (any prefix, e.g. llama.cpp's log prefix, is allowed) and
returns a dict, or None when the line is not that event. The launcher's readiness self-test
and the engine's own tests both use this module, so the format lives in one place.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

ARMED_KEYS = ("blocks", "block_tokens", "layers", "kv_heads", "head_dim", "budget_blocks")
SELECT_KEYS = ("seq", "n_blocks", "budget_blocks", "sink", "recent", "scored", "staged_in",
               "staged_out", "reused", "query_tokens", "ms")

TURN_KEYS = ("seq", "tokens", "segments", "snapshots", "snapshot_ms", "restore_ms", "recompute_tokens", "recompute_ms",
             "ms")
FOLLOW_KEYS = ("seq", "n_blocks", "staged_in", "staged_out", "resident", "target_resident", "common")

_EVENT = re.compile(r"kvmem_score:\s+(?P<event>ARMED|SELECT|TURN|FOLLOW|DRAFT|DISABLED)\b\s*(?P<rest>.*?)\s*$")
_PAIR = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>\S+)")
_DISABLED = re.compile(r"^\((?P<reason>.*)\)$")


def _number(text: str) -> int | float | str:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _pairs(rest: str) -> dict:
    return {m["key"]: _number(m["value"]) for m in _PAIR.finditer(rest)}


def _event(line: str, name: str) -> str | None:
    match = _EVENT.search(line)
    if match is None or match["event"] != name:
        return None
    return match["rest"]


def _parse_keyed(line: str, event: str, keys: tuple[str, ...]) -> dict | None:
    rest = _event(line, event)
    if rest is None:
        return None
    fields = _pairs(rest)
    if any(key not in fields for key in keys):
        return None
    return {"event": event, **fields}


def parse_armed(line: str) -> dict | None:
    """`{"event": "ARMED", "blocks": int, ...}` when every documented key is present, else None."""
    return _parse_keyed(line, "ARMED", ARMED_KEYS)


def parse_select(line: str) -> dict | None:
    """`{"event": "SELECT", "seq": int, ..., "ms": float}` when every documented key is present."""
    event = _parse_keyed(line, "SELECT", SELECT_KEYS)
    if event is not None:
        event["ms"] = float(event["ms"])
    return event


def parse_turn(line: str) -> dict | None:
    """`{"event": "TURN", "seq": int, "tokens": int, ..., "ms": float}`: where a turn's last batch spent its time."""
    return _parse_keyed(line, "TURN", TURN_KEYS)


def parse_follow(line: str) -> dict | None:
    """`{"event": "FOLLOW", "seq": int, "resident": int, "target_resident": int, "common": int, ...}`."""
    return _parse_keyed(line, "FOLLOW", FOLLOW_KEYS)


def parse_draft(line: str) -> dict | None:
    """`{"event": "DRAFT", "blocks": int, "layers": int, ...}`: an MTP draft context follows the target."""
    rest = _event(line, "DRAFT")
    if rest is None:
        return None
    return {"event": "DRAFT", **_pairs(rest)}


def parse_disabled(line: str) -> dict | None:
    """`{"event": "DISABLED", "reason": str}`."""
    rest = _event(line, "DISABLED")
    if rest is None:
        return None
    match = _DISABLED.match(rest)
    return {"event": "DISABLED", "reason": match["reason"] if match else rest}


def parse_line(line: str) -> dict | None:
    """Whichever kvmem_score event the line carries, or None."""
    if "kvmem_score:" not in line:
        return None
    return (parse_armed(line) or parse_select(line) or parse_turn(line) or parse_follow(line) or parse_draft(line)
            or parse_disabled(line))


def iter_events(lines: Iterable[str] | str) -> Iterator[dict]:
    """All kvmem_score events of a log (a string or an iterable of lines), in order."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    for line in lines:
        event = parse_line(line)
        if event is not None:
            yield event


def selects(lines: Iterable[str] | str) -> list[dict]:
    return [e for e in iter_events(lines) if e["event"] == "SELECT"]


def armed(lines: Iterable[str] | str) -> dict | None:
    """The last ARMED event of a log (the tiered cache of the main context), or None."""
    found = None
    for event in iter_events(lines):
        if event["event"] == "ARMED":
            found = event
    return found


def follows(lines: Iterable[str] | str) -> list[dict]:
    return [e for e in iter_events(lines) if e["event"] == "FOLLOW"]


def tiering_state(lines: Iterable[str] | str) -> str:
    """"armed", "disabled: <reason>" or "absent" (the engine printed nothing about tiering)."""
    state = "absent"
    for event in iter_events(lines):
        if event["event"] == "ARMED":
            state = "armed"
        elif event["event"] == "DISABLED":
            state = f"disabled: {event['reason']}"
    return state


_RESIDENT = re.compile(r"kvmem_trace:\s+resident\b\s*(?P<rest>.*?)\s*$")
_RANGE = re.compile(r"^(?P<lo>\d+)(?:-(?P<hi>\d+))?$")


def expand_ranges(text: str) -> set[int]:
    """`0-1,5,17-20` -> {0, 1, 5, 17, 18, 19, 20} (inclusive ranges); an empty text is the empty set.

    Raises ValueError on anything else, so a changed format is noticed rather than misread.
    """
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = _RANGE.match(part)
        if match is None:
            raise ValueError(f"not a block range: {part!r}")
        lo = int(match["lo"])
        hi = int(match["hi"]) if match["hi"] is not None else lo
        if hi < lo:
            raise ValueError(f"descending block range: {part!r}")
        out.update(range(lo, hi + 1))
    return out


def parse_resident(line: str) -> dict | None:
    """`{"event": "RESIDENT", "seq": int, "pos": int, "reason": str, "blocks": set[int], "ranges": str}`.

    From the trace line `kvmem_trace: resident seq=.. pos=.. reason=.. blocks=..` (blocks may be
    empty); None for other lines or when a documented key is missing or blocks do not parse.
    """
    match = _RESIDENT.search(line)
    if match is None:
        return None
    rest = match["rest"]
    fields = _pairs(rest)
    # `blocks=` with nothing after it is a valid (empty) set, which _PAIR does not match
    blocks = re.search(r"(?:^|\s)blocks=(?P<ranges>\S*)", rest)
    if blocks is None or any(key not in fields for key in ("seq", "pos", "reason")):
        return None
    try:
        resident = expand_ranges(blocks["ranges"])
    except ValueError:
        return None
    fields.pop("blocks", None)
    return {"event": "RESIDENT", **fields, "reason": str(fields["reason"]), "blocks": resident,
            "ranges": blocks["ranges"]}


def _trace_events(lines: Iterable[str] | str, parse: Callable[[str], dict | None]) -> list[dict]:
    if isinstance(lines, str):
        lines = lines.splitlines()
    return [e for line in lines if "kvmem_trace:" in line and (e := parse(line)) is not None]


def residents(lines: Iterable[str] | str) -> list[dict]:
    """Every `kvmem_trace: resident` event of a log, in order."""
    return _trace_events(lines, parse_resident)


_RANKED = re.compile(r"kvmem_trace:\s+ranked\s+seq=(?P<seq>\d+)\s+reason=(?P<reason>\S+)"
                     r"\s+attention=(?P<attention>[\d,]*)\s+lexical=(?P<lexical>[\d,]*)\s*$")


def parse_ranked(line: str) -> dict | None:
    """`{"event": "RANKED", "seq": int, "reason": str, "attention": [blocks], "lexical": [blocks]}`.

    From `kvmem_trace: ranked ...`: the orders a selection picked from, best first (blocks outside the sink,
    the question and the recent window; lexical only for hybrid). None for other lines.
    """
    match = _RANKED.search(line)
    if match is None:
        return None
    order = lambda text: [int(b) for b in text.split(",") if b]  # noqa: E731
    return {"event": "RANKED", "seq": int(match["seq"]), "reason": match["reason"],
            "attention": order(match["attention"]), "lexical": order(match["lexical"])}


def rankings(lines: Iterable[str] | str) -> list[dict]:
    """Every `kvmem_trace: ranked` event of a log, in order."""
    return _trace_events(lines, parse_ranked)
