"""Counters and latency histograms, cheap enough for the hot path.

Histograms bucket microseconds logarithmically (4 buckets per doubling, ~19 % wide), so
recording is one `log2` and an array increment, and percentiles are read from the buckets.
A `snapshot()` is a plain msgspec Struct: JSON-ready and safe to hand to another thread.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec

__all__ = ["EngineStats", "HistogramSnapshot", "LatencyHistogram", "StatsSnapshot"]

_SUB = 4  # buckets per power of two
_NBUCKETS = 40 * _SUB  # up to 2**40 us (~12 days): enough for anything we time


class HistogramSnapshot(msgspec.Struct, frozen=True):
    count: int
    mean_us: float
    p50_us: float
    p99_us: float
    max_us: float


class LatencyHistogram:
    __slots__ = ("_buckets", "count", "max_us", "total_us")

    def __init__(self) -> None:
        self._buckets = [0] * _NBUCKETS
        self.count = 0
        self.total_us = 0.0
        self.max_us = 0.0

    def record(self, seconds: float) -> None:
        us = seconds * 1e6
        index = 0 if us <= 1.0 else min(int(math.log2(us) * _SUB) + 1, _NBUCKETS - 1)
        self._buckets[index] += 1
        self.count += 1
        self.total_us += us
        if us > self.max_us:
            self.max_us = us

    def percentile(self, q: float) -> float:
        """Upper edge of the bucket holding the q-quantile, in microseconds (0 when empty)."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for index, n in enumerate(self._buckets):
            seen += n
            if seen >= rank:
                return min(2 ** (index / _SUB), self.max_us) if index else 1.0
        return self.max_us  # pragma: no cover

    def snapshot(self) -> HistogramSnapshot:
        mean = self.total_us / self.count if self.count else 0.0
        return HistogramSnapshot(self.count, mean, self.percentile(0.5), self.percentile(0.99), self.max_us)


class StatsSnapshot(msgspec.Struct, frozen=True):
    counters: dict[str, int]
    histograms: dict[str, HistogramSnapshot]
    live_handles: dict[str, int]


class EngineStats:
    """What the engine counts. Names of counters and histograms are stable API."""

    HISTOGRAMS = ("transfer_us", "handshake_us", "post_us")

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.histograms = {name: LatencyHistogram() for name in self.HISTOGRAMS}

    def snapshot(self, live_handles: dict[str, int], extra_counters: dict[str, int] | None = None) -> StatsSnapshot:
        """`extra_counters` come from the parts that count for themselves (handshake server, mailbox)."""
        return StatsSnapshot(
            {**self.counters, **(extra_counters or {})},
            {name: h.snapshot() for name, h in self.histograms.items()},
            dict(live_handles),
        )
