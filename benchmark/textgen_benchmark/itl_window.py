"""Inter-token latency of many streams over a window of time: which gaps belong to it, and their figures.

A stream's gaps are the times between consecutive token arrivals. A window (start, end) holds every gap that
overlaps it, a < end and b > start: also the gap in flight when the window opens and the one in flight when it
closes. Pure arithmetic over perf_counter seconds; long_prompt.py uses it for the long prompt's prefill (from
its arrival until its first token) and for a quiet window before it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from textgen_benchmark.stats import Latency


def window_gaps(arrivals: Sequence[float], start: float, end: float) -> list[float]:
    """The gaps (b - a) between consecutive `arrivals` (sorted) that overlap the window (start, end)."""
    return [b - a for a, b in pairwise(arrivals) if a < end and b > start]


@dataclass(frozen=True)
class WindowFigures:
    """Inter-token latency over one window, all streams pooled (ms; percentiles as `stats.Latency`)."""

    seconds: float
    streams: int  # streams with at least one gap in the window
    steps: float  # median over those streams of their gaps in the window: the engine's steps it spanned
    gaps: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, streams: Sequence[Sequence[float]], start: float, end: float) -> WindowFigures:
        per_stream = [g for g in (window_gaps(s, start, end) for s in streams) if g]
        pooled = [g * 1e3 for gaps in per_stream for g in gaps]
        lat = Latency.of(pooled)
        steps = statistics.median(len(g) for g in per_stream) if per_stream else 0.0
        return cls(end - start, len(per_stream), steps, len(pooled), lat.p50, lat.p99, lat.highest)

    @property
    def p99_over_p50(self) -> float:
        return self.p99_ms / self.p50_ms if self.p50_ms else float("nan")
