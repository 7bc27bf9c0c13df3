"""A radix trie of cached prompt prefixes, in whole KV blocks (TGI v3's `radix.rs`, after sglang's radix
attention).

A key is a run of token ids cut into blocks of `block_size` tokens; each block of a key maps to the id of the
KV block holding those tokens' keys and values. Inserting a run also makes each of its block-aligned prefixes
findable, so a node's key and its block ids always have the same number of blocks, and a lookup only ever
matches whole blocks (a half-filled block's KV would be wrong to share: its other slots belong to someone).

Each node counts its references: one per child, plus one per allocation reading its blocks. A node without
references is therefore a leaf nobody uses, and only such nodes are evicted, least recently used first
(`evict` may cut a leaf short from its end, which keeps its remaining prefix valid). Time is a counter bumped
by every `find` and `insert`, cheaper than a clock and just as ordered. Pure data structure, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

BlockKey = tuple[int, ...]  # the token ids of one block


class Node:
    """One run of blocks: `key` (token ids per block) and the KV block ids holding them, 1:1."""

    __slots__ = ("key", "blocks", "children", "parent", "ref_count", "last_accessed", "serial", "removed")

    def __init__(self, key: list[BlockKey], blocks: list[int], parent: Node | None, time: int, serial: int) -> None:
        self.key = key
        self.blocks = blocks
        self.children: dict[BlockKey, Node] = {}  # by the first block of the child's key
        self.parent = parent
        self.ref_count = 0
        self.last_accessed = time
        self.serial = serial  # breaks ties between equally old leaves: older nodes go first
        self.removed = False


def _shared_blocks(a: Sequence[BlockKey], b: Sequence[BlockKey]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter run bounds the match
        if x != y:
            break
        n += 1
    return n


class RadixTrie:
    """Cached prefixes by block; see the module docstring. `root` holds no blocks and is never evicted."""

    def __init__(self, block_size: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.time = 0
        self._serials = itertools.count()
        self.root = Node([], [], None, 0, next(self._serials))
        # Unreferenced nodes as (last_accessed, serial, node). Entries go stale when a node is used, touched or
        # removed; `evict` skips those, so nothing has to be searched out of the heap.
        self._evictable: list[tuple[int, int, Node]] = []
        self._nodes = 0  # live nodes besides the root: bounds the heap's stale entries

    def _block_keys(self, tokens: Sequence[int]) -> list[BlockKey]:
        """`tokens` cut into whole blocks; a trailing partial block is left out."""
        bs = self.block_size
        return [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]

    def find(self, tokens: Sequence[int]) -> tuple[Node, list[int]]:
        """The longest cached block-aligned prefix of `tokens`: (node to reference, its KV block ids).

        The blocks cover `len(blocks) * block_size` leading tokens. The node is the deepest one the match
        reached, also when it matched only part of that node's blocks: referencing it keeps every returned
        block (its own and its ancestors') from eviction. The nodes walked count as accessed now.
        """
        self.time += 1
        keys = self._block_keys(tokens)
        node, blocks, i = self.root, [], 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            self._touch(child)
            shared = _shared_blocks(child.key, keys[i:])
            blocks.extend(child.blocks[:shared])
            node, i = child, i + shared
            if shared < len(child.key):
                break
        return node, blocks

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache `blocks` as the KV of `tokens` (a whole number of blocks, one block id per block).

        Returns how many leading tokens were cached already: for those, the trie keeps its own blocks and the
        caller's are duplicates it may free.
        """
        keys = self._block_keys(tokens)
        if len(keys) * self.block_size != len(tokens) or len(keys) != len(blocks):
            raise ValueError(f"{len(tokens)} tokens do not fill {len(blocks)} blocks of {self.block_size}")
        self.time += 1
        node, i, blocks = self.root, 0, list(blocks)
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                self._add_child(node, keys[i:], blocks[i:])
                break
            self._touch(child)
            shared = _shared_blocks(child.key, keys[i:])
            if shared < len(child.key):
                if i + shared == len(keys):
                    i += shared
                    break
                child = self._split(child, shared)
            node, i = child, i + shared
        return i * self.block_size

    def incref(self, node: Node) -> None:
        """One more user of `node`'s blocks (and so of its ancestors'): it cannot be evicted until decref."""
        if node is not self.root:
            node.ref_count += 1

    def decref(self, node: Node) -> None:
        """One user fewer; a node left unreferenced becomes evictable."""
        if node is self.root:
            return
        if node.ref_count <= 0:
            raise RuntimeError("radix trie reference count underflow")
        node.ref_count -= 1
        if node.ref_count == 0:
            self._push(node)

    def evict(self, n_blocks: int) -> list[int]:
        """Free up to `n_blocks` cached blocks, least recently used leaves first; returns their ids.

        Fewer come back when the unreferenced leaves hold fewer. A leaf with more blocks than needed loses
        only its last ones.
        """
        evicted: list[int] = []
        while len(evicted) < n_blocks and self._evictable:
            last_accessed, _, node = heapq.heappop(self._evictable)
            if not self._current(last_accessed, node):
                continue
            needed = n_blocks - len(evicted)
            if needed >= len(node.blocks):
                evicted.extend(node.blocks)
                self._remove(node)
            else:
                evicted.extend(node.blocks[-needed:])
                del node.blocks[-needed:], node.key[-needed:]
                self._push(node)
        return evicted

    @staticmethod
    def _current(last_accessed: int, node: Node) -> bool:
        """Whether a heap entry still stands for an evictable node (not removed, used again or touched since)."""
        return not node.removed and node.ref_count == 0 and node.last_accessed == last_accessed

    def _push(self, node: Node) -> None:
        heap = self._evictable
        heapq.heappush(heap, (node.last_accessed, node.serial, node))
        if len(heap) > 2 * self._nodes + 64:
            # Lookups of unreferenced nodes leave stale entries behind: drop them (and duplicates) now and then.
            live = {id(e[2]): e for e in heap if self._current(e[0], e[2])}
            self._evictable = list(live.values())
            heapq.heapify(self._evictable)

    def _touch(self, node: Node) -> None:
        node.last_accessed = self.time
        if node.ref_count == 0:  # still evictable: its heap entry moves to the new time
            self._push(node)

    def _add_child(self, parent: Node, key: list[BlockKey], blocks: list[int]) -> Node:
        child = Node(key, blocks, parent, self.time, next(self._serials))
        self._nodes += 1
        if parent.children.get(key[0]) is None:
            self.incref(parent)  # a parent is referenced by each child (a replaced child passes its reference on)
        parent.children[key[0]] = child
        self._push(child)
        return child

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node` after its first `n` blocks; returns the new node holding them, now `node`'s parent.

        `node` keeps its identity (and the references allocations hold on it) with the rest of its blocks.
        """
        assert node.parent is not None
        head = self._add_child(node.parent, node.key[:n], node.blocks[:n])
        node.key, node.blocks = node.key[n:], node.blocks[n:]
        node.parent = head
        head.children[node.key[0]] = node
        self.incref(head)
        return head

    def _remove(self, node: Node) -> None:
        assert node.parent is not None and not node.children
        node.removed = True
        self._nodes -= 1
        del node.parent.children[node.key[0]]
        self.decref(node.parent)
