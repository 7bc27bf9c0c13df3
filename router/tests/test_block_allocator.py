"""Block allocators (pure): TGI's SimpleAllocator / RadixAllocator cases, slots, and this router's rule that
only a prefilled request's prompt is cached."""

from __future__ import annotations

import random

import pytest

from textgen_router.block_allocator import BlockAllocation, BlockAllocator, RadixAllocator, SimpleAllocator


def cached(allocation: BlockAllocation) -> None:
    allocation.release(cache_prompt=True)


# -- the simple allocator --------------------------------------------------------------------------------------


def test_simple_allocator_hands_out_the_last_free_blocks_and_never_block_0() -> None:
    allocator = SimpleAllocator(n_blocks=5, block_size=4)
    a = allocator.allocate(6)
    assert a is not None and a.blocks == [3, 4] and a.prefix_len == 0
    assert a.slots == [12, 13, 14, 15, 16, 17]  # each block's slots in order, cut at the token count
    b = allocator.allocate(8)
    assert b is not None and b.blocks == [1, 2]
    assert allocator.allocate(1) is None  # block 0 stays reserved
    a.release(cache_prompt=True)
    c = allocator.allocate(5, prompt=[1, 2, 3, 4, 5])  # the prompt is ignored: no prefix caching
    assert c is not None and c.blocks == [3, 4] and c.prefix_len == 0


def test_simple_allocator_wraps_slots_inside_a_sliding_window() -> None:
    allocator = SimpleAllocator(n_blocks=10, block_size=2, window_size=3)
    a = allocator.allocate(7)
    assert a is not None and a.blocks == [8, 9]  # 3 tokens kept: 2 blocks
    assert a.slots == [16, 17, 18, 19, 16, 17, 18]


def test_release_twice_is_a_bug() -> None:
    allocator = SimpleAllocator(n_blocks=3, block_size=1)
    a = allocator.allocate(1)
    assert a is not None
    a.release(cache_prompt=False)
    with pytest.raises(RuntimeError, match="twice"):
        a.release(cache_prompt=False)
    assert sorted(allocator.free_blocks) == [1, 2]


def test_for_shards_sizes_the_pool_from_the_batch_tokens() -> None:
    simple = BlockAllocator.for_shards(100, 16, prefix_caching=False, window_size=None)
    assert (
        isinstance(simple, SimpleAllocator) and simple.n_blocks == 6 and sorted(simple.free_blocks) == [1, 2, 3, 4, 5]
    )
    radix = BlockAllocator.for_shards(100, 16, prefix_caching=True, window_size=None)
    assert isinstance(radix, RadixAllocator) and radix.trie.block_size == 16


# -- the radix allocator: TGI's cases (one token per block) ----------------------------------------------------


def test_radix_allocator_reuses_prefixes() -> None:
    allocator = RadixAllocator(n_blocks=12, block_size=1)
    a = allocator.allocate(8, [0, 1, 2, 3])
    assert a is not None and a.blocks == [4, 5, 6, 7, 8, 9, 10, 11] and a.slots == a.blocks and a.prefix_len == 0
    cached(a)
    a = allocator.allocate(8, [0, 1, 2, 3])
    assert a is not None and a.blocks == [4, 5, 6, 7, 8, 9, 10, 11] and a.prefix_len == 4


def test_radix_allocator_evicts_older_prefixes_first() -> None:
    allocator = RadixAllocator(n_blocks=7, block_size=1)
    a1 = allocator.allocate(4, [0, 1, 2, 3])
    a2 = allocator.allocate(2, [4, 5])
    assert a1 is not None and a1.blocks == [3, 4, 5, 6]
    assert a2 is not None and a2.blocks == [1, 2]
    cached(a1)
    cached(a2)
    a3 = allocator.allocate(4, [6, 7, 8, 9])
    assert a3 is not None and a3.blocks == [3, 4, 5, 6] and a3.prefix_len == 0
    assert allocator.allocate(1, [4, 5]).prefix_len == 2  # type: ignore[union-attr]  # the newer prefix stayed


def test_radix_allocator_frees_fully_overlapping_prefills() -> None:
    allocator = RadixAllocator(n_blocks=10, block_size=1)
    a1 = allocator.allocate(4, [0, 1, 2, 3])
    a2 = allocator.allocate(4, [0, 1, 2, 3])
    assert a1 is not None and a2 is not None
    cached(a2)
    cached(a1)  # the trie has a2's blocks already: a1's all return
    a3 = allocator.allocate(4, [0, 1, 2, 3])
    assert a3 is not None and a3.prefix_len == 4
    assert len(allocator.free_blocks) == 10 - 1 - 4


def test_radix_allocator_frees_partially_overlapping_prefills() -> None:
    allocator = RadixAllocator(n_blocks=20, block_size=1)
    a1 = allocator.allocate(4, [0, 1])
    assert a1 is not None and a1.blocks == [16, 17, 18, 19] and a1.prefix_len == 0
    cached(a1)
    a2 = allocator.allocate(8, [0, 1, 2, 3, 4, 5])
    assert a2 is not None and a2.blocks == [16, 17, 12, 13, 14, 15, 18, 19] and a2.prefix_len == 2
    a3 = allocator.allocate(8, [0, 1, 2, 3, 6, 7])
    assert a3 is not None and a3.blocks == [16, 17, 6, 7, 8, 9, 10, 11] and a3.prefix_len == 2
    cached(a3)
    cached(a2)  # [0 1 2 3] is a3's by now: a2 keeps only [4 5] in the trie
    assert len(allocator.free_blocks) == 11  # 19 usable, 6 cached from a3, 2 from a2
    a4 = allocator.allocate(6, [0, 1, 2, 3, 4, 5])
    assert a4 is not None and a4.blocks == [16, 17, 6, 7, 14, 15] and a4.prefix_len == 6
    assert len(allocator.free_blocks) == 11
    a5 = allocator.allocate(6, [0, 1, 2, 3, 6, 7])
    assert a5 is not None and a5.blocks == [16, 17, 6, 7, 8, 9] and a5.prefix_len == 6
    assert len(allocator.free_blocks) == 11


