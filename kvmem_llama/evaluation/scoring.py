"""Scoring as RULER does it: the share of expected strings found in the answer, case-insensitive."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable


def first_picks(got: str, pool: Collection[str], n: int) -> list[str]:
    """The first `n` distinct words of `got` that are words of the list (`pool`), in answer order."""
    picked: list[str] = []
    for word in re.findall(r"[a-z]+", (got or "").lower()):
        if word in pool and word not in picked:
            picked.append(word)
            if len(picked) == n:
                break
    return picked


def score(expected: Iterable[str], got: str, pool: Collection[str] | None = None) -> float:
    """Percent (0-100) of `expected` strings that occur in `got`, ignoring case.

    With `pool` (common-words extraction: the words of the list) only the first len(expected)
    list words the answer names count, so reciting the whole list earns nothing extra.
    """
    wanted = [e for e in expected if e]
    if not wanted:
        raise ValueError("a sample needs at least one expected string")
    if pool is not None:
        picks = first_picks(got, {w.lower() for w in pool}, len(wanted))
        return 100.0 * sum(1 for e in wanted if e.lower() in picks) / len(wanted)
    text = (got or "").lower()
    found = sum(1 for e in wanted if e.lower() in text)
    return 100.0 * found / len(wanted)


def mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals else None
