"""Tensor-parallel building blocks (Megatron style) over one `DistInfo` group.

Column-parallel layers split the output features and need no communication; a row-parallel layer splits
the input features and sums the partial products with one all_reduce. A column layer followed by a row
layer (q/k/v -> o, gate/up -> down) therefore costs one all_reduce per block. On one shard every layer is a
plain linear / embedding and no collective is issued.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from textgen_server.layers.lora import AdapterSegments, LoraProjection, add_lora
from textgen_server.utils.dist import DistInfo
from textgen_server.utils.weights import Weights

# oneDNN reorders a weight into a blocked layout chosen for a nominal row count. Measured on torch 2.13, the
# float32 layout gives the same results for every row count >= 2 whatever count it was chosen for, and
# fp32-close ones at 1 row; bfloat16 gives F.linear's bits (test_linear.py checks both).
_PACK_ROWS = 64


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (out, in) as a oneDNN tensor in its blocked GEMM layout, or None where that path does not
    exist: not on the CPU, not float32 / bfloat16, a torch without oneDNN, or (bfloat16) a CPU without native
    bf16 kernels."""
    dtype_ok = weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or not dtype_ok:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS)


class Linear(nn.Module):
    """y = x @ W^T + b; on a CPU in float32 or bfloat16, W lives only in oneDNN's blocked layout.

    Why: unpacked, the GEMM library reorders W into its own layout on every call; reordered once at load the
    products are faster at every row count, most for decode rows (`benchmark/linear_pack.py`; figures in
    benchmark/README.md, "Figures behind the shard's code"):
    - float32: F.linear goes through MKL, whose fp32 kernels are slow on AMD CPUs (MKL's own packed layout, used
      here before, was no faster than F.linear there). The product sums in a different order than `F.linear`:
      the same fp32 accuracy, not the same bits.
    - bfloat16: the same bits as `F.linear` (itself oneDNN).
    The unpacked copy is dropped so the model's memory does not double.

    `lora` (adapter index -> delta, filled by adapters.py) holds the LoRA adapters that target this
    projection; `forward(x, segments)` adds each one to the rows `segments` gives it (layers/lora.py).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed = onednn_packed(weight)
        self.weight = nn.Parameter(weight, requires_grad=False) if self.packed is None else None
        self.lora: dict[int, LoraProjection] = {}

    def forward(self, x: torch.Tensor, segments: AdapterSegments | None = None) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None  # kept exactly when there is no packed copy
            out = F.linear(x, self.weight, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if segments is not None and self.lora:
            add_lora(out, x, self.lora, segments)
        return out


class ColumnParallelLinear(Linear):
    """y_local = x @ W_local^T + b_local, where W_local holds this rank's rows (output features) of W."""

    @classmethod
    def load_multi(cls, weights: Weights, prefixes: list[str], bias: bool) -> ColumnParallelLinear:
        """Fuse several column-split projections (q/k/v, gate/up) into one matmul per rank.

        Each rank concatenates its own block of every projection, so the fused output is
        [q_local | k_local | v_local] and splits back with plain `torch.split`.
        """
        weight = weights.get_multi_sharded([f"{p}.weight" for p in prefixes], dim=0)
        b = weights.get_multi_sharded([f"{p}.bias" for p in prefixes], dim=0) if bias else None
        return cls(weight, b)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_local @ W_local^T, + b once; W_local holds this rank's input-feature columns."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dist: DistInfo) -> None:
        super().__init__(weight, bias)
        self.dist = dist

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool, dist: DistInfo) -> RowParallelLinear:
        weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        # The bias must be added once, not world_size times: only rank 0 holds it.
        b = weights.get_tensor(f"{prefix}.bias") if bias and dist.rank == 0 else None
        return cls(weight, b, dist)

    def forward(self, x: torch.Tensor, segments: AdapterSegments | None = None) -> torch.Tensor:
        # A LoRA delta of this rank's input columns is a partial sum too: the one all_reduce adds them up.
        return self.dist.all_reduce(super().forward(x, segments))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split in ceil(V / world) blocks (the last block may be short).

    Each rank looks up the ids it owns, writes zeros for the others, and one all_reduce assembles the rows.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, dist: DistInfo) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.dist = dist

    @classmethod
    def load(cls, weights: Weights, name: str, dist: DistInfo) -> VocabParallelEmbedding:
        vocab = weights.get_shape(name)[0]
        block = (vocab + dist.world_size - 1) // dist.world_size
        return cls(weights.get_partial_sharded(name, dim=0), dist.rank * block, dist)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.dist.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.dist.all_reduce(out)


class ParallelLMHead(Linear):
    """Logits over the FULL vocabulary on every rank.

    When the vocabulary divides evenly, each rank computes its block of logits and an all_gather
    concatenates them; otherwise every rank holds the whole head (an all_gather needs equal blocks).
    """

    def __init__(self, weight: torch.Tensor, gather: bool, dist: DistInfo) -> None:
        super().__init__(weight, None)
        self.gather = gather
        self.dist = dist

    @classmethod
    def load(
        cls, weights: Weights, name: str, dist: DistInfo, embedding: VocabParallelEmbedding | None = None
    ) -> ParallelLMHead:
        """`embedding` (tied weights): reuse its block when it is exactly this rank's head block."""
        vocab = weights.get_shape(name)[0]
        gather = dist.world_size > 1 and vocab % dist.world_size == 0
        if embedding is not None and (gather or dist.world_size == 1):
            # Tied: the embedding's ceil-sized block equals the head's even block, so share the memory
            # (unless the head packs it).
            return cls(embedding.weight.data, gather, dist)
        weight = weights.get_sharded(name, dim=0) if gather else weights.get_tensor(name)
        return cls(weight, gather, dist)

    def forward(self, hidden: torch.Tensor, segments: AdapterSegments | None = None) -> torch.Tensor:
        """`segments` only keeps Linear's signature: no adapter targets the head (adapters.py refuses it)."""
        logits = super().forward(hidden, segments)
        return self.dist.all_gather_last_dim(logits) if self.gather else logits