# -- the radix allocator: blocks of several tokens, and when a prompt is cached ---------------------------------


def test_a_prefix_hit_covers_whole_blocks_and_slots_start_at_the_first_cached_block() -> None:
    allocator = RadixAllocator(n_blocks=16, block_size=4)
    prompt = list(range(10))  # two whole blocks and a half one
    a = allocator.allocate(14, prompt)
    assert a is not None and a.blocks == [12, 13, 14, 15]
    cached(a)
    assert sorted(allocator.free_blocks) == list(range(1, 12)) + [14, 15]  # only the 2 whole prompt blocks stay
    b = allocator.allocate(13, [*range(8), 42, 43])
    assert b is not None and b.prefix_len == 8 and b.blocks[:2] == [12, 13] and len(b.blocks) == 4
    assert b.slots[:8] == list(range(48, 56))  # the cached prefix's slots lead, the shard writes from slot 8
    assert len(b.slots) == 13 and b.slots[8:12] == list(range(b.blocks[2] * 4, b.blocks[2] * 4 + 4))


def test_a_request_not_prefilled_caches_nothing_and_keeps_the_prefix_it_read() -> None:
    allocator = RadixAllocator(n_blocks=8, block_size=2)
    first = allocator.allocate(6, [1, 2, 3, 4])
    assert first is not None
    first.release(cache_prompt=False)  # e.g. dropped before (or amid) its prefill: its KV may be missing
    assert allocator.allocate(4, [1, 2, 3, 4]).prefix_len == 0  # type: ignore[union-attr]
    allocator = RadixAllocator(n_blocks=8, block_size=2)
    done = allocator.allocate(4, [1, 2, 3, 4])
    assert done is not None
    cached(done)
    partial = allocator.allocate(8, [1, 2, 3, 4, 5, 6])
    assert partial is not None and partial.prefix_len == 4
    partial.release(cache_prompt=False)
    assert sorted(allocator.free_blocks) == [1, 2, 3, 4, 5]  # its 2 new blocks came back, the cached 2 stayed
    again = allocator.allocate(6, [1, 2, 3, 4, 5, 6])
    assert again is not None and again.prefix_len == 4 and again.blocks[:2] == done.blocks[:2]


def test_prefill_logprobs_skip_the_lookup_and_the_caching() -> None:
    allocator = RadixAllocator(n_blocks=8, block_size=1)
    a = allocator.allocate(3, None)
    assert a is not None and a.prefix_len == 0
    cached(a)
    assert sorted(allocator.free_blocks) == list(range(1, 8))


def test_a_failed_allocation_leaves_the_prefix_it_found_evictable() -> None:
    allocator = RadixAllocator(n_blocks=5, block_size=1)
    a = allocator.allocate(2, [1, 2])
    assert a is not None
    cached(a)
    assert allocator.allocate(10, [1, 2, 3]) is None  # 2 cached + 2 free blocks: too few
    b = allocator.allocate(4, [7, 8, 9, 10])  # needs the cached blocks back
    assert b is not None and sorted(b.blocks) == [1, 2, 3, 4]


def test_a_referenced_prefix_is_never_evicted() -> None:
    allocator = RadixAllocator(n_blocks=5, block_size=1)
    a = allocator.allocate(2, [1, 2])
    assert a is not None
    cached(a)
    b = allocator.allocate(3, [1, 2, 3])  # reads the cached [1 2], takes one more block
    assert b is not None and b.prefix_len == 2
    assert allocator.allocate(2, [9, 9]) is None  # 1 free block; [1 2] is in use
    b.release(cache_prompt=True)
    c = allocator.allocate(4, [9, 9, 9, 9])
    assert c is not None and sorted(c.blocks) == [1, 2, 3, 4]


def trie_blocks(allocator: RadixAllocator) -> list[int]:
    blocks, stack = [], [allocator.trie.root]
    while stack:
        node = stack.pop()
        blocks.extend(node.blocks)
        stack.extend(node.children.values())
    return blocks


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_random_traffic_never_loses_or_shares_a_writable_block(block_size: int) -> None:
    rng = random.Random(block_size)
    allocator = RadixAllocator(n_blocks=40, block_size=block_size)
    live: list[BlockAllocation] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).release(cache_prompt=rng.random() < 0.7)
        else:
            # Prompts over a tiny vocabulary share prefixes often.
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            a = allocator.allocate(len(prompt) + rng.randrange(1, 6), None if rng.random() < 0.1 else prompt)
            if a is not None:
                assert a.prefix_len % block_size == 0 and a.prefix_len <= len(prompt)
                live.append(a)
        cached = trie_blocks(allocator)
        written = [b for a in live for b in a.blocks[a.prefix_len // block_size :]]
        everything = list(allocator.free_blocks) + cached + written
        assert sorted(everything) == list(range(1, 40))  # each block in exactly one place
        assert all(b in cached for a in live for b in a.blocks[: a.prefix_len // block_size])
