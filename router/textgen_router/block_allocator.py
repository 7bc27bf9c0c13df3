"""The router's view of the shards' KV pool: which blocks (and token slots) each request may write.

TGI v3 (`block_allocator.rs`, `radix.rs`): the pool holds `max_batch_total_tokens // block_size` blocks of
`block_size` token slots, the same on every shard; block 0 is never handed out (the health probe writes it).
A request needing `tokens` slots (prompt + max_new_tokens + speculation - 1) gets `ceil(tokens / block_size)`
blocks, and `slots` lists, block after block, each block's slots `block * block_size + offset`, cut at `tokens`.
With a cached prefix the leading blocks are the cached ones and `slots` still starts at the first of them: the
first `prefix_len` slots hold KV already computed, the shard writes from slot `prefix_len` on.

- `SimpleAllocator` (no prefix caching): a free list; a sliding window caps the blocks at the window and the
  slots wrap around them.
- `RadixAllocator` (prefix caching): looks the prompt up in a `RadixTrie`, reuses the cached blocks of its
  longest block-aligned prefix (referenced, so never evicted while in use), takes the rest from the free list,
  evicting unused cached prefixes when it runs short.

`BlockAllocation.release(cache_prompt)` gives the blocks back exactly once. The radix allocator then caches
the allocation's block-aligned prompt, but only when `cache_prompt` says its prefill completed: stricter than
TGI, which caches on every drop, even of a request whose KV was never (or only partly) computed.
Pure data structures, no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from textgen_common.free_blocks import FreeBlocks

from .radix import Node, RadixTrie


@dataclass(eq=False)
class BlockAllocation:
    """The blocks and slots of one request (the gRPC Request.blocks / Request.slots).

    `prefix_len`: leading tokens whose KV is already in `blocks` (a prefix-cache hit; a multiple of the block
    size). `prompt`: the prompt ids looked up, or None when the lookup was skipped. `node`: the trie node
    referenced for the hit (radix allocator only).
    """

    blocks: list[int]
    slots: list[int]
    prefix_len: int
    allocator: BlockAllocator
    prompt: Sequence[int] | None = None
    node: Node | None = None
    released: bool = False

    def release(self, cache_prompt: bool) -> None:
        """Give the blocks back; `cache_prompt`: the prompt's KV is complete and may be cached (radix only)."""
        if self.released:
            raise RuntimeError("block allocation released twice")
        self.released = True
        self.allocator.free(self, cache_prompt)


class BlockAllocator(ABC):
    """A pool of `n_blocks` blocks of `block_size` slots; block 0 reserved."""

    def __init__(self, n_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.free_blocks = FreeBlocks(n_blocks)

    @classmethod
    def for_shards(
        cls, max_batch_total_tokens: int, block_size: int, prefix_caching: bool, window_size: int | None
    ) -> BlockAllocator:
        """TGI's choice: the radix allocator when the shards cache prefixes, else the simple one."""
        n_blocks = max_batch_total_tokens // block_size
        if prefix_caching:
            return RadixAllocator(n_blocks, block_size)
        return SimpleAllocator(n_blocks, block_size, window_size)

    @abstractmethod
    def allocate(self, tokens: int, prompt: Sequence[int] | None = None) -> BlockAllocation | None:
        """Blocks and slots for `tokens` tokens, None when the pool cannot hold them now.

        `prompt`: the prompt ids to look up in the prefix cache (None skips the lookup and the caching).
        """

    @abstractmethod
    def free(self, allocation: BlockAllocation, cache_prompt: bool) -> None:
        """Take `allocation`'s blocks back (through `BlockAllocation.release`, which makes it happen once)."""

    def _slots(self, blocks: Sequence[int], tokens: int) -> list[int]:
        """Each block's slots in order, cycling through `blocks`, until there are `tokens` of them."""
        bs = self.block_size
        slots: list[int] = []
        while len(slots) < tokens and blocks:
            for block in blocks:
                slots.extend(range(block * bs, (block + 1) * bs))
        del slots[tokens:]
        return slots


class SimpleAllocator(BlockAllocator):
    """No prefix caching (TGI's SimpleAllocator)."""

    def __init__(self, n_blocks: int, block_size: int, window_size: int | None = None) -> None:
        super().__init__(n_blocks, block_size)
        self.window_size = window_size

    def allocate(self, tokens: int, prompt: Sequence[int] | None = None) -> BlockAllocation | None:
        # A sliding window only ever keeps `window_size` tokens: past it, the slots wrap to the first block.
        kept = tokens if self.window_size is None else min(tokens, self.window_size)
        n = -(-kept // self.block_size)
        if n > len(self.free_blocks):
            return None
        blocks = self.free_blocks.take(n)
        return BlockAllocation(blocks, self._slots(blocks, tokens), 0, self)

    def free(self, allocation: BlockAllocation, cache_prompt: bool) -> None:
        self.free_blocks.extend(allocation.blocks)


class RadixAllocator(BlockAllocator):
    """Prefix caching over a radix trie of block-aligned prompts (TGI's RadixAllocator).

    A sliding window is not applied (as TGI): a cached prefix must match from the first token, so the request
    gets blocks for all its tokens, which at worst over-allocates.
    """

    def __init__(self, n_blocks: int, block_size: int) -> None:
        super().__init__(n_blocks, block_size)
        self.trie = RadixTrie(block_size)

    def allocate(self, tokens: int, prompt: Sequence[int] | None = None) -> BlockAllocation | None:
        node: Node = self.trie.root
        blocks: list[int] = []
        if prompt is not None:
            node, blocks = self.trie.find(prompt)
        # Referenced before anything is evicted below, so the prefix just found stays cached.
        self.trie.incref(node)
        needed = max(0, -(-tokens // self.block_size) - len(blocks))
        if len(self.free_blocks) < needed:
            # As TGI, this may evict cached prefixes even when it still ends up short.
            self.free_blocks.extend(self.trie.evict(needed - len(self.free_blocks)))
        if len(self.free_blocks) < needed:
            self.trie.decref(node)
            return None
        blocks.extend(self.free_blocks.take(needed))
        prefix_len = (len(blocks) - needed) * self.block_size
        return BlockAllocation(blocks, self._slots(blocks, tokens), prefix_len, self, prompt, node)

    def free(self, allocation: BlockAllocation, cache_prompt: bool) -> None:
        assert allocation.node is not None
        self.trie.decref(allocation.node)
        blocks, bs = allocation.blocks, self.block_size
        cached = allocation.prefix_len // bs  # these blocks belong to the trie, not to the request
        owned_until = cached
        prompt = allocation.prompt
        if cache_prompt and prompt is not None:
            aligned = len(prompt) // bs
            if aligned > cached:
                present = self.trie.insert(prompt[: aligned * bs], blocks[:aligned]) // bs
                # Blocks `cached:present` repeat what another request cached meanwhile: the trie keeps its own.
                self.free_blocks.extend(blocks[cached:present])
                owned_until = aligned
        self.free_blocks.extend(blocks[owned_until:])
