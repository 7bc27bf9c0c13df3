"""Host memory policy of a shard process: keep freed activation buffers for the next step; weights in huge pages.

glibc serves allocations above its mmap threshold (at most 32 MiB by default) with fresh mmaps and
unmaps them on free. A CPU prefill allocates and frees activations of tens to hundreds of MiB per layer,
so every step page-faults that memory in again: a large share of a 64-prompt prefill of the small model
(benchmark/shard_w1.py; figures in benchmark/README.md). Serving such allocations from the heap, and never
trimming it, makes the process keep its peak activation memory (reached at warmup) for reuse instead. That
heap must be the main one: glibc gives other threads arenas of their own, whose heaps hold at most 64 MiB, and
serves a larger allocation there with a fresh mmap whatever the threshold; the shard's model runs on a thread
of its own (model_thread.py).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and the largest value they take (an int).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
LIMIT = 2**31 - 1


def keep_freed_memory() -> bool:
    """Allocations below 2 GiB, on every thread, come from the main heap, which is never trimmed. Call it before
    the process starts a thread that allocates: a thread that already has an arena of its own keeps it. False
    where libc is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt: freed memory goes back to the OS")
        return False
    return all(
        mallopt(option, value)
        for option, value in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, LIMIT), (M_TRIM_THRESHOLD, LIMIT))
    )


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` whose whole 2 MiB runs the kernel may back with transparent huge pages
    (a private anonymous mapping, 2 MiB-aligned, `madvise(MADV_HUGEPAGE)` over those runs; the tail past the last
    whole run keeps 4 KiB pages, so no page beyond `t`'s bytes is ever touched). For weights a one-row step reads
    whole (`gemv`, int4 and int8 packs): on the Zen 4 KVM guest, where a TLB miss walks two page tables, a batch-1
    small-model step took 0.81-0.94x the time and a `1b` step's int4 projections 0.83-0.92x (benchmark/README.md,
    "Huge pages for the weights"). `t` itself where it is smaller than one huge page or not on the CPU."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return t
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` for as long as the copy lives
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP off in this kernel: the copy still serves, on 4 KiB pages
        logger.debug("no transparent huge pages for a %d-byte buffer", nbytes)
    out = raw[start : start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
