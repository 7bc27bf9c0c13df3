"""One torch.distributed process group per shard group.

Contract with the launcher: every shard process gets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
environment (TGI's names). WORLD_SIZE == 1 needs no group at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Bounded so that a dead peer makes the others fail instead of hanging forever (TGI uses 120 s; tests
# lower it through the environment).
DIST_TIMEOUT_S = float(os.environ.get("TEXTGEN_DIST_TIMEOUT", "120"))


@dataclass(frozen=True)
class DistInfo:
    """Where this shard sits in its group; `group` is None when WORLD_SIZE == 1."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` across ranks in place (a no-op on one shard)."""
        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dimension (identity on one shard)."""
        if self.group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


_INFO: DistInfo | None = None


def rank_and_world_size() -> tuple[int, int]:
    """RANK and WORLD_SIZE from the environment (defaults 0 and 1), without creating a group."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def initialize_torch_distributed() -> DistInfo:
    """Join the shard group once per process: NCCL on CUDA, gloo on CPU, env:// rendezvous."""
    global _INFO
    if _INFO is not None:
        return _INFO
    rank, world_size = rank_and_world_size()
    if world_size == 1:
        _INFO = DistInfo(rank, world_size, None)
        return _INFO
    if torch.cuda.is_available():
        if world_size > torch.cuda.device_count():
            raise RuntimeError(f"WORLD_SIZE={world_size} but only {torch.cuda.device_count()} CUDA devices are visible")
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        backend = "gloo"
        # CPU ranks on one host share its cores: each defaulting to all of them oversubscribes the machine,
        # and the slowest rank then holds up every all_reduce. An explicit OMP_NUM_THREADS still wins.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=DIST_TIMEOUT_S),
        )
    _INFO = DistInfo(rank, world_size, dist.group.WORLD)
    return _INFO
