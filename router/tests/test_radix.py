"""The prefix trie (pure): TGI's radix.rs cases (insertions, lookups, eviction order) with one token per
block, then whole-block matching and reference counts with larger blocks."""

from __future__ import annotations

import pytest

from textgen_router.radix import RadixTrie


def trie_of(*runs: list[int], block_size: int = 1) -> RadixTrie:
    trie = RadixTrie(block_size)
    for run in runs:
        trie.insert(run, run[::block_size])  # block ids = first token of each block: easy to read back
    return trie


def test_insert_returns_the_tokens_cached_already() -> None:
    trie = RadixTrie()
    assert trie.insert([0, 1, 2], [0, 1, 2]) == 0
    assert trie.insert([0, 1, 2], [0, 1, 2]) == 3  # already there
    assert trie.insert([1, 2, 3], [1, 2, 3]) == 0  # a new branch at the root
    assert trie.insert([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]) == 3  # extends a leaf
    assert trie.insert([0, 1, 2, 3, 5, 6, 7], [0, 1, 2, 3, 5, 6, 7]) == 4  # splits the node [3, 4]
    assert trie.insert([0, 1], [9, 9]) == 2  # a prefix of a node: nothing new


def test_find_returns_the_blocks_of_the_longest_prefix() -> None:
    trie = trie_of([0, 1, 2], [1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 5, 6, 7])
    assert trie.find([0])[1] == [0]
    assert trie.find([0, 1, 2])[1] == [0, 1, 2]
    assert trie.find([1, 2, 3])[1] == [1, 2, 3]
    assert trie.find([0, 1, 2, 3])[1] == [0, 1, 2, 3]
    assert trie.find([0, 1, 2, 3, 4])[1] == [0, 1, 2, 3, 4]
    assert trie.find([0, 1, 2, 3, 5])[1] == [0, 1, 2, 3, 5]
    assert trie.find([0, 1, 2, 3, 5, 6, 9, 9])[1] == [0, 1, 2, 3, 5, 6]
    assert trie.find([7, 0, 1]) == (trie.root, [])
    assert trie.find([]) == (trie.root, [])


def test_the_blocks_of_an_earlier_insertion_win() -> None:
    trie = RadixTrie()
    trie.insert([0, 1], [10, 11])
    assert trie.insert([0, 1, 2], [20, 21, 22]) == 2
    assert trie.find([0, 1, 2])[1] == [10, 11, 22]


def test_evict_takes_least_recently_used_leaves_first() -> None:
    trie = trie_of([0, 1, 2], [0, 1, 2, 3, 5, 6, 7], [0, 1, 2, 3, 4], [1, 2, 3])
    # Fewer blocks than the oldest leaf holds: only its tail goes, the rest stays findable.
    assert trie.evict(1) == [7]
    assert trie.find([0, 1, 2, 3, 5, 6, 7])[1] == [0, 1, 2, 3, 5, 6]
    # Touch the other leaves: [5, 6] is now the oldest and goes whole.
    trie.find([0, 1, 2, 3, 4])
    trie.find([1, 2, 3])
    assert trie.evict(2) == [5, 6]
    assert trie.find([0, 1, 2, 3, 5, 6, 7])[1] == [0, 1, 2, 3]
    trie.find([1, 2, 3])
    # More than a leaf: its emptied parent becomes a leaf in turn, oldest first.
    assert trie.evict(3) == [4, 3, 2]
    assert trie.find([0, 1, 2, 3, 4])[1] == [0, 1]
    # Everything.
    assert trie.evict(10) == [1, 2, 3, 0, 1]
    assert trie.find([0, 1]) == (trie.root, [])
    assert trie.evict(1) == []


def test_referenced_nodes_and_their_ancestors_are_not_evicted() -> None:
    trie = trie_of([0, 1, 2], [0, 1, 2, 3, 4], [5, 6])
    node, blocks = trie.find([0, 1, 2, 3, 4])
    assert blocks == [0, 1, 2, 3, 4]
    trie.incref(node)
    assert trie.evict(10) == [5, 6]  # only the unreferenced branch
    trie.decref(node)
    assert sorted(trie.evict(10)) == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="underflow"):
        trie.decref(node)


def test_a_partial_match_references_the_node_it_reads_from() -> None:
    trie = trie_of([0, 1, 2, 3])
    node, blocks = trie.find([0, 1, 9])
    assert blocks == [0, 1]
    trie.incref(node)
    assert trie.evict(4) == []  # the node holds blocks 0 and 1 in use: none of its blocks may go
    # Splitting the referenced node keeps the reference on its tail, which keeps the head (its parent) too.
    assert trie.insert([0, 1, 7], [0, 1, 7]) == 2
    assert trie.evict(4) == [7]
    trie.decref(node)
    assert sorted(trie.evict(4)) == [0, 1, 2, 3]


def test_whole_blocks_only() -> None:
    trie = RadixTrie(block_size=2)
    assert trie.insert([1, 2, 3, 4], [10, 11]) == 0
    assert trie.find([1, 2, 3, 4, 5])[1] == [10, 11]
    assert trie.find([1, 2, 3])[1] == [10]  # the half block [3] is not a match
    assert trie.find([1, 2, 3, 9])[1] == [10]
    assert trie.find([1, 9, 3, 4])[1] == []  # one differing token spoils its whole block
    assert trie.insert([1, 2, 5, 6, 7, 8], [10, 20, 21]) == 2
    assert trie.find([1, 2, 5, 6, 7, 8])[1] == [10, 20, 21]
    assert trie.evict(1) == [11]  # the oldest leaf: [3, 4]
    with pytest.raises(ValueError, match="do not fill"):
        trie.insert([1, 2, 3], [10, 11])


def test_repeated_lookups_do_not_grow_the_eviction_heap() -> None:
    trie = trie_of([0, 1, 2], [3, 4])
    for _ in range(1000):
        trie.find([0, 1, 2])
    assert len(trie._evictable) <= 2 * 2 + 64
    assert trie.evict(10) == [3, 4, 0, 1, 2]
