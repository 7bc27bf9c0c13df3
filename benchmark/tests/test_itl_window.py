"""Which inter-token gaps a window holds, and the figures long_prompt.py reports over them."""

from __future__ import annotations

import pytest

from textgen_benchmark.itl_window import WindowFigures, window_gaps


def test_a_window_holds_every_gap_it_overlaps_including_both_edges() -> None:
    arrivals = [0.0, 1.0, 2.0, 5.0, 6.0]
    # (1.5, 5.5): the gap in flight at the start (1-2), the stall (2-5), the one in flight at the end (5-6).
    assert window_gaps(arrivals, 1.5, 5.5) == [1.0, 3.0, 1.0]
    # A gap that ends exactly at the start or begins exactly at the end lies outside.
    assert window_gaps(arrivals, 2.0, 5.0) == [3.0]
    assert window_gaps(arrivals, 6.5, 9.0) == []
    assert window_gaps([3.0], 0.0, 9.0) == []


def test_figures_pool_every_stream_and_count_steps_per_stream() -> None:
    # Two streams stalled together by one long prefill (2.0 -> 2.5), a third stream that ended before it.
    streams = [[0.0, 0.1, 0.2, 2.0, 2.5, 2.6], [0.05, 0.15, 2.05, 2.55], [0.0, 0.1]]
    f = WindowFigures.of(streams, start=1.0, end=2.5)
    # Each stream: its stalled gap and the next one (2.0-2.5, 2.05-2.55), which began before the end.
    assert (f.streams, f.gaps, f.steps) == (2, 4, 2)
    assert f.max_ms == pytest.approx(1900.0)
    assert f.p50_ms == pytest.approx(1800.0)  # sorted [500, 500, 1800, 1900], element floor(0.5 * 4) = 2
    assert f.seconds == pytest.approx(1.5)


def test_an_empty_window_has_no_figures() -> None:
    f = WindowFigures.of([[0.0, 1.0]], start=5.0, end=6.0)
    assert (f.streams, f.gaps, f.steps) == (0, 0, 0.0)
    assert f.p99_over_p50 != f.p99_over_p50  # NaN
