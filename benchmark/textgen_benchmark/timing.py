"""Timing several callables against one another in one process (benchmark/linear_pack.py, attention.py,
fused_ops.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def alternate(
    fns: Sequence[Callable[[], object]], runs: int, before: Callable[[], object] | None = None
) -> list[float]:
    """Median seconds of each fn, calling them in turn so that drift on a shared machine hits all alike;
    `before`, if given, runs untimed before each timed call."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up: first-touch allocations, thread pool start
    for _ in range(runs):
        for fn, out in zip(fns, times, strict=True):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]
