"""The projections' FLOP ceiling of a run (issue 42): how fast its steps could go if they did nothing but their
projections, at the fastest rate this CPU reaches for those shapes and row counts, measured in the same run.

A step feeding r token rows runs each decoder layer's q/k/v, o, gate/up and down projections on r rows, and the
LM head on the rows that take logits (every row of a decode step, each request's last token in a prefill). The
least time of those products is measured here on the shard's threads, every path the shard's linear choice may
take (layers/linear_choice.py: `F.linear`, MKL's packed GEMM, oneDNN, textgen's `gemv`) called in turn with its
weight out of the caches, as in a step (`linear_choice.least_times`, the linear choice's own timing). Weights are
random in the run's dtype: a product's speed does not depend on the values. Each shape is timed at the row counts
of GRID and a step's row count between two of them takes the straight line between their times: one least time
per distinct row count of a run
(up to 64 of them) was cheaper in rounds and so noisier, 50-140 GFLOP/s at neighbouring counts on a 2-core VM.
Row counts above the last are scaled from it (a GEMM's rate is flat there). `time_steps` times all of a run's
products in two passes, seconds apart, each keeping its lesser time.

The run's ceiling is its generated tokens over the summed least times of its steps; its fraction of the ceiling
is that sum over its wall time. Attention, the small ops, sampling, gRPC and the router are what the fraction
leaves out.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from textgen_server.layers.linear_choice import (
    EVICT_MAX,
    KERNELS,
    available_paths,
    bucket,
    last_level_cache_bytes,
    least_times,
)

GRID = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048)
# After the first round, a path more than this many times slower than the fastest is not timed again (torch's own
# bf16 loops at 2,048 rows take seconds a call on an AVX2 CPU).
DROP_SLOWER = 2.0
# A shape's rounds at one row count last milliseconds, and a stall of the host over them once made the down projection
# at 2,048 rows read 224 GFLOP/s beside 423-432 for the other shapes, a W1 ceiling about 0.7 s too long (its 9,239-token
# prefill is scaled from that point). A second pass over every product, seconds later, keeps the lesser time.
PASSES = 2


def _points(rows: int) -> list[tuple[int, float]]:
    """The grid's row counts whose times make a product's time at `rows`, each with its share."""
    if rows >= GRID[-1]:
        return [(GRID[-1], rows / GRID[-1])]
    above = bisect_left(GRID, rows)
    if GRID[above] == rows:
        return [(rows, 1.0)]
    low, high = GRID[above - 1], GRID[above]
    share = (rows - low) / (high - low)
    return [(low, 1 - share), (high, share)]


@dataclass(frozen=True)
class Shape:
    out_features: int
    in_features: int
    count: int  # how many of the model's projections have this shape


def projection_shapes(model_dir: Path) -> tuple[list[Shape], Shape]:
    """The decoder layers' projection shapes (fused as the shard runs them: q/k/v, gate/up) and the LM head's,
    from a Llama-family config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    shapes = [
        Shape((heads + 2 * kv_heads) * head_dim, hidden, layers),
        Shape(hidden, heads * head_dim, layers),
        Shape(2 * inter, hidden, layers),
        Shape(hidden, inter, layers),
    ]
    return shapes, Shape(config["vocab_size"], hidden, 1)


@dataclass
class Step:
    """One forward: `rows` token rows through the layers, `logit_rows` of them through the LM head."""

    rows: int
    logit_rows: int


@dataclass
class Ceiling:
    """Least seconds of each (shape, rows) product, measured once and kept."""

    model_dir: Path
    dtype: torch.dtype
    threads: int
    least: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (out, in, rows) -> seconds
    paths: dict[tuple[int, int, int], str] = field(default_factory=dict)  # the fastest path of each

    def __post_init__(self) -> None:
        self.layers, self.head = projection_shapes(self.model_dir)

    def step_seconds(self, step: Step) -> float:
        total = sum(shape.count * self._seconds(shape, step.rows) for shape in self.layers)
        return total + (self._seconds(self.head, step.logit_rows) if step.logit_rows else 0.0)

    def seconds(self, steps: Iterable[Step]) -> float:
        return sum(self.step_seconds(step) for step in steps)

    def time_steps(self, steps: Iterable[Step], passes: int = PASSES) -> None:
        """Time every product `steps` need in `passes` passes over all of them, each keeping its least time."""
        needed = set()
        for step in steps:
            needed |= {(shape, rows) for shape in self.layers for rows, _ in _points(step.rows)}
            if step.logit_rows:
                needed |= {(self.head, rows) for rows, _ in _points(step.logit_rows)}
        for _ in range(passes):
            for shape, rows in sorted(needed, key=lambda n: (n[1], n[0].out_features, n[0].in_features)):
                seconds, path = self._measure(shape, rows)
                key = (shape.out_features, shape.in_features, rows)
                if seconds < self.least.get(key, math.inf):
                    self.least[key], self.paths[key] = seconds, path

    def _seconds(self, shape: Shape, rows: int) -> float:
        return sum(share * self._timed(shape, at) for at, share in _points(rows))

    def _timed(self, shape: Shape, rows: int) -> float:
        key = (shape.out_features, shape.in_features, rows)
        if key not in self.least:
            self.least[key], self.paths[key] = self._measure(shape, rows)
        return self.least[key]

    def _measure(self, shape: Shape, rows: int) -> tuple[float, str]:
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(shape.out_features, shape.in_features, generator=g).to(self.dtype) * 0.02
        x = torch.randn(rows, shape.in_features, generator=g).to(self.dtype)
        index = bucket(rows)
        kernels = [KERNELS[path](weight, None) for path in available_paths(self.dtype, weight.device)]
        evict = torch.ones(min(2 * last_level_cache_bytes(), EVICT_MAX) // 4)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                least = least_times([k for k in kernels if k.serves(index)], x, evict, keep_within=DROP_SLOWER)
        finally:
            torch.set_num_threads(before)
        path = min(least, key=least.__getitem__)
        return least[path], path

    def rates(self) -> str:
        """Each measured (shape, rows): the fastest path and its GFLOP/s, one line per row count."""
        lines = []
        for rows in sorted({key[2] for key in self.least}):
            cells = [
                f"{o}x{i} {self.paths[(o, i, r)]} {2 * o * i * r / self.least[(o, i, r)] / 1e9:.0f}"
                for (o, i, r) in sorted(self.least)
                if r == rows
            ]
            lines.append(f"  {rows} rows: " + ", ".join(cells))
        return "\n".join(lines)
