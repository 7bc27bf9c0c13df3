"""LoRA deltas applied per segment of rows: several adapters and the base model in one forward pass.

A LoRA adapter adds `scaling * B @ A` to a projection's weight W. Instead of merging it (one adapter per
model), the delta is computed on the side: `y = x @ W^T + (x @ a) @ b`, with a = A^T and b = scaling * B^T, on
the rows of the batch that asked for that adapter only (TGI's `adapter_segments`). Rows of the base model
(adapter index 0) pay nothing; an adapter's rows cost two thin matmuls of rank r per projection.

Tensor parallelism follows the base weight's split (see tensor_parallel.py):
- column-parallel projections (q/k/v, gate/up) split their output features: each rank holds its rows of B
  and the whole A, so its delta lands on its own output block;
- row-parallel projections (o, down) split their input features: each rank holds its columns of A and the
  whole B, so its delta is a partial sum, added before the one all_reduce the layer already does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraProjection:
    """One adapter's delta on one (possibly fused) projection of this rank: `(x @ a) @ b`.

    `a` [in_features_local, R], `b` [R, out_features_local], the adapter's scaling folded into `b`. A fused
    projection (q/k/v, gate/up) stacks its pieces' ranks: `a` holds every piece's A side by side and `b` is
    block diagonal, so one pair of matmuls serves all pieces.
    """

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class AdapterSegments:
    """Which packed token rows of one forward step each adapter serves (adapter index > 0 only).

    `rows[index]` is a slice when that adapter's tokens are one contiguous run of the packed [T, features]
    activations, else the index tensor of its tokens.
    """

    rows: dict[int, slice | torch.Tensor]

    @classmethod
    def of(
        cls, row_adapters: Sequence[int], tokens_per_row: Sequence[int], device: torch.device
    ) -> AdapterSegments | None:
        """The segments of a step whose batch row i, with adapter `row_adapters[i]` (0 = base model), feeds
        `tokens_per_row[i]` consecutive packed tokens; None when no row uses an adapter."""
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for adapter, count in zip(row_adapters, tokens_per_row, strict=True):
            end = start + count
            if adapter:
                spans = runs.setdefault(adapter, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], end)  # neighbouring rows of one adapter: one run
                else:
                    spans.append((start, end))
            start = end
        if not runs:
            return None
        rows: dict[int, slice | torch.Tensor] = {}
        for adapter, spans in runs.items():
            if len(spans) == 1:
                rows[adapter] = slice(*spans[0])
            else:
                rows[adapter] = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in spans])
        return cls(rows)


def add_lora(
    out: torch.Tensor, x: torch.Tensor, projections: dict[int, LoraProjection], segments: AdapterSegments
) -> torch.Tensor:
    """`out` [T, out_features] += each segment's adapter delta of `x` [T, in_features], in place."""
    for adapter, rows in segments.rows.items():
        projection = projections.get(adapter)
        if projection is None:  # this adapter leaves this projection alone
            continue
        if isinstance(rows, slice):
            out[rows].addmm_(x[rows] @ projection.a, projection.b)
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ projection.a) @ projection.b)
    return out
