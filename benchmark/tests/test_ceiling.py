"""textgen_benchmark.ceiling: the projection shapes read from a config, a step's time from the timed grid, and one
real timing of the shard's paths; and the model directory the launcher-based scripts take."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from textgen_benchmark import engine
from textgen_benchmark.ceiling import GRID, Ceiling, Shape, Step, projection_shapes
from textgen_server.layers.linear_choice import available_paths


def test_shapes_are_the_fused_projections_of_the_config(tiny_llama: Path) -> None:
    layers, head = projection_shapes(tiny_llama)  # hidden 64, 2 layers, 4 heads and 2 kv heads of 16, inter 128
    assert layers == [Shape(128, 64, 2), Shape(64, 64, 2), Shape(256, 64, 2), Shape(64, 128, 2)]
    assert head == Shape(1024, 64, 1)


def test_a_step_between_grid_rows_takes_the_line_between_their_times(tiny_llama: Path) -> None:
    ceiling = Ceiling(tiny_llama, torch.float32, 1)
    layers, head = projection_shapes(tiny_llama)
    for shape in [*layers, head]:
        for rows in GRID:  # times as if measured: a fixed cost plus one per row, per shape
            ceiling.least[(shape.out_features, shape.in_features, rows)] = shape.out_features * (1e-3 + rows * 1e-6)
            ceiling.paths[(shape.out_features, shape.in_features, rows)] = "linear"

    def expected(rows: int, logit_rows: int) -> float:
        line = sum(s.count * s.out_features * (1e-3 + rows * 1e-6) for s in layers)
        return line + head.out_features * (1e-3 + logit_rows * 1e-6)

    for rows in (1, 3, 20, 40, 100, 2048):  # on the grid and between its points: the same straight line
        assert abs(ceiling.step_seconds(Step(rows, rows)) - expected(rows, rows)) < 1e-12
    # Past the grid's last point the time scales with the rows; no logits, no head.
    last = GRID[-1]
    assert abs(ceiling.step_seconds(Step(3 * last, 0)) - 3 * (expected(last, 0) - head.out_features * 1e-3)) < 1e-9
    assert ceiling.seconds([Step(1, 1), Step(20, 20)]) == ceiling.step_seconds(Step(1, 1)) + ceiling.step_seconds(
        Step(20, 20)
    )


def test_a_measured_time_is_the_least_of_the_paths_that_serve(tiny_llama: Path) -> None:
    ceiling = Ceiling(tiny_llama, torch.float32, 1)
    seconds = ceiling.step_seconds(Step(4, 4))
    assert seconds > 0
    assert set(ceiling.paths.values()) <= set(available_paths(torch.float32, torch.device("cpu")))
    assert {rows for (_, _, rows) in ceiling.least} == {4}
    assert ceiling.rates().startswith("  4 rows: ")


def test_a_given_model_directory_is_used_as_it_is(tiny_llama: Path, tmp_path: Path) -> None:
    # prefix_reuse.py and long_prompt.py build the small Llama only where --model-dir holds no model: given the
    # tiny one, they once rebuilt it as the small one in place.
    stamp = (tiny_llama / ".textgen-build.json").read_text()
    assert engine.model_dir(argparse.Namespace(model_dir=tiny_llama)) == tiny_llama
    assert (tiny_llama / ".textgen-build.json").read_text() == stamp


def test_time_steps_times_what_the_steps_need_and_keeps_each_least_time(tiny_llama: Path) -> None:
    ceiling = Ceiling(tiny_llama, torch.float32, 1)
    first, second = ceiling.layers[0], ceiling.layers[1]
    ceiling.least[(first.out_features, first.in_features, 2)] = 1e3  # a stalled first pass
    ceiling.least[(second.out_features, second.in_features, 2)] = 1e-12  # faster than any real product
    ceiling.paths[(first.out_features, first.in_features, 2)] = ceiling.paths[
        (second.out_features, second.in_features, 2)
    ] = "stalled"
    ceiling.time_steps([Step(3, 0)], passes=1)
    assert {(o, i) for (o, i, _) in ceiling.least} == {(s.out_features, s.in_features) for s in ceiling.layers}
    assert {rows for (_, _, rows) in ceiling.least} == {2, 4}
    assert ceiling.least[(first.out_features, first.in_features, 2)] < 1e3
    assert ceiling.paths[(first.out_features, first.in_features, 2)] != "stalled"
    assert ceiling.least[(second.out_features, second.in_features, 2)] == 1e-12
    assert ceiling.paths[(second.out_features, second.in_features, 2)] == "stalled"
    ceiling.time_steps([Step(2, 1)], passes=1)
    assert (ceiling.head.out_features, ceiling.head.in_features, 1) in ceiling.least
