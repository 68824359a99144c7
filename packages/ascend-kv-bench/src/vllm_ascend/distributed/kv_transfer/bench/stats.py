# SPDX-License-Identifier: Apache-2.0
"""Ratios of repeated alternating rounds: median, spread, bootstrap interval, verdict.

``bench serve`` measures ours and a peer in the same round, one after the other,
for several rounds. A comparison is the ratio of the two series' medians; its
spread is the min-max of the per-round ratios, and its interval a paired
percentile bootstrap over the rounds (rounds are resampled together, so a round
that was slow for both cancels). A goal counts as met only when the whole
interval lies on the right side of its bound. A goal on an absolute difference (a fixed
cost, a save overhead) uses :func:`compare_difference`, the same over ours minus the peer.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Resamples of the bootstrap, and its confidence level.
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def _finite(v: float | None) -> bool:
    return v is not None and isinstance(v, int | float) and math.isfinite(float(v))


def paired(ours: Sequence[float | None], peer: Sequence[float | None]
           ) -> tuple[list[float], list[float]]:
    """The rounds where both series have a finite value (round by round)."""
    a, b = [], []
    for x, y in zip(ours, peer, strict=False):
        if _finite(x) and _finite(y):
            a.append(float(x))  # type: ignore[arg-type]
            b.append(float(y))  # type: ignore[arg-type]
    return a, b


def ratio_of_medians(ours: Sequence[float], peer: Sequence[float]) -> float | None:
    """``median(ours) / median(peer)``; ``None`` when empty or the peer's median is not > 0."""
    if not ours or not peer:
        return None
    den = statistics.median(peer)
    return statistics.median(ours) / den if den > 0 else None


def bootstrap_interval(ours: Sequence[float], peer: Sequence[float], *,
                       resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap of :func:`ratio_of_medians` over paired rounds.

    A resample whose peer median is not above 0 has no ratio: it counts as +inf (ours
    unboundedly worse), so a peer within the noise of zero widens the interval instead of
    being left out.

    Returns:
        ``(low, high)``, or ``None`` with fewer than two rounds or when the ratio of the
        rounds themselves is undefined.
    """
    n = len(ours)
    if n < 2 or n != len(peer) or ratio_of_medians(ours, peer) is None:
        return None
    rng = random.Random(seed)
    stats: list[float] = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        r = ratio_of_medians([ours[i] for i in idx], [peer[i] for i in idx])
        stats.append(math.inf if r is None else r)
    stats.sort()
    tail = (1.0 - confidence) / 2
    lo = stats[min(len(stats) - 1, max(0, int(math.floor(tail * len(stats)))))]
    hi = stats[min(len(stats) - 1, max(0, int(math.ceil((1 - tail) * len(stats))) - 1))]
    return lo, hi


@dataclass(frozen=True)
class RatioStats:
    """One comparison over the rounds.

    Attributes:
        rounds: rounds where both sides were measured.
        ratio: median(ours) / median(peer).
        min: smallest per-round ratio.
        max: largest per-round ratio.
        low: low end of the bootstrap interval (``ratio`` with one round).
        high: high end of the bootstrap interval (``ratio`` with one round).
    """

    rounds: int
    ratio: float | None
    min: float | None
    max: float | None
    low: float | None
    high: float | None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return asdict(self)


def compare(ours: Sequence[float | None], peer: Sequence[float | None], *,
            inverse: bool = False, seed: int = 0) -> RatioStats:
    """Ours against the peer over paired rounds (``inverse``: peer / ours, e.g. a
    throughput from two times)."""
    a, b = paired(ours, peer)
    if inverse:
        a, b = b, a
    per_round = [x / y for x, y in zip(a, b, strict=True) if y > 0]
    point = ratio_of_medians(a, b)
    iv = bootstrap_interval(a, b, seed=seed) if point is not None else None
    if iv is None and point is not None:
        iv = (point, point)
    return RatioStats(rounds=len(a), ratio=point,
                      min=min(per_round) if per_round else None,
                      max=max(per_round) if per_round else None,
                      low=iv[0] if iv else None, high=iv[1] if iv else None)


def difference_of_medians(ours: Sequence[float], peer: Sequence[float]) -> float | None:
    """``median(ours) - median(peer)``; ``None`` when either is empty."""
    if not ours or not peer:
        return None
    return statistics.median(ours) - statistics.median(peer)


def compare_difference(ours: Sequence[float | None], peer: Sequence[float | None], *,
                       resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                       seed: int = 0) -> RatioStats:
    """Ours minus the peer over paired rounds (a goal on an absolute difference, such as a
    fixed cost or a save overhead near 0, where a ratio of two small numbers says nothing):
    ``ratio`` holds the difference of the medians, ``min``/``max`` the per-round
    differences' extremes, ``low``/``high`` its percentile bootstrap interval (rounds
    resampled together)."""
    a, b = paired(ours, peer)
    point = difference_of_medians(a, b)
    per_round = [x - y for x, y in zip(a, b, strict=True)]
    low = high = point
    if point is not None and len(a) >= 2:
        rng = random.Random(seed)
        n = len(a)
        stats: list[float] = []
        for _ in range(resamples):
            idx = [rng.randrange(n) for _ in range(n)]
            d = difference_of_medians([a[i] for i in idx], [b[i] for i in idx])
            assert d is not None
            stats.append(d)
        stats.sort()
        tail = (1.0 - confidence) / 2
        low = stats[min(len(stats) - 1, max(0, int(math.floor(tail * len(stats)))))]
        high = stats[min(len(stats) - 1, max(0, int(math.ceil((1 - tail) * len(stats))) - 1))]
    return RatioStats(rounds=len(a), ratio=point,
                      min=min(per_round) if per_round else None,
                      max=max(per_round) if per_round else None, low=low, high=high)


def verdict(stats: RatioStats | dict[str, Any], *, at_most: float | None = None,
            at_least: float | None = None) -> bool | None:
    """Met only when the whole interval is on the right side of the bound.

    Returns:
        ``None`` without a bound or without a measurement.
    """
    d = stats.as_dict() if isinstance(stats, RatioStats) else stats
    lo, hi = d.get("low"), d.get("high")
    if lo is None or hi is None or (at_most is None and at_least is None):
        return None
    if at_most is not None and hi > at_most:
        return False
    return not (at_least is not None and lo < at_least)


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min, max and count of one series (the finite values)."""
    vals = [float(v) for v in values if _finite(v)]  # type: ignore[arg-type]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(vals), "median": statistics.median(vals), "min": min(vals),
            "max": max(vals)}
