"""KV caches of the padded CausalLM path, and the two batch operations they must support (filter, concatenate).

`PaddedKVCache` (the TP Llama family): per layer one preallocated buffer [B, kv_heads, capacity, head_dim] whose
live window is columns [offset, offset + length). A decode step writes its column in place, where transformers'
`DynamicCache` concatenates the whole cache into a new tensor on every step and layer (at batch 64 and a few
hundred positions that copy alone cost more than the model's matmuls). Filtering moves only the rows that fill
the holes left by finished requests and slides the window start; batches are only copied when concatenated or
when a buffer runs out of columns.

Any other transformers model keeps its `DynamicCache`; `filter_cache` / `concatenate_caches` give both the same
semantics, which is what `CausalLMBatch` relies on:
- rows follow the batch's request order; positions are right aligned with the attention mask (the newest column
  last, left padding first);
- `filter_cache(cache, order, keep_positions)`: row i of the result is old row `order[i]`, and only the newest
  `keep_positions` columns remain;
- `concatenate_caches(parts, kv_length, reserve)`: stack (cache, newest columns to keep) parts row-wise,
  right-aligned on `kv_length` columns, padding columns zero (the `reserve` columns after them unwritten).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # imported where a transformers network runs: a Llama shard may import no transformers
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

# Columns a full buffer grows by beyond what the current step needs: one regrowth every GROW decode steps.
GROW = 128


def spare_columns(decode_steps: int) -> int:
    """Columns to allocate beyond the prompt for `decode_steps` steps to come: at most GROW (growth covers
    the rest, and most requests stop early)."""
    return min(decode_steps, GROW)


class PaddedKVCache:
    """Preallocated K/V buffers with a sliding live window; `update` matches transformers' Cache.update.

    `whole_decode` (half precision on a CPU without the bf16 decode op of layers/decode_attention.py, which
    reads each row's live columns straight from the buffers): decode steps attend over every column of a
    buffer (`whole`), the ones outside the window masked. A window is a strided view, and the CPU's
    half-precision matmul copies such an operand whole into a contiguous tensor before every product: reading
    the dead and spare columns costs less than that copy (benchmark/attention.py; figures in
    benchmark/README.md). Such a cache keeps every column finite (spare columns are zeroed when allocated),
    since a masked column's zero weight times NaN is NaN.
    """

    def __init__(self, num_layers: int, reserve: int = 0, whole_decode: bool = False) -> None:
        self.num_layers = num_layers
        self.reserve = reserve  # spare columns to allocate up front beyond the prefill (the decode steps to come)
        self.whole_decode = whole_decode
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.offset = 0
        self.length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key`/`value` [B, H, S, D] after the live window; return the window including them.

        Every layer of one forward appends the same S columns, so the window advances after the last layer.
        """
        seq = key.shape[2]
        if layer_idx == 0:
            self._make_room(key, value, seq)
        end = self.offset + self.length
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:, :, end : end + seq] = key
        values[:, :, end : end + seq] = value
        if layer_idx == self.num_layers - 1:
            self.length += seq
        return keys[:, :, self.offset : end + seq], values[:, :, self.offset : end + seq]

    def whole(
        self, layer_idx: int, mask: torch.Tensor | None, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's whole buffers and `mask` [B or 1, 1, S, window] (None: all visible) widened onto their
        columns, False outside the `window` columns `update` just returned."""
        keys = self.keys[layer_idx]
        if mask is None:
            mask = torch.ones((1, 1, 1, window), dtype=torch.bool, device=keys.device)
        return (
            keys,
            self.values[layer_idx],
            F.pad(mask, (self.offset, keys.shape[2] - self.offset - window), value=False),
        )

    def spare_zeroed(self, buffer: torch.Tensor, written: int) -> torch.Tensor:
        """`buffer` with its columns from `written` on zeroed if decode reads whole buffers (else unwritten)."""
        if self.whole_decode:
            buffer[:, :, written:] = 0.0
        return buffer

    def _make_room(self, key: torch.Tensor, value: torch.Tensor, seq: int) -> None:
        if not self.keys:
            columns = seq + self.reserve
            # Uninitialised: a column is written (padding as zeros) before the window ever covers it.
            self.keys = [self.spare_zeroed(key.new_empty(_shape(key, columns)), seq) for _ in range(self.num_layers)]
            self.values = [
                self.spare_zeroed(value.new_empty(_shape(value, columns)), seq) for _ in range(self.num_layers)
            ]
            return
        if self.offset + self.length + seq <= self.capacity:
            return
        columns = self.length + seq + GROW
        for layers in (self.keys, self.values):
            for i, old in enumerate(layers):
                new = self.spare_zeroed(old.new_empty(_shape(old, columns)), self.length)
                new[:, :, : self.length] = old[:, :, self.offset : self.offset + self.length]
                layers[i] = new
        self.offset = 0

    @torch.inference_mode()  # the buffers are inference tensors: in-place row moves need the mode too
    def filter(self, order: list[int], keep_positions: int) -> None:
        """Keep rows `order` (row i <- old row order[i]) and the newest `keep_positions` columns, in place.

        An order from `fill_holes_from_tail` costs a copy of the moved rows' kept columns only; any other order
        copies all.
        """
        size = len(order)
        moves = [(dst, src) for dst, src in enumerate(order) if dst != src]
        if any(src < size for _, src in moves):
            index = torch.tensor(order, device=self.keys[0].device)
            self.keys = [buf.index_select(0, index) for buf in self.keys]
            self.values = [buf.index_select(0, index) for buf in self.values]
        else:
            # Only the columns that stay live, each copied once, straight into its row: the rest of a row is
            # dead (left of the new window) or not yet written (the reserve).
            end = self.offset + self.length
            start = end - keep_positions
            for buf in self.keys + self.values:
                for dst, src in moves:
                    buf[dst, :, start:end] = buf[src, :, start:end]
            self.keys = [buf[:size] for buf in self.keys]
            self.values = [buf[:size] for buf in self.values]
        self.offset += self.length - keep_positions
        self.length = keep_positions


def fill_holes_from_tail(kept: list[int]) -> list[int]:
    """A row order for the kept rows (ascending `kept`) that leaves the first len(kept) rows in place.

    Each position below len(kept) whose row left takes a kept row from beyond that point, so
    `PaddedKVCache.filter` copies only those rows.
    """
    size = len(kept)
    kept_set = set(kept)
    tail = [row for row in kept if row >= size]
    return [row if row in kept_set else tail.pop() for row in range(size)]


def _shape(like: torch.Tensor, columns: int) -> tuple[int, int, int, int]:
    return (like.shape[0], like.shape[1], columns, like.shape[3])


KVCache: TypeAlias = "PaddedKVCache | DynamicCache"


def filter_cache(cache: KVCache, order: list[int], keep_positions: int) -> None:
    """Rows `order`, newest `keep_positions` columns, in place (see the module docstring)."""
    if isinstance(cache, PaddedKVCache):
        cache.filter(order, keep_positions)
        return
    index: torch.Tensor | None = None
    for layer_idx, (keys, values) in enumerate(_windows(cache)):
        if index is None:
            index = torch.tensor(order, dtype=torch.long, device=keys.device)
        seq = keys.shape[2]
        _set_layer(cache, layer_idx, keys[index, :, seq - keep_positions :], values[index, :, seq - keep_positions :])


def _attention_layer(cache: DynamicCache, layer_idx: int) -> CacheLayerMixin:
    """A layer of the DynamicCache a transformers decoder fills: keys and values, no linear-attention state."""
    from transformers.cache_utils import CacheLayerMixin

    layer = cache.layers[layer_idx]
    assert isinstance(layer, CacheLayerMixin), f"layer {layer_idx} holds no keys and values: {type(layer).__name__}"
    return layer


def _windows(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of the live positions, per layer (of a cache a forward filled)."""
    if isinstance(cache, PaddedKVCache):
        end = cache.offset + cache.length
        return [
            (k[:, :, cache.offset : end], v[:, :, cache.offset : end])
            for k, v in zip(cache.keys, cache.values, strict=True)
        ]
    windows = []
    for layer_idx in range(len(cache.layers)):
        layer = _attention_layer(cache, layer_idx)
        assert layer.keys is not None and layer.values is not None, "a cache is filtered or joined after a forward"
        windows.append((layer.keys, layer.values))
    return windows


# What a source layer holds once concatenate_caches copied it: its own buffers are released at once.
_RELEASED = torch.empty(0)


def concatenate_caches(parts: list[tuple[KVCache, int]], kv_length: int, reserve: int) -> KVCache:
    """One cache of all parts' rows: each part's newest n columns right aligned on `kv_length` columns.

    The first part's object is reused (and returned); every part's source layer is released as soon as it is
    copied, so peak memory stays near one layer's worth above the result. `reserve` spare columns follow
    (PaddedKVCache only).
    """
    first = parts[0][0]
    windows = [_windows(c) for c, _ in parts]
    size = sum(w[0][0].shape[0] for w in windows)
    columns = kv_length + (reserve if isinstance(first, PaddedKVCache) else 0)
    for layer_idx in range(len(windows[0])):
        ref_k, ref_v = windows[0][layer_idx]
        # Uninitialised, then each part's rows written once: its left padding as zeros (padded keys must be
        # finite), its columns copied. The reserve stays unwritten, as PaddedKVCache allows. Zero-filling the
        # whole buffer first wrote every byte twice (benchmark/README.md, "Figures behind the shard's code").
        keys = ref_k.new_empty((size, ref_k.shape[1], columns, ref_k.shape[3]))
        values = ref_v.new_empty((size, ref_v.shape[1], columns, ref_v.shape[3]))
        del ref_k, ref_v
        start = 0
        for (cache, n), part in zip(parts, windows, strict=True):
            k, v = part[layer_idx]
            rows = k.shape[0]
            keys[start : start + rows, :, : kv_length - n] = 0.0
            values[start : start + rows, :, : kv_length - n] = 0.0
            keys[start : start + rows, :, kv_length - n : kv_length] = k[:, :, k.shape[2] - n :]
            values[start : start + rows, :, kv_length - n : kv_length] = v[:, :, v.shape[2] - n :]
            start += rows
            del k, v
            part[layer_idx] = (_RELEASED, _RELEASED)
            _set_layer(cache, layer_idx, _RELEASED, _RELEASED)
        if isinstance(first, PaddedKVCache):
            keys, values = (first.spare_zeroed(x, kv_length) for x in (keys, values))
        _set_layer(first, layer_idx, keys, values)
    if isinstance(first, PaddedKVCache):
        first.offset, first.length = 0, kv_length
    return first


def _set_layer(cache: KVCache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(cache, PaddedKVCache):
        cache.keys[layer_idx], cache.values[layer_idx] = keys, values
    else:
        layer = _attention_layer(cache, layer_idx)
        layer.keys, layer.values = keys, values
