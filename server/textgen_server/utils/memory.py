"""Host memory policy of a shard process: keep freed activation buffers for the next step.

glibc serves allocations above its mmap threshold (at most 32 MiB by default) with fresh mmaps and
unmaps them on free. A CPU prefill allocates and frees activations of tens to hundreds of MiB per layer,
so every step page-faults that memory in again: a large share of a 64-prompt prefill of the small model
(benchmark/shard_w1.py; figures in benchmark/README.md). Serving such allocations from the heap, and never
trimming it, makes the process keep its peak activation memory (reached at warmup) for reuse instead.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and the largest value they take (an int).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LIMIT = 2**31 - 1


def keep_freed_memory() -> bool:
    """Allocations below 2 GiB come from the heap, which is never trimmed. False where libc is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt: freed memory goes back to the OS")
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LIMIT)) and bool(mallopt(M_TRIM_THRESHOLD, LIMIT))
