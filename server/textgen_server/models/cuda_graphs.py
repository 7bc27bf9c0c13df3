"""Decode steps of the paged engine replayed from CUDA graphs (TGI's `CUDA_GRAPHS`).

A decode step of a small batch on a GPU is short enough that launching its few hundred kernels one by one from
Python costs more than running them. At warmup the shard captures the decode forward once per batch size of
`CUDA_GRAPHS` and per width of block table, on static input buffers; a step whose every row decodes one token
then copies its inputs into those buffers and replays the smallest graph that holds it. As in TGI, the rows past
the batch (padding) write their key and value to slot 0, of block 0, which is reserved and never handed to a
request, and read that one position back; prefills, prefill chunks, speculation, LoRA adapters and prompt
logprobs run eagerly.

Widths: the graph's attention (layers/paged_attention.py `decode_rows`) reads every position of the block table it
is given, masked past each row's length, so one graph per batch size sized for `max_total_tokens` would read the
longest context at every step. Widths double from WIDTH_TOKENS tokens up to the pool's longest sequence, so a step
reads at most about twice the positions it needs.

On a CPU there are no graphs: `DecodeGraphs(capture=False)` runs the same padded static-buffer forward eagerly,
which the tests use to check the padding, the buffers and the choice of graph where CI has no GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from textgen_server.models.tp_llama import PagedStep

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from textgen_server.models.kv_pool import KVPool
    from textgen_server.models.tp_llama import TPCausalLM

logger = logging.getLogger(__name__)

# The narrowest block table a graph reads, in tokens.
WIDTH_TOKENS = 256


def table_widths(max_tokens: int, block_size: int) -> list[int]:
    """The block-table widths (in blocks) graphs are captured for: from WIDTH_TOKENS tokens, doubling, up to the
    blocks of `max_tokens`, that last one included."""
    widest = -(-max_tokens // block_size)
    widths = []
    width = -(-WIDTH_TOKENS // block_size)
    while width < widest:
        widths.append(width)
        width *= 2
    return [*widths, widest]


class DecodeGraphs:
    """One captured decode forward per (batch size, table width), on static buffers of the largest of each."""

    def __init__(
        self,
        module: TPCausalLM,
        pool: KVPool,
        sizes: Sequence[int],
        max_tokens: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.module = module
        self.pool = pool
        self.sizes = sorted(sizes)
        self.widths = table_widths(max_tokens, pool.block_size)
        self.device = device
        self.capture = capture
        rows, blocks = self.sizes[-1], self.widths[-1]
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, blocks, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}

    def capture_all(self) -> None:
        """Capture every graph, largest first so the smaller ones reuse its memory pool."""
        start = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle() if self.capture else None
        for size in reversed(self.sizes):
            for width in reversed(self.widths):
                self._graphs[size, width] = (
                    self._capture(size, width, mempool) if mempool is not None else self._eager(size, width)
                )
        if self.capture:
            torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs: batch sizes %s, block tables of %s blocks of %d tokens: %d graphs in %.1f s",
            ",".join(map(str, self.sizes)),
            ",".join(map(str, self.widths)),
            self.pool.block_size,
            len(self._graphs),
            time.perf_counter() - start,
        )

    def _forward(self, size: int, width: int) -> torch.Tensor:
        """The decode forward of the first `size` static rows over `width` table columns: logits [size, V]."""
        cu_seqlens = torch.arange(size + 1, dtype=torch.int32)  # one query per row; never read on this path
        step = PagedStep(self.pool, self.slots[:size], cu_seqlens, self.lengths[:size], self.tables[:size, :width])
        return self.module.forward_paged(self.ids[:size], self.positions[:size], step, None, None)

    def _eager(self, size: int, width: int) -> Callable[[], torch.Tensor]:
        """What a graph would replay, run eagerly (capture=False)."""
        return lambda: self._forward(size, width)

    def _capture(self, size: int, width: int, mempool: _POOL_HANDLE) -> Callable[[], torch.Tensor]:
        # One eager run first: lazy initialisations (cuBLAS handles and workspaces) must not happen under capture.
        self._forward(size, width)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            logits = self._forward(size, width)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    def key(self, rows: int, longest: int) -> tuple[int, int] | None:
        """The graph for `rows` decode rows whose longest reads `longest` positions, None when none holds them."""
        size = bisect.bisect_left(self.sizes, rows)
        width = bisect.bisect_left(self.widths, -(-longest // self.pool.block_size))
        if size == len(self.sizes) or width == len(self.widths):
            return None
        return self.sizes[size], self.widths[width]

    def run(self, ids: torch.Tensor, positions: torch.Tensor, step: PagedStep, longest: int) -> torch.Tensor | None:
        """Logits [B, V] of a decode step (every row one token: ids, positions [B] and `step`'s slots on the device,
        its lengths and block table on the host or the device) from the graph that holds it; None when none does."""
        rows = ids.shape[0]
        key = self.key(rows, longest)
        if key is None:
            return None
        size, width = key
        self.ids[:rows].copy_(ids)
        self.positions[:rows].copy_(positions)
        self.slots[:rows].copy_(step.slots)
        self.lengths[:rows].copy_(step.seq_lens)
        columns = min(width, step.block_tables.shape[1])
        self.tables[:rows, :columns].copy_(step.block_tables[:, :columns])
        # Padding rows: token 0 at position 0, written to and read from slot 0 of the reserved block 0.
        self.ids[rows:size].zero_()
        self.positions[rows:size].zero_()
        self.slots[rows:size].zero_()
        self.lengths[rows:size].fill_(1)
        self.tables[rows:size, 0].zero_()
        return self._graphs[key]()[:rows]
