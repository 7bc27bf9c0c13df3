"""The free list of a paged KV pool's blocks, as both sides keep one: the router's block allocator (which blocks
of the shards' pools a request may write) and a shard's own allocator (requests that bring no blocks).
Block 0 is never handed out: TGI reserves it (health checks, padding)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class FreeBlocks:
    """The free list: blocks given back (reused first, most recent first, so the pages a request touched serve
    the next one) and the blocks never handed out, kept as a count: a CPU shard's pool of a small model holds
    millions of blocks."""

    def __init__(self, n_blocks: int) -> None:
        self._fresh = max(0, n_blocks - 1)  # blocks 1..fresh were never handed out (block 0 never is)
        self._returned: list[int] = []

    def __len__(self) -> int:
        return self._fresh + len(self._returned)

    def __iter__(self) -> Iterator[int]:
        yield from range(1, self._fresh + 1)
        yield from self._returned

    def take(self, n: int) -> list[int]:
        """The last `n` of the free list `[1..fresh] + returned` (the caller checked there are enough)."""
        reused = min(n, len(self._returned))
        fresh = n - reused
        blocks = list(range(self._fresh - fresh + 1, self._fresh + 1))
        self._fresh -= fresh
        blocks.extend(self._returned[len(self._returned) - reused :])
        del self._returned[len(self._returned) - reused :]
        return blocks

    def extend(self, blocks: Iterable[int]) -> None:
        self._returned.extend(blocks)
