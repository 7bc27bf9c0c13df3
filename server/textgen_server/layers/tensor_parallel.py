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

from textgen_server.layers.linear_choice import BUCKET_ROWS, KERNELS, Kernel, PlainKernel, bucket
from textgen_server.layers.lora import AdapterSegments, LoraProjection, add_lora
from textgen_server.layers.quant_kernels import packed_kernel
from textgen_server.layers.quantization import load_quantized, stored_quantized
from textgen_server.layers.quantized_weight import QuantizedWeight
from textgen_server.utils.dist import DistInfo
from textgen_server.utils.weights import Weights


class Linear(nn.Module):
    """y = x @ W^T + b, by the kernel `use` gave the bucket of x's row count (layers/linear_choice.py).

    Built with the plain weight and `F.linear` for every row count; on a CPU the shard's model loader then measures the
    paths this CPU has and calls `use` (`choose_linear_kernels`), which keeps W only in the layouts the chosen
    kernels read: the plain copy is dropped unless a bucket runs `F.linear`, so the model's memory does not
    double for nothing.

    `lora` (adapter index -> delta, filled by adapters.py) holds the LoRA adapters that target this
    projection; `forward(x, segments)` adds each one to the rows `segments` gives it (layers/lora.py).
    """

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.lora: dict[int, LoraProjection] = {}
        # A quantized weight stays packed where a packed kernel computes it (for every row count: only it reads
        # the weight's few bits); elsewhere it is dequantized and measured like any float weight.
        self.packed: Kernel | None = None
        self.dequantized: str | None = None  # why a quantized weight was dequantized at load
        if isinstance(weight, QuantizedWeight):
            kernel = packed_kernel(weight, self.bias)
            if isinstance(kernel, Kernel):
                self.weight: nn.Parameter | None = None
                self.packed = kernel
                self.kernels: tuple[Kernel, ...] = (kernel,) * len(BUCKET_ROWS)
                return
            self.dequantized = kernel
            weight = weight.dequantize()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.use((PlainKernel.path,) * len(BUCKET_ROWS))

    def plain_weight(self) -> torch.Tensor:
        """W as loaded; only until `use` chose kernels that do not read it."""
        if self.weight is None:
            raise RuntimeError("this projection keeps only packed layouts of its weight: the plain one was dropped")
        return self.weight

    @property
    def paths(self) -> tuple[str, ...]:
        """The path of each bucket's kernel."""
        return tuple(kernel.path for kernel in self.kernels)

    def use(self, paths: tuple[str, ...]) -> None:
        """Compute rows of bucket i (linear_choice.bucket) with the kernel of path `paths[i]`."""
        weight = self.plain_weight()
        built = {path: KERNELS[path](weight, self.bias) for path in dict.fromkeys(paths)}
        self.kernels = tuple(built[path] for path in paths)
        if PlainKernel.path not in built:
            self.weight = None

    def forward(self, x: torch.Tensor, segments: AdapterSegments | None = None) -> torch.Tensor:
        out = self.kernels[bucket(x.numel() // self.in_features)](x)
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
        quant = weights.quant
        if quant is not None and quant.quantizes(prefixes[0]):
            weight: torch.Tensor | QuantizedWeight = QuantizedWeight.cat_rows(
                [_rank_block(weights, load_quantized(weights, p, quant), dim=0) for p in prefixes]
            )
        else:
            weight = weights.get_multi_sharded([f"{p}.weight" for p in prefixes], dim=0)
        b = weights.get_multi_sharded([f"{p}.bias" for p in prefixes], dim=0) if bias else None
        return cls(weight, b)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_local @ W_local^T, + b once; W_local holds this rank's input-feature columns."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, dist: DistInfo) -> None:
        super().__init__(weight, bias)
        self.dist = dist

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool, dist: DistInfo) -> RowParallelLinear:
        if weights.quant is not None and weights.quant.quantizes(prefix):
            weight: torch.Tensor | QuantizedWeight = _rank_block(
                weights, load_quantized(weights, prefix, weights.quant), dim=1
            )
        else:
            weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        # The bias must be added once, not world_size times: only rank 0 holds it.
        b = weights.get_tensor(f"{prefix}.bias") if bias and dist.rank == 0 else None
        return cls(weight, b, dist)

    def forward(self, x: torch.Tensor, segments: AdapterSegments | None = None) -> torch.Tensor:
        # A LoRA delta of this rank's input columns is a partial sum too: the one all_reduce adds them up.
        return self.dist.all_reduce(super().forward(x, segments))


def _rank_block(weights: Weights, weight: QuantizedWeight, dim: int) -> QuantizedWeight:
    """This rank's equal block of a quantized weight's output (dim 0) or input (dim 1) features."""
    size = weight.shape[dim]
    if size % weights.world_size != 0:
        raise ValueError(f"a quantized weight of shape {weight.shape} cannot be split in {weights.world_size} on {dim}")
    block = size // weights.world_size
    start, stop = weights.rank * block, (weights.rank + 1) * block
    return weight.rows(start, stop) if dim == 0 else weight.cols(start, stop)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split in ceil(V / world) blocks (the last block may be short).

    Each rank looks up the ids it owns, writes zeros for the others, and one all_reduce assembles the rows.
    Rows come out in `dtype`, whatever dtype `weight` is held in.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, dist: DistInfo, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.dist = dist
        self.dtype = dtype

    @classmethod
    def load(cls, weights: Weights, name: str, dist: DistInfo, mapped: bool = False) -> VocabParallelEmbedding:
        """`mapped`: on a CPU, hold this rank's rows as a map of the file in the stored dtype
        (`Weights.mapped_rows`): a step reads one row per token, so the table costs the rows used, not
        vocabulary x hidden (131 MB in bfloat16 for a 1B Llama). Converting a looked-up row gives the bits
        converting the table would. Not for a table the LM head shares: the head reads all of it every step."""
        vocab = weights.get_shape(name)[0]
        block = (vocab + dist.world_size - 1) // dist.world_size
        start, stop = dist.rank * block, min((dist.rank + 1) * block, vocab)
        rows = weights.mapped_rows(name, start, stop) if mapped else None
        if rows is None:
            rows = weights.get_partial_sharded(name, dim=0)
        return cls(rows, start, dist, weights.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.dist.world_size == 1:
            return F.embedding(input_ids, self.weight).to(self.dtype)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).to(self.dtype).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.dist.all_reduce(out)


class ParallelLMHead(Linear):
    """Logits over the FULL vocabulary on every rank.

    When the vocabulary divides evenly, each rank computes its block of logits and an all_gather
    concatenates them; otherwise every rank holds the whole head (an all_gather needs equal blocks).
    """

    def __init__(self, weight: torch.Tensor | QuantizedWeight, gather: bool, dist: DistInfo) -> None:
        super().__init__(weight, None)
        self.gather = gather
        self.dist = dist

    @classmethod
    def load(
        cls, weights: Weights, name: str, dist: DistInfo, embedding: VocabParallelEmbedding | None = None
    ) -> ParallelLMHead:
        """`embedding` (tied weights): reuse its block when it is exactly this rank's head block. A head the
        checkpoint stores quantized is served packed, as the decoder projections are."""
        prefix = name.removesuffix(".weight")
        if weights.quant is not None and stored_quantized(weights, prefix, weights.quant):
            stored = load_quantized(weights, prefix, weights.quant)
            gather = dist.world_size > 1 and stored.shape[0] % dist.world_size == 0
            return cls(_rank_block(weights, stored, dim=0) if gather else stored, gather, dist)
        vocab = weights.get_shape(name)[0]
        gather = dist.world_size > 1 and vocab % dist.world_size == 0
        if embedding is not None and (gather or dist.world_size == 1):
            # Tied: the embedding's ceil-sized block equals the head's even block, so share the memory
            # (while the head keeps a plain copy).
            return cls(embedding.weight.data, gather, dist)
        weight = weights.get_sharded(name, dim=0) if gather else weights.get_tensor(name)
        return cls(weight, gather, dist)

    def forward(self, hidden: torch.Tensor, segments: AdapterSegments | None = None) -> torch.Tensor:
        """`segments` only keeps Linear's signature: no adapter targets the head (adapters.py refuses it)."""
        logits = super().forward(hidden, segments)
        return self.dist.all_gather_last_dim(logits) if self.gather else logits
