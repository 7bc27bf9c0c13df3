"""Decode steps through the CUDA-graph runner's static buffers (models/cuda_graphs.py), where CI has no GPU.

On a CPU `DecodeGraphs(capture=False)` runs the forward a graph would replay, on the same padded static
buffers, so these tests check what a GPU adds nothing to: the padding rows (slot 0 of the reserved block 0),
the copies into the buffers, the choice of batch size and table width, and the tokens (transformers' greedy
ones). `integration-tests/test_cuda.py` runs the real graphs on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from shard_helpers import HFOracle, check_uneven_batch
from test_paged_lm import paged_model

from textgen_server.config import (
    WIGGLE_ROOM_DEFAULT,
    ServeConfig,
    UnsupportedConfigError,
    parse_cuda_graphs,
    parse_wiggle_room,
)
from textgen_server.models.cuda_graphs import WIDTH_TOKENS, DecodeGraphs, table_widths
from textgen_server.models.paged_lm import PagedCausalLM


@pytest.mark.parametrize(
    ("value", "sizes"),
    [(None, ()), ("", ()), ("0", ()), ("1,2,4,8,16,32", (1, 2, 4, 8, 16, 32)), ("8,1,0,8", (1, 8))],
)
def test_cuda_graphs_lists_batch_sizes(value: str | None, sizes: tuple[int, ...]) -> None:
    assert parse_cuda_graphs(value) == sizes
    assert ServeConfig("m", cuda_graphs=value).paging().cuda_graphs == sizes


@pytest.mark.parametrize("value", ["1,x", "-1", "1,,2"])
def test_a_malformed_cuda_graphs_is_refused(value: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=f"CUDA_GRAPHS: expected .*{value}"):
        ServeConfig("m", cuda_graphs=value).check()


@pytest.mark.parametrize(("value", "room"), [(None, WIGGLE_ROOM_DEFAULT), ("", 0.9), ("0.8", 0.8), ("0.999", 0.999)])
def test_tgi_wiggle_room_is_the_pools_share_on_a_gpu(value: str | None, room: float) -> None:
    assert parse_wiggle_room(value) == room
    assert ServeConfig("m", wiggle_room=value).paging().wiggle_room == room


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2", "most"])
def test_a_tgi_wiggle_room_outside_0_1_is_refused(value: str) -> None:
    """TGI's shard asserts 0 < TGI_WIGGLE_ROOM < 1 at start; textgen refuses the value in one line."""
    with pytest.raises(
        UnsupportedConfigError, match=f"TGI_WIGGLE_ROOM: expected a number between 0 and 1, got '{value}'"
    ):
        ServeConfig("m", wiggle_room=value).check()


@pytest.mark.parametrize(
    ("max_tokens", "block_size", "widths"),
    [
        (4096, 1, [256, 512, 1024, 2048, 4096]),
        (4096, 16, [16, 32, 64, 128, 256]),
        (1000, 16, [16, 32, 63]),
        (100, 16, [7]),
        (4096, 256, [1, 2, 4, 8, 16]),
    ],
)
def test_table_widths_double_up_to_the_longest_sequence(max_tokens: int, block_size: int, widths: list[int]) -> None:
    assert WIDTH_TOKENS == 256
    assert table_widths(max_tokens, block_size) == widths


def counting(graphs: DecodeGraphs) -> dict[tuple[int, int], int]:
    """Count each graph's replays."""
    counts = dict.fromkeys(graphs._graphs, 0)

    def wrap(key: tuple[int, int], replay: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def counted() -> torch.Tensor:
            counts[key] += 1
            return replay()

        return counted

    graphs._graphs = {key: wrap(key, replay) for key, replay in graphs._graphs.items()}
    return counts


@pytest.mark.parametrize("cpu_ops", ["1", "0"])
def test_padded_static_decode_gives_transformers_tokens(
    tiny_llama: Path, llama_oracle: HFOracle, cpu_ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An uneven batch of 10 rows, then 13, filtered down as rows finish: each decode step runs in the smallest
    graph that holds it (padded to 16, 8, 4 ...), with the C++ decode op and with the torch code a GPU runs."""
    monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", cpu_ops)
    model = paged_model(tiny_llama)
    graphs = DecodeGraphs(model.module, model.pool, (1, 2, 4, 8, 16), 600, model.config.device, capture=False)
    graphs.capture_all()
    assert graphs.widths == [16, 32, 38]
    counts = counting(graphs)
    model.graphs = graphs
    free = model.pool.allocator.free_blocks
    check_uneven_batch(model, llama_oracle)
    assert model.pool.allocator.free_blocks == free
    used = {key for key, count in counts.items() if count}
    assert {size for size, _ in used} >= {16, 8}  # padded batches of 13 and 10 rows, then fewer
    assert {width for _, width in used} == {16}  # short prompts: the narrowest table


def test_a_step_no_graph_holds_runs_eagerly(tiny_llama: Path, llama_oracle: HFOracle) -> None:
    """Batches past the largest size (10 rows > 4) and sequences past the widest table fall back to eager."""
    model: PagedCausalLM = paged_model(tiny_llama)
    graphs = DecodeGraphs(model.module, model.pool, (2, 4), 300, model.config.device, capture=False)
    graphs.capture_all()
    assert graphs.key(5, 10) is None and graphs.key(4, 19 * 16 + 1) is None
    assert graphs.key(3, 1) == (4, 16) and graphs.key(1, 257) == (2, 19)
    model.graphs = graphs
    counts = counting(graphs)
    check_uneven_batch(model, llama_oracle)
    assert counts[4, 16] > 0  # the batch, once filtered down to 4 rows
