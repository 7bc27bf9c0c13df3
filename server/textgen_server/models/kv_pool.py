"""The paged KV pool of one shard: fixed-size blocks of key/value slots that every request's tokens live in.

Who owns what (TGI v3's split, see ARCHITECTURE.md "The v3 engine"): the router's block allocator decides
which blocks a request gets (`Request.blocks` / `slots`); the shard owns the memory. Per layer, keys and values
are one tensor each, `[num_blocks, block_size, kv_heads, head_dim]` (TGI's flashinfer/flashdecoding layout):
slot `s = block * block_size + offset` is `[s // block_size, s % block_size]`. On a GPU the tensor is contiguous, as
TGI's kernels read it; on a CPU it is head-major, `[num_blocks, kv_heads, block_size, head_dim]` storage viewed in
that shape, so that a block holds each KV head's slots side by side: the decode attention reads a row's keys head
by head, and a head's slots of a block are then one run of memory, which this CPU serves at the read rate where a
slot's heads side by side left 16 runs a tile (benchmark/README.md, "A head's slots side by side"; the C++ ops
take both orders, layers/kv_pool.h).
Block 0 is reserved (TGI's health check and padding target): the router never hands it to a request.

Requests that arrive without blocks (the warmup batch, shard-level benchmarks, a client without an
allocator) get blocks from `SelfAllocator`, the shard's own free list; they must not be mixed with a router
that allocates from the same pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from textgen_common.free_blocks import FreeBlocks
from textgen_server.layers.attention_kernels import reads_pool
from textgen_server.utils import cgroup

# Share of the free memory the pool may take, as TGI's get_free_memory on CPU.
FREE_MEMORY_SHARE = 0.95
# textgen's cap on the pool (tokens), for tests and reproducible runs; TGI has no equivalent.
POOL_TOKENS_ENV = "TEXTGEN_KV_CACHE_TOKENS"


@dataclass(frozen=True)
class PoolShape:
    """What one block holds: every layer's keys and values for `block_size` tokens of this shard's KV heads."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.kv_heads * self.head_dim * element


def free_memory(device: torch.device, world_size: int, wiggle_room: float) -> int:
    """Bytes this shard may give its KV pool: TGI's rule, on a GPU the free device memory less the share of the
    total outside `CUDA_MEMORY_FRACTION` x `wiggle_room` (TGI_WIGGLE_ROOM: the rest is left to the forward's
    activations and the CUDA graphs captured after the pool); on a CPU 0.95 of the available host memory (or of
    what a container's memory limit leaves, when less: utils/cgroup.py), shared by the shards of the machine, times
    `CUDA_MEMORY_FRACTION`."""
    fraction = float(os.environ.get("CUDA_MEMORY_FRACTION", "1.0"))
    if device.type == "cuda":
        fraction *= wiggle_room
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - fraction) * total))
    return int(cgroup.available_memory() * FREE_MEMORY_SHARE * fraction / world_size)


def pool_blocks(shape: PoolShape, free_bytes: int) -> int:
    """Blocks that fit in `free_bytes`, capped by TEXTGEN_KV_CACHE_TOKENS when set (block 0 included)."""
    blocks = free_bytes // shape.bytes_per_block
    cap = os.environ.get(POOL_TOKENS_ENV)
    if cap:
        blocks = min(blocks, -(-int(cap) // shape.block_size))
    return int(blocks)


def pool_tensor(shape: PoolShape, num_blocks: int, device: torch.device) -> torch.Tensor:
    """One layer's keys or values, [num_blocks, block_size, kv_heads, head_dim], uninitialised: head-major on a CPU
    (the module docstring), contiguous on a GPU and where a prefill's attention reads the pool through its flat
    `[slots, kv_heads, head_dim]` view (`reads_pool`: bf16 on a CPU with AVX2 but not AVX-512)."""
    if device.type != "cpu" or reads_pool(shape.dtype, device):
        return torch.empty(
            num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, dtype=shape.dtype, device=device
        )
    storage = torch.empty(num_blocks, shape.kv_heads, shape.block_size, shape.head_dim, dtype=shape.dtype)
    return storage.transpose(1, 2)


class KVPool:
    """Every layer's key and value blocks. Allocated uninitialised: a slot is written before any row reads it,
    and on a CPU untouched pages cost no memory until a request first writes them."""

    def __init__(self, shape: PoolShape, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 2:
            raise RuntimeError(
                f"Not enough memory for the KV cache: {num_blocks} block(s) of {shape.block_size} tokens fit "
                f"({shape.bytes_per_block} bytes each); block 0 is reserved, so at least 2 are needed"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.keys = [pool_tensor(shape, num_blocks, device) for _ in range(shape.num_layers)]
        self.values = [pool_tensor(shape, num_blocks, device) for _ in range(shape.num_layers)]
        self.allocator = SelfAllocator(num_blocks)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def tokens(self) -> int:
        """Token capacity of the pool (Warmup's max_supported_total_tokens)."""
        return self.num_blocks * self.block_size


class SelfAllocator:
    """The shard's own free list, for requests that come without blocks (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        self._free = FreeBlocks(num_blocks)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks; RuntimeError when the pool has fewer."""
        if count > len(self._free):
            raise RuntimeError(f"the KV cache has {len(self._free)} free blocks, {count} are needed")
        return self._free.take(count)

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
