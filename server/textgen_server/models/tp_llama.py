"""Tensor-parallel Llama-family causal LM (llama, mistral, qwen2) loaded straight from safetensors.

Contract with the padded CausalLM (models/causal_lm.py): `load_tp_model(...)` returns a module whose
`forward(input_ids [B,S], attention_mask [B, past+S] (1 = real token, left padding), position_ids [B,S],
past_key_values: KVCache | None, use_cache=True)` returns `.logits` [B,S,V] over the FULL vocabulary
(identical on every rank) and `.past_key_values` holding this rank's KV heads
(num_key_value_heads / world_size of them) — the same shapes an HF causal LM gives on one shard.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from torch import nn

from textgen_server.layers.attention_kernels import attention_for, uses_matmul
from textgen_server.layers.cpu_ops import ops_for
from textgen_server.layers.decode_attention import decode_attention, first_visible, use_decode_kernel
from textgen_server.layers.linear_choice import Direct, bucket, choose_linear_kernels
from textgen_server.layers.lora import AdapterSegments
from textgen_server.layers.norm import RMSNorm
from textgen_server.layers.paged_attention import paged_attention, write_kv
from textgen_server.layers.quantized_weight import QuantConfig
from textgen_server.layers.rotary import MROPE_TEXT_TYPES, RotaryEmbedding, head_size, rotate_heads_
from textgen_server.layers.tensor_parallel import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from textgen_server.models.kv_cache import KVCache, PaddedKVCache
from textgen_server.models.kv_pool import KVPool, PoolShape
from textgen_server.models.model import Interrupted
from textgen_server.utils.dist import DistInfo
from textgen_server.utils.weights import Weights

if TYPE_CHECKING:
    from textgen_server.model_config import ModelConfig

logger = logging.getLogger(__name__)

# The Qwen2-VL families' text models are Qwen2s whose rotary positions have three axes (layers/rotary.py); they
# are served within their VLM only, so an error names the text families alone.
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")
TP_MODEL_TYPES: set[str] = {*TEXT_MODEL_TYPES, *MROPE_TEXT_TYPES}


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError, naming the offending number, when `config` cannot be split over `world_size` ranks."""
    if config.model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} has no tensor-parallel implementation "
            f"(supported: {', '.join(TEXT_MODEL_TYPES)})"
        )
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field)
        if value % world_size != 0:
            raise ValueError(
                f"{field}={value} is not divisible by the number of shards ({world_size}); "
                f"choose a --num-shard that divides it"
            )


