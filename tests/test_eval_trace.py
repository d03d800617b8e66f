"""The answer-block hit rate: the engine's trace lines, where answers sit in the server's tokens,
and a request's own stretch of the server log."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem_llama import kvmem_log
from kvmem_llama.evaluation.records import ServerLog, trace_fields

SELECT = ("kvmem_score: SELECT seq=0 n_blocks=64 budget_blocks=8 share=8 sink=1 recent=2 scored=4 staged_in={staged} "
          "staged_out=6 reused=2 query_tokens=32 ms=1.250 stage_ms=0.3 stage_mib=2.8 reason={reason} method=votes")


def test_expand_ranges() -> None:
    assert kvmem_log.expand_ranges("0-1,5,17-20") == {0, 1, 5, 17, 18, 19, 20}
    assert kvmem_log.expand_ranges("3") == {3}
    assert kvmem_log.expand_ranges("") == set()
    for bad in ("1-", "a", "5-3", "1;2"):
        with pytest.raises(ValueError):
            kvmem_log.expand_ranges(bad)


def test_parse_resident() -> None:
    line = "0.28.011.620 I kvmem_trace: resident seq=0 pos=8190 reason=turn blocks=0-1,5,17-20"
    got = kvmem_log.parse_resident(line)
    assert got == {"event": "RESIDENT", "seq": 0, "pos": 8190, "reason": "turn",
                   "blocks": {0, 1, 5, 17, 18, 19, 20}, "ranges": "0-1,5,17-20"}
    empty = kvmem_log.parse_resident("kvmem_trace: resident seq=1 pos=0 reason=room blocks=")
    assert empty is not None and empty["blocks"] == set() and empty["reason"] == "room"
    # keys the engine may add later are kept; lines of other events or with missing keys are not this event
    more = kvmem_log.parse_resident("kvmem_trace: resident seq=0 pos=9 reason=refresh blocks=2 layer=all")
    assert more is not None and more["blocks"] == {2} and more["layer"] == "all"
    assert kvmem_log.parse_resident("kvmem_trace: resident seq=0 reason=turn blocks=1") is None
    assert kvmem_log.parse_resident("kvmem_trace: resident seq=0 pos=1 reason=turn blocks=x-y") is None
    assert kvmem_log.parse_resident("kvmem_trace: pick seq=0 block=3 score=0.5") is None
    assert kvmem_log.parse_resident(SELECT.format(staged=1, reason="turn")) is None


def test_parse_ranked() -> None:
    got = kvmem_log.parse_ranked("0.28.011.620 W kvmem_trace: ranked seq=1 reason=turn attention=7,3,12 lexical=3")
    assert got == {"event": "RANKED", "seq": 1, "reason": "turn", "attention": [7, 3, 12], "lexical": [3]}
    empty = kvmem_log.parse_ranked("kvmem_trace: ranked seq=0 reason=refresh attention= lexical=")
    assert empty is not None and empty["attention"] == [] and empty["lexical"] == []
    assert kvmem_log.parse_ranked("kvmem_trace: resident seq=0 pos=1 reason=turn blocks=1") is None
    assert kvmem_log.parse_ranked("kvmem_trace: ranked seq=0 reason=turn attention=a,b lexical=") is None


def test_select_parser_tolerates_new_keys() -> None:
    # reason= and method= at the end of SELECT (engines with the trace) must not break the existing parser
    got = kvmem_log.parse_select("srv  kvmem: " + SELECT.format(staged=6, reason="turn"))
    assert got is not None and got["staged_in"] == 6 and got["reason"] == "turn" and got["method"] == "votes"
    assert got["ms"] == 1.25
    assert kvmem_log.parse_line(SELECT.format(staged=0, reason="refresh"))["event"] == "SELECT"
    armed = kvmem_log.parse_armed("kvmem_score: ARMED blocks=33 block_tokens=128 layers=30 kv_heads=3 head_dim=64 "
                                  "budget_blocks=5 host_mib=93 method=quest")
    assert armed is not None and armed["block_tokens"] == 128


def _segment(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def test_trace_fields_of_a_request() -> None:
    seg = _segment(
        "slot launch_slot_: id  0 | task 7 | processing task",
        SELECT.format(staged=6, reason="turn"),
        "kvmem_trace: ranked seq=0 reason=turn attention=10,9,11,3,40 lexical=",
        "kvmem_trace: resident seq=0 pos=8190 reason=turn blocks=0,9-11,61-63",
        SELECT.format(staged=1, reason="refresh"),
        "kvmem_trace: ranked seq=0 reason=refresh attention=3,10,9 lexical=",
        "kvmem_trace: resident seq=0 pos=8318 reason=refresh blocks=0,10-11,62-64",
        "slot      release: id  0 | task 7 | stop processing: n_tokens = 8330, truncated = 0",
    )
    # answers at positions 1200 and 1300 with 128-token blocks: blocks 9 and 10
    got = trace_fields(seg, 128, [1300, 1200])
    assert got == {"answer_blocks": [9, 10], "turn_resident_hit": True, "answer_rank": 2, "selects": 2,
                   "selects_hit": 1, "staged_in": 6}
    miss = trace_fields(seg, 128, [500])  # block 3: never resident, fourth in the turn's order
    assert miss["turn_resident_hit"] is False and miss["selects_hit"] == 0 and miss["answer_rank"] == 4
    # a block kept by rule (the recent window's 63) is not ranked: 0
    assert trace_fields(seg, 128, [63 * 128])["answer_rank"] == 0
    # tiering off (no ARMED line, so no block size) or no trace lines: unknown, not a miss
    off = trace_fields("slot release: stop processing\n", None, [1200])
    assert off == {"answer_blocks": None, "turn_resident_hit": None, "answer_rank": None, "selects": 0,
                   "selects_hit": None, "staged_in": None}
    untraced = trace_fields(_segment(SELECT.format(staged=3, reason="turn")), 128, [1200])
    assert untraced["turn_resident_hit"] is None and untraced["selects"] == 1 and untraced["staged_in"] == 3
    # an engine before reason= keys: the turn SELECT is the first one
    old = SELECT.format(staged=4, reason="turn").replace(" reason=turn method=votes", "")
    assert trace_fields(_segment(old), 128, [1])["staged_in"] == 4


def test_server_log_segments(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_text("kvmem_score: ARMED blocks=70 block_tokens=64 layers=2 kv_heads=1 head_dim=8 budget_blocks=9\n")
    log = ServerLog(path)
    assert log.block_tokens() == 64
    start = log.size()
    with open(path, "a") as fh:
        fh.write("request line\nslot release: id 0 | task 1 | stop processing: n_tokens = 5\n")
    assert log.segment(start) == "request line\nslot release: id 0 | task 1 | stop processing: n_tokens = 5\n"
    # without the end-of-request line, a segment is what is there after `settle` seconds
    start = log.size()
    with open(path, "a") as fh:
        fh.write("partial\n")
    assert log.segment(start, settle=0.05) == "partial\n"
    assert ServerLog(tmp_path / "none.log").block_tokens() is None
