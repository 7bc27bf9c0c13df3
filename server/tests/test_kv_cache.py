"""PaddedKVCache must hold exactly what transformers' DynamicCache holds through every batch operation."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from textgen_server.models.kv_cache import (
    GROW,
    PaddedKVCache,
    _windows,
    concatenate_caches,
    fill_holes_from_tail,
    filter_cache,
)

LAYERS, HEADS, DIM = 3, 2, 4


def _step(caches: list, batch: int, seq: int, gen: torch.Generator) -> None:
    """Append the same random K/V to every cache, checking the returned windows agree."""
    for layer in range(LAYERS):
        k = torch.randn(batch, HEADS, seq, DIM, generator=gen)
        v = torch.randn(batch, HEADS, seq, DIM, generator=gen)
        outs = [cache.update(k, v, layer) for cache in caches]
        for keys, values in outs[1:]:
            assert torch.equal(keys, outs[0][0]) and torch.equal(values, outs[0][1])


def _leave_nan_blocks(shape: tuple[int, ...], count: int) -> None:
    """Allocate and free `count` NaN-filled tensors of `shape`: the allocator's next blocks of that size hold NaN."""
    blocks = [torch.full(shape, float("nan")) for _ in range(count)]
    del blocks


def _same(a: PaddedKVCache, b: DynamicCache) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    for (ka, va), (kb, vb) in zip(_windows(a), _windows(b), strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@torch.inference_mode()
def test_padded_cache_matches_dynamic_cache_through_growth_filter_and_concatenate() -> None:
    gen = torch.Generator().manual_seed(0)
    padded, dynamic = PaddedKVCache(LAYERS, reserve=2), DynamicCache()
    _step([padded, dynamic], 6, 5, gen)  # prefill
    for _ in range(GROW + 3):  # past the reserve and one growth
        _step([padded, dynamic], 6, 1, gen)
    _same(padded, dynamic)
    assert padded.capacity < 5 + GROW + 3 + GROW + 1  # grew by GROW once, not per step

    order = fill_holes_from_tail([0, 2, 3, 5])  # rows 1 and 4 leave
    assert order == [0, 5, 2, 3]
    filter_cache(padded, order, keep_positions=20)
    filter_cache(dynamic, order, keep_positions=20)
    _same(padded, dynamic)
    _step([padded, dynamic], 4, 1, gen)  # a decode step after the filter writes into the slid window
    _same(padded, dynamic)

    joiner_p, joiner_d = PaddedKVCache(LAYERS), DynamicCache()
    _step([joiner_p, joiner_d], 3, 7, gen)
    # The merged buffers start uninitialised: leave NaN in the memory the allocator is about to hand out, so
    # the left padding is zero only if concatenation wrote it.
    _leave_nan_blocks((7, HEADS, 25, DIM), 2 * LAYERS)
    merged_p = concatenate_caches([(padded, 21), (joiner_p, 7)], kv_length=21, reserve=4)
    merged_d = concatenate_caches([(dynamic, 21), (joiner_d, 7)], kv_length=21, reserve=4)
    assert merged_p is padded and merged_d is dynamic
    _same(merged_p, merged_d)
    assert merged_p.capacity == 25
    keys = _windows(merged_p)[0][0]
    assert keys.shape[:3] == (7, HEADS, 21) and not keys[4:, :, :14].any()  # joiners right aligned, zeros left
    _step([merged_p, merged_d], 7, 1, gen)
    _same(merged_p, merged_d)


@torch.inference_mode()
def test_filter_with_any_order_copies_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    padded, dynamic = PaddedKVCache(LAYERS), DynamicCache()
    _step([padded, dynamic], 4, 3, gen)
    for cache in (padded, dynamic):
        filter_cache(cache, [3, 0], keep_positions=3)  # not a holes-from-tail order: a full reorder
    _same(padded, dynamic)


@torch.inference_mode()
def test_whole_decode_cache_keeps_every_column_finite_and_masks_outside_the_window() -> None:
    gen = torch.Generator().manual_seed(2)
    padded, dynamic = PaddedKVCache(LAYERS, reserve=3, whole_decode=True), DynamicCache()
    _leave_nan_blocks((4, HEADS, 8, DIM), 2 * LAYERS)  # the buffers' spare columns must be zeroed, not NaN
    _step([padded, dynamic], 4, 5, gen)
    for _ in range(5):  # past the reserve: one growth
        _step([padded, dynamic], 4, 1, gen)
    filter_cache(padded, [0, 3, 2], keep_positions=7)  # the window slides right (offset 3)
    filter_cache(dynamic, [0, 3, 2], keep_positions=7)
    _same(padded, dynamic)
    for layer in range(LAYERS):
        assert padded.keys[layer].isfinite().all() and padded.values[layer].isfinite().all()

    window_mask = torch.tensor([[True] * 7, [False] * 2 + [True] * 5, [True] * 7])[:, None, None, :]
    keys, values, mask = padded.whole(0, window_mask, 7)
    assert keys is padded.keys[0] and values is padded.values[0]
    assert mask.shape == (3, 1, 1, padded.capacity)
    assert not mask[..., : padded.offset].any() and not mask[..., padded.offset + 7 :].any()
    assert torch.equal(mask[..., padded.offset : padded.offset + 7], window_mask)
    _, _, all_visible = padded.whole(0, None, 7)
    assert all_visible.shape == (1, 1, 1, padded.capacity) and int(all_visible.sum()) == 7

    joiner = PaddedKVCache(LAYERS, whole_decode=True)
    _step([joiner], 2, 4, gen)
    _leave_nan_blocks((5, HEADS, 11, DIM), 2 * LAYERS)
    merged = concatenate_caches([(padded, 7), (joiner, 4)], kv_length=7, reserve=4)
    for layer in range(LAYERS):
        assert merged.keys[layer].isfinite().all() and merged.values[layer].isfinite().all()