def _layer_windows(config: ModelConfig) -> list[int | None]:
    """Sliding-window size per layer (None = full attention), as the reference models decide it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _check(interrupt: threading.Event | None) -> None:
    """Stop a forward between two layers once its `interrupt` is set (a step run ahead that is not wanted)."""
    if interrupt is not None and interrupt.is_set():
        raise Interrupted


def _attention_mask(attention_mask: torch.Tensor, seq_len: int, window: int | None) -> torch.Tensor:
    """Boolean [B, 1, S, T] mask: causal, no padded keys, optional sliding window.

    Key column j and query i sit at cache positions j and T - S + i (left padding included), the same
    indexing the reference masks use. Every query may also see itself, so a padded query row is never fully
    masked (that would give NaN, and NaN values leak through the next layer's zero attention weights).
    """
    total = attention_mask.shape[-1]
    q_pos = torch.arange(total - seq_len, total, device=attention_mask.device)[:, None]
    k_pos = torch.arange(total, device=attention_mask.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    allowed = (visible[None] & attention_mask[:, None, :].bool()) | (k_pos == q_pos)[None]
    return allowed[:, None]


# Attention runs on this many groups of neighbouring rows, each from its own first real column:
# the batch keeps rows of similar prompt length together, so most of the left padding is skipped.
ATTENTION_GROUPS = 4


@dataclass
class TokenLayout:
    """Where the real tokens of a left-padded [B, S] step sit, so the matmuls skip the padding.

    `index` lists the flat positions (row * S + column) of the real tokens in order; None means every
    position is real (decode steps, unpadded prefills). Linear layers run on the packed [T, features] rows;
    attention scatters them back onto the [B * S] grid, with zeros at padded positions.
    `row_groups` (steps with padding): (first row, end row, first key column any of them attends to).
    """

    batch: int
    seq_len: int
    index: torch.Tensor | None
    lengths: torch.Tensor | None  # real tokens per row (with `index`)
    padding: torch.Tensor | None  # flat positions of the padding (with `index`)
    device: torch.device
    row_groups: list[tuple[int, int, int]] | None = None

    @classmethod
    def of(cls, attention_mask: torch.Tensor, seq_len: int) -> TokenLayout:
        """The layout of a step feeding the last `seq_len` columns of `attention_mask` [B, past + S]."""
        batch, device = attention_mask.shape[0], attention_mask.device
        real = attention_mask[:, -seq_len:].bool()
        if seq_len == 1:
            return cls(batch, seq_len, None, None, None, device, _row_groups(attention_mask))
        if bool(real.all()):
            return cls(batch, seq_len, None, None, None, device)
        flat = real.reshape(-1)
        return cls(
            batch,
            seq_len,
            flat.nonzero().squeeze(1),
            real.sum(1),
            (~flat).nonzero().squeeze(1),
            device,
            _row_groups(attention_mask),
        )

    def pack(self, grid: torch.Tensor) -> torch.Tensor:
        """[B * S, ...] -> [T, ...]"""
        return grid if self.index is None else grid.index_select(0, self.index)

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """[T, F] -> [B * S, F], zeros at padded positions."""
        if self.index is None:
            return packed
        grid = packed.new_empty((self.batch * self.seq_len, packed.shape[1]))
        grid.index_copy_(0, self.index, packed)
        assert self.padding is not None  # set together with `index`
        # Padded keys and values must be finite (zero attention weight times NaN is NaN): zero just those rows.
        return grid.index_fill_(0, self.padding, 0.0)

    def last_positions(self, n: int) -> torch.Tensor:
        """Packed indices of each row's last `n` positions, row-major ([B * n])."""
        if self.index is None:
            ends = torch.arange(1, self.batch + 1, device=self.device) * self.seq_len
        else:
            assert self.lengths is not None
            ends = self.lengths.cumsum(0)
        return (ends[:, None] - torch.arange(n, 0, -1, device=self.device)[None, :]).reshape(-1)


def _row_groups(attention_mask: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """Split the rows into ATTENTION_GROUPS runs, each with the first column any of its rows attends to.

    None when the split would skip no column (then one attention call over everything is as good).
    """
    batch = attention_mask.shape[0]
    if batch < 2 * ATTENTION_GROUPS:
        return None
    first_real = attention_mask.argmax(1).tolist()  # left padding: the first 1 of each row
    bounds = [batch * g // ATTENTION_GROUPS for g in range(ATTENTION_GROUPS + 1)]
    groups = [(lo, hi, min(first_real[lo:hi])) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    return groups if any(start > 0 for _, _, start in groups) else None


@dataclass
class PaddedStep:
    """What attention needs in a step of the padded CausalLM: where the real tokens sit on the [B, S] grid, one
    mask per window size (None: causal / nothing masked), the cache, and (bf16 decode op) each row's first
    visible column per window size."""

    layout: TokenLayout
    masks: dict[int | None, torch.Tensor | None]
    cache: KVCache | None
    firsts: dict[int | None, torch.Tensor | None]


@dataclass
class PagedStep:
    """What attention needs in a step of the paged engine (models/paged_lm.py): the pool, the slot each new token's
    key and value go to, and per row its query run, key count and block table (layers/paged_attention.py)."""

    pool: KVPool
    slots: torch.Tensor  # int64 [T]
    cu_seqlens_q: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # int64 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    # per row of several queries, its keys' slots on the pool's device, once per step (paged_attention's key_slots)
    key_slots: list[torch.Tensor | None] | None = None


class Attention(nn.Module):
    """This rank's heads: fused q/k/v column projection, RoPE, attention, row-parallel o_proj (one all_reduce)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        prefix: str,
        layer_idx: int,
        dist: DistInfo,
        window: int | None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = window  # sliding window (None: full attention)
        self.head_dim = head_size(config)
        self.num_heads = config.num_attention_heads // dist.world_size
        self.num_kv_heads = config.num_key_value_heads // dist.world_size
        self.scaling = self.head_dim**-0.5
        self.split = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        # Biases are read from the checkpoint, not the config: qwen2 has q/k/v bias only, llama's
        # attention_bias puts one on o_proj too.
        self.qkv = ColumnParallelLinear.load_multi(
            weights, [f"{prefix}.{p}_proj" for p in "qkv"], bias=f"{prefix}.q_proj.bias" in weights
        )
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", f"{prefix}.o_proj.bias" in weights, dist)
        self.rotated = self.split[0] + self.split[1]  # the query and key features, which RoPE turns
        self.attention = attention_for(weights.dtype, weights.device)
        self.fused = ops_for(weights.dtype, weights.device)  # RoPE and the K/V writes by fused_ops.cpp

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PaddedStep | PagedStep,
        segments: AdapterSegments | None,
    ) -> torch.Tensor:
        """`hidden` [T, hidden] holds the step's real tokens, `cos`/`sin` [T, head_dim] their angles.
        `segments`: the LoRA adapters' rows of `hidden` (None: every row runs the base model)."""
        tokens = hidden.shape[0]
        q, k, v = self.heads(self.qkv(hidden, segments), cos, sin)
        if isinstance(step, PagedStep):
            out = self._attend_paged(q, k, v, step)
            return self.o_proj(out.reshape(tokens, -1), segments)
        return self.o_proj(self._attend_padded(q, k, v, step), segments)

    def heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [T, heads, head_dim] of the fused projection's output [T, features], the query and key heads
        turned by RoPE in place. RoPE runs on the real tokens only, before any padding (much of a W1 prefill grid
        is padding), on the query and key heads at once."""
        tokens = qkv.shape[0]
        rotate_heads_(qkv[:, : self.rotated].view(tokens, -1, self.head_dim), cos, sin, self.fused)
        q, k, v = (x.view(tokens, -1, self.head_dim) for x in qkv.split_with_sizes(self.split, dim=-1))
        return q, k, v

    def _attend_paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """The new keys and values go to their slots of the pool; every query attends through its row's block
        table (layers/paged_attention.py)."""
        k_cache, v_cache = step.pool.keys[self.layer_idx], step.pool.values[self.layer_idx]
        write_kv(k_cache, v_cache, step.slots, k, v, self.fused)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            step.cu_seqlens_q,
            step.seq_lens,
            step.block_tables,
            self.scaling,
            self.window,
            step.key_slots,
            kernel=self.fused,
        )

    def _attend_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: PaddedStep) -> torch.Tensor:
        """Attention on the padded [B, S] grid of `step.layout`; returns the real tokens' outputs [T, features].
        `step.firsts` (a decode step of a PaddedKVCache with the decode op, see decode_attention.py): each row's
        first visible column of the cache window."""
        layout, cache = step.layout, step.cache
        batch, seq_len, tokens = layout.batch, layout.seq_len, q.shape[0]
        mask, first = step.masks[self.window], step.firsts.get(self.window)
        q, k, v = (
            layout.pad(x.reshape(tokens, -1)).view(batch, seq_len, -1, self.head_dim).transpose(1, 2) for x in (q, k, v)
        )
        groups = layout.row_groups
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            if first is not None and isinstance(cache, PaddedKVCache):
                out = decode_attention(
                    q,
                    cache.keys[self.layer_idx],
                    cache.values[self.layer_idx],
                    first,
                    cache.offset,
                    k.shape[2],
                    self.scaling,
                )
                return out.reshape(batch, -1)
            if seq_len == 1 and isinstance(cache, PaddedKVCache) and cache.whole_decode:
                # Every column, the ones outside the window masked (see PaddedKVCache): cutting row groups'
                # padding columns would make the operands strided again.
                k, v, mask = cache.whole(self.layer_idx, mask, k.shape[2])
                groups = None
        shift = 0
        if mask is not None:
            # A sliding-window cache layer may return fewer keys than the mask has columns: they are the
            # most recent ones, so align right.
            shift = max(mask.shape[-1] - k.shape[2], 0)
            mask = mask[..., shift:]
        out = self._attend(q, k, v, mask, groups, shift)
        return layout.pack(out.transpose(1, 2).reshape(batch * seq_len, -1))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        groups: list[tuple[int, int, int]] | None,
        shift: int,
    ) -> torch.Tensor:
        """Attention, per row group when given (group columns count from the mask's first column, `shift`
        columns left of the first key)."""
        if groups is None or mask is None:
            return self.attention(q, k, v, mask, self.scaling)
        # Columns left of a group's start are padding for all its rows, as keys and as queries: both are cut,
        # and those query rows of `out` stay unwritten, since the packed layout drops them (a group's start
        # can only lie past the first query column in a padded prefill, where the layout has an index).
        out = q.new_empty(q.shape)
        first_query_col = mask.shape[-1] - q.shape[2]
        for lo, hi, start in groups:
            col = max(start - shift, 0)
            q_col = max(start - shift - first_query_col, 0)
            out[lo:hi, :, q_col:] = self.attention(
                q[lo:hi, :, q_col:], k[lo:hi, :, col:], v[lo:hi, :, col:], mask[lo:hi, :, q_col:, col:], self.scaling
            )
        return out


def activation(name: str) -> nn.Module:
    """transformers' activation `name` (ACT2FN): SiLU, which these families use, without importing
    transformers.activations (it imports transformers' model loading: model_config.py); any other from there."""
    if name in ("silu", "swish"):
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class MLP(nn.Module):
    """act(gate) * up in one fused column matmul, then a row-parallel down projection."""

    def __init__(self, config: ModelConfig, weights: Weights, prefix: str, dist: DistInfo) -> None:
        super().__init__()
        self.gate_up = ColumnParallelLinear.load_multi(
            weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=f"{prefix}.gate_proj.bias" in weights
        )
        self.down = RowParallelLinear.load(weights, f"{prefix}.down_proj", f"{prefix}.down_proj.bias" in weights, dist)
        self.act = activation(config.hidden_act)
        # textgen::silu_mul (fused_ops.cpp): silu(gate) * up in one op, the same bits.
        self.fused_silu = config.hidden_act == "silu" and ops_for(weights.dtype, weights.device)

    def forward(self, x: torch.Tensor, segments: AdapterSegments | None) -> torch.Tensor:
        gate_up = self.gate_up(x, segments)
        if self.fused_silu:
            return self.down(torch.ops.textgen.silu_mul(gate_up), segments)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up, segments)


class LayerBlocks(NamedTuple):
    """A decoder layer's arguments to the C++ decode blocks (layers/decode_blocks.cpp) for one bucket of rows:
    `attention` (norm weight, eps, kinds, weights, ints, shape, scale, window) and `mlp` (norm weight, eps, kinds,
    weights, ints), each block's two projections as its schema takes them; and, found once rather than through the
    modules at every step, the layer's index in the KV pool and the row-parallel projections' all_reduce."""

    attention: tuple[object, ...]
    mlp: tuple[object, ...]
    layer: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]


def _projections(first: Direct, second: Direct) -> tuple[list[int], list[torch.Tensor | None], list[int]]:
    """Two projections as a decode block's `kinds`, `weights` and `params` arguments."""
    return [first.kind, second.kind], [*first.tensors, *second.tensors], [*first.ints, *second.ints]


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, weights: Weights, layer_idx: int, dist: DistInfo, window: int | None
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(weights.get_tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = Attention(config, weights, f"{prefix}.self_attn", layer_idx, dist, window)
        self.post_attention_layernorm = RMSNorm(weights.get_tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = MLP(config, weights, f"{prefix}.mlp", dist)

    def forward(
        self,
        hidden: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PaddedStep | PagedStep,
        segments: AdapterSegments | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the residual stream, this layer's MLP output): the sum of the two is the layer's output. The
        next layer (`pending`, None for the first) or the final norm adds them as it normalises, in one op."""
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add(hidden, pending)
        attn = self.self_attn(normed, cos, sin, step, segments)
        hidden, normed = self.post_attention_layernorm.add(hidden, attn)
        return hidden, self.mlp(normed, segments)

    @property
    def decodes_straight(self) -> bool:
        """Whether `decode` can stand in for `forward`: every op it calls straight is the one forward picks here
        (the fused C++ ops: a CPU, float32 or bfloat16, SiLU)."""
        norms = (self.input_layernorm, self.post_attention_layernorm)
        return self.self_attn.fused and self.mlp.fused_silu and all(norm.fused for norm in norms)

    def decode(
        self,
        hidden: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PagedStep,
        kernel: int,
        blocks: LayerBlocks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a paged step whose every row feeds one token and runs the base model (no adapter rows):
        the same ops in the same order on the same tensors, so the same bits, without the module calls, the
        linear layers' per-call checks and `paged_attention`'s per-call conversions. A small model's batch-1 step
        is bound by what runs between its ops: on the tiny Llama a layer took about 145 us through `forward` and
        about 120 this way (benchmark/README.md, "A decode step's Python"). `kernel`: the linear kernels' bucket of the
        step's row count; `step`'s tables and lengths already as the attention op takes them (`_decode_layers`).
        Only where `decodes_straight`.

        `blocks` (`self.blocks(kernel)`): the same in two C++ calls, textgen::decode_attention_block and
        decode_mlp_block (layers/decode_blocks.cpp), each the same ops in the same order on the same tensors, so the
        same bits; the row-parallel projections' all_reduce between and after them. The small GPTQ Llama's batch-1
        step went from 4.5-4.9 to 3.8-3.9 ms this way (benchmark/README.md, "A decode step's layers in two C++
        calls")."""
        if blocks is not None:
            hidden, out = torch.ops.textgen.decode_attention_block(
                hidden,
                pending,
                *blocks.attention,
                cos,
                sin,
                step.pool.keys[blocks.layer],
                step.pool.values[blocks.layer],
                step.slots,
                step.block_tables,
                step.seq_lens,
            )
            hidden, out = torch.ops.textgen.decode_mlp_block(hidden, blocks.all_reduce(out), *blocks.mlp)
            return hidden, blocks.all_reduce(out)
        attn, mlp = self.self_attn, self.mlp
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add(hidden, pending)
        q, k, v = attn.heads(attn.qkv.kernels[kernel](normed), cos, sin)
        k_cache, v_cache = step.pool.keys[attn.layer_idx], step.pool.values[attn.layer_idx]
        write_kv(k_cache, v_cache, step.slots, k, v, attn.fused)
        out = torch.ops.textgen.paged_decode_attention(
            q, k_cache, v_cache, step.block_tables, step.seq_lens, attn.scaling, attn.window or 0
        )
        out = attn.o_proj.dist.all_reduce(attn.o_proj.kernels[kernel](out.reshape(hidden.shape[0], -1)))
        hidden, normed = self.post_attention_layernorm.add(hidden, out)
        gate_up = mlp.gate_up.kernels[kernel](normed)
        return hidden, mlp.down.dist.all_reduce(mlp.down.kernels[kernel](torch.ops.textgen.silu_mul(gate_up)))

    def blocks(self, kernel: int) -> LayerBlocks | None:
        """This layer's arguments to the C++ decode blocks for rows of bucket `kernel`, or None where one of its
        four projections is not one op the blocks call (`Kernel.direct`). Only where `decodes_straight`."""
        attn, mlp = self.self_attn, self.mlp
        qkv, o, gate_up, down = (
            linear.kernels[kernel].direct(kernel) for linear in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down)
        )
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        norms = self.input_layernorm, self.post_attention_layernorm
        shape = [attn.rotated, attn.split[0], attn.split[1], attn.head_dim]
        assert attn.o_proj.dist is mlp.down.dist, "one tensor-parallel group a model"
        return LayerBlocks(
            (norms[0].weight, norms[0].eps, *_projections(qkv, o), shape, attn.scaling, attn.window or 0),
            (norms[1].weight, norms[1].eps, *_projections(gate_up, down)),
            attn.layer_idx,
            attn.o_proj.dist.all_reduce,
        )


class CausalLMOutput(NamedTuple):
    """A forward's result under the names CausalLM reads from every module (transformers' own output class
    names its cache field differently from one version to the next, and types it as a transformers Cache)."""

    logits: torch.Tensor
    past_key_values: KVCache | None  # None when called with use_cache=False


class TPCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, every weight holding only this rank's share."""

    def __init__(self, config: ModelConfig, weights: Weights, dist: DistInfo, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding.load(
            weights, "model.embed_tokens.weight", dist, mapped=not config.tie_word_embeddings
        )
        self.windows = _layer_windows(config)
        self.head_dim = head_size(config)
        self.kv_heads = config.num_key_value_heads // dist.world_size  # this shard's
        self.group = config.num_attention_heads // config.num_key_value_heads  # query heads a KV head
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, i, dist, window) for i, window in enumerate(self.windows)
        )
        self.norm = RMSNorm(weights.get_tensor("model.norm.weight"), config.rms_norm_eps)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead.load(weights, "lm_head.weight", dist, embedding=tied)
        self.rotary = RotaryEmbedding(config, device)
        # A paged step of decode rows runs the layers after the first through `DecoderLayer.decode` (eager
        # `forward` stays the path of every other step, and of every step where this is False).
        self.decodes_straight = all(layer.decodes_straight for layer in self.layers)
        # ... and through the C++ decode blocks (`DecoderLayer.decode` given `blocks`) where every projection of the
        # step's bucket is one op they call: each bucket's arguments found at its first step, after the load chose
        # the kernels (None: some projection is not).
        self.decodes_in_blocks = self.decodes_straight
        self._layer_blocks: dict[int, list[LayerBlocks] | None] = {}
        # bf16 on a CPU decodes with the op that reads only live keys; the matmul path, where it cannot be
        # built, reads whole buffers.
        self.decode_kernel = use_decode_kernel(weights.dtype, device)
        self.whole_decode = uses_matmul(weights.dtype, device) and not self.decode_kernel
        # The loaded LoRA adapters (adapters.py): adapter index i + 1 is adapter_names[i]; 0 is the base model.
        self.adapter_names: list[str] = []

    def new_cache(self, reserve: int = 0) -> PaddedKVCache:
        """An empty preallocating cache with `reserve` spare columns after the prefill (see kv_cache.py)."""
        return PaddedKVCache(self.config.num_hidden_layers, reserve, self.whole_decode)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        adapter_indices: Sequence[int] | None = None,
    ) -> CausalLMOutput:
        """HF-compatible forward; `logits_to_keep` > 0 computes logits only for the last positions.

        `adapter_indices` (one per row; 0 = the base model, i + 1 = `adapter_names[i]`) selects each row's
        LoRA adapter."""
        batch, seq_len = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = self.new_cache()
        cache = past_key_values if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq_len, device=input_ids.device).expand(batch, -1)
        if attention_mask is None:
            attention_mask = torch.ones(batch, past + seq_len, dtype=torch.long, device=input_ids.device)
        layout = TokenLayout.of(attention_mask, seq_len)
        segments = None
        if adapter_indices is not None:
            counts = [seq_len] * batch if layout.lengths is None else layout.lengths.tolist()
            segments = AdapterSegments.of(adapter_indices, counts, input_ids.device)
        hidden = self.embed_tokens(layout.pack(input_ids.reshape(-1)))
        cos, sin = self.rotary(hidden, layout.pack(position_ids.reshape(-1)))
        masks = self._masks(attention_mask, seq_len)
        firsts: dict[int | None, torch.Tensor | None] = {}
        if seq_len == 1 and self.decode_kernel and isinstance(cache, PaddedKVCache):
            firsts = {window: first_visible(mask, batch, input_ids.device) for window, mask in masks.items()}
        step = PaddedStep(layout, masks, cache, firsts)
        hidden, pending = self._layers(hidden, cos, sin, step, segments)
        if logits_to_keep:
            # Left padding: every row's newest positions are real tokens, the last ones of its packed run.
            keep = layout.last_positions(logits_to_keep)
            _, normed = self.norm.add(hidden[keep], pending[keep])
            logits = self.lm_head(normed).view(batch, logits_to_keep, -1)
        else:
            logits = layout.pad(self.lm_head(self.norm.add(hidden, pending)[1])).view(batch, seq_len, -1)
        return CausalLMOutput(logits, cache)

    @torch.inference_mode()
    def forward_paged(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        step: PagedStep,
        logits_index: torch.Tensor | None,
        segments: AdapterSegments | None,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        interrupt: threading.Event | None = None,
    ) -> torch.Tensor:
        """The paged engine's forward: `input_ids` [T] are every row's new tokens one row after another, and
        `position_ids` their rotary positions ([T], or M-RoPE's [3, T]); their keys and values are written to
        `step.slots`. Returns the logits [N, V] of the tokens `logits_index` picks (None: all T). `image_embeds`:
        (indices into T, their embeddings [n, H]), which replace those tokens' own (a VLM's image features at its
        image tokens, models/paged_vlm.py). Raises `Interrupted` between two layers once `interrupt` is set."""
        hidden = self.embed_tokens(input_ids)
        if image_embeds is not None:
            hidden[image_embeds[0]] = image_embeds[1].to(hidden.dtype)
        if position_ids.dim() == 1:
            cos, sin = self.rotary(hidden, position_ids)
        else:  # M-RoPE positions [3, T] (a Qwen2-VL prompt's image and the text between its images)
            cos, sin = self.rotary.multimodal(hidden, position_ids)
        if self.decodes_straight and segments is None and input_ids.shape[0] == len(step.seq_lens):
            hidden, pending = self._decode_layers(hidden, cos, sin, step, interrupt)
        else:
            hidden, pending = self._layers(hidden, cos, sin, step, segments, interrupt)
        if logits_index is not None:
            hidden, pending = hidden.index_select(0, logits_index), pending.index_select(0, logits_index)
        return self.lm_head(self.norm.add(hidden, pending)[1])

    def _layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PaddedStep | PagedStep,
        segments: AdapterSegments | None,
        interrupt: threading.Event | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer over the embedded tokens; (residual stream, last MLP output) as DecoderLayer."""
        pending: torch.Tensor | None = None
        for layer in self.layers:
            _check(interrupt)
            hidden, pending = layer(hidden, pending, cos, sin, step, segments)
        assert pending is not None, "a model has at least one layer"
        return hidden, pending

    def _decode_layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PagedStep,
        interrupt: threading.Event | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_layers` for a paged step of decode rows with no adapter rows, through `DecoderLayer.decode`: the linear
        kernels' bucket found once, and the rows' tables and lengths put once in the attention op's types
        (contiguous int32 and int64: a CUDA-graph step's tables are a slice of its static buffer)."""
        kernel = bucket(hidden.shape[0])
        step = replace(
            step,
            block_tables=step.block_tables.to(torch.int32).contiguous(),
            seq_lens=torch.as_tensor(step.seq_lens, dtype=torch.int64),
        )
        layers = cast("Sequence[DecoderLayer]", self.layers)
        blocks = self._blocks(layers, kernel) if self.decodes_in_blocks else None
        pending: torch.Tensor | None = None
        for i, layer in enumerate(layers):
            _check(interrupt)
            hidden, pending = layer.decode(
                hidden, pending, cos, sin, step, kernel, None if blocks is None else blocks[i]
            )
        assert pending is not None, "a model has at least one layer"
        return hidden, pending

    def _blocks(self, layers: Sequence[DecoderLayer], kernel: int) -> list[LayerBlocks] | None:
        """Every layer's arguments to the C++ decode blocks for bucket `kernel`, or None where a layer has none."""
        if kernel not in self._layer_blocks:
            found = [layer.blocks(kernel) for layer in layers]
            self._layer_blocks[kernel] = (
                None if any(args is None for args in found) else cast("list[LayerBlocks]", found)
            )
        return self._layer_blocks[kernel]

    def pool_shape(self, block_size: int) -> PoolShape:
        """The shape of one block of this shard's KV pool."""
        return PoolShape(len(self.layers), block_size, self.kv_heads, self.head_dim, self.embed_tokens.dtype)

    def _masks(self, attention_mask: torch.Tensor, seq_len: int) -> dict[int | None, torch.Tensor | None]:
        """One mask per distinct window size; None (SDPA's own causal path) when nothing needs masking."""
        no_padding = bool(attention_mask.all())
        total = attention_mask.shape[-1]
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in set(self.windows):
            # Without padding, a window only matters once the sequence outgrows it; a fresh prefill
            # (seq_len == total) or a single decode row needs no explicit mask then.
            if no_padding and (window is None or total <= window) and (seq_len == 1 or seq_len == total):
                masks[window] = None
                continue
            masks[window] = _attention_mask(attention_mask, seq_len, window)
        return masks


def load_tp_model(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    dist: DistInfo,
    quant: QuantConfig | None = None,
    aliases: dict[str, list[str]] | None = None,
) -> TPCausalLM:
    """This rank's share of a Llama-family model; ValueError if the architecture or sizes cannot be split.

    `quant`: the checkpoint's projections are stored quantized (layers/quantization.py). `aliases`: where the
    checkpoint stores the tensors under other names (Weights), the tied head's among them; by default a tied
    head is the embedding."""
    check_shardable(config, dist.world_size)
    if aliases is None:
        aliases = {"lm_head.weight": ["model.embed_tokens.weight"]} if config.tie_word_embeddings else {}
    weights = Weights.from_dir(Path(model_dir), device, dtype, dist.rank, dist.world_size, aliases, quant)
    model = TPCausalLM(config, weights, dist, device).eval()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if quant is not None:
        _log_quantized(quant, linears)
    if device.type == "cpu":
        # Once per shard start: the kernels this CPU runs fastest, measured on the loaded weights (a packed int4
        # weight has the one kernel that reads it).
        choose_linear_kernels(m for m in linears if m.packed is None)
    return model


def _log_quantized(quant: QuantConfig, linears: list[Linear]) -> None:
    packed = Counter(m.packed.path for m in linears if m.packed is not None)
    reasons = Counter(m.dequantized for m in linears if m.dequantized is not None)
    logger.info(
        "%s %d-bit (%s%s): %s%s",
        quant.method.upper(),
        quant.bits,
        f"groups of {quant.group_size}" if quant.group_size > 0 else "per channel",
        ", act-order" if quant.desc_act else "",
        ", ".join(f"{n} projections on the {path} kernel" for path, n in packed.items()) or "no packed kernel",
        "".join(f"; {n} dequantized at load for {why}" for why, n in reasons.items()),
    )
