"""Confidence intervals for cell means: the Wilson score interval.

A sample's score is the percent of expected strings found (0..100; partial credit for tasks
with several values). For an interval each sample counts as a success fraction score/100 and
the Wilson interval is taken on the mean with n = the number of samples. For all-or-nothing
tasks (one expected string) this is exactly Wilson's interval for k successes in n trials.
Wilson rather than the normal approximation: it stays inside [0, 1] and is sensible at
0/n and n/n, which is where a budget that loses the needle ends up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

Z95 = 1.959963984540054  # the two-sided 95% normal quantile


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion `p` (0..1) observed over `n` trials."""
    if n <= 0:
        raise ValueError("the Wilson interval needs n >= 1")
    p = min(max(p, 0.0), 1.0)
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    # at p = 0 or 1 the bound is exactly 0 or 1; clamp the rounding error away
    return max(0.0, center - half) if p > 0 else 0.0, min(1.0, center + half) if p < 1 else 1.0


@dataclass(frozen=True)
class Estimate:
    """A mean in percent with its 95% Wilson interval (percent) and the sample count."""

    mean: float
    lo: float
    hi: float
    n: int

    def text(self, digits: int = 1) -> str:
        return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}] ({self.n})"

    def as_dict(self) -> dict:
        return {"mean": round(self.mean, 4), "lo": round(self.lo, 4), "hi": round(self.hi, 4), "n": self.n}


def estimate(percents: Iterable[float]) -> Estimate | None:
    """Mean of per-sample percentages (0..100) with the Wilson interval; None without samples."""
    values = [float(v) for v in percents]
    if not values:
        return None
    mean = sum(values) / len(values)
    lo, hi = wilson(mean / 100.0, len(values))
    return Estimate(mean, 100.0 * lo, 100.0 * hi, len(values))


def proportion(flags: Iterable[bool | None]) -> Estimate | None:
    """The share of True among the known (non-None) flags, in percent, with its interval."""
    known = [bool(f) for f in flags if f is not None]
    return estimate(100.0 if f else 0.0 for f in known)
