"""utils/cgroup.py: what a container's memory limit leaves, read from cgroup v2 and v1 files as a container sees
them, and the CPU KV pool sized from it when it is below the host's available memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from textgen_server.models.kv_pool import FREE_MEMORY_SHARE, free_memory
from textgen_server.utils import cgroup

GiB = 2**30


def v2(root: Path, limit: str, current: int, inactive_file: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon 1000\nfile 2000\ninactive_file {inactive_file}\nactive_file 5\n")
    return root


def v1(root: Path, limit: int, usage: int, inactive_file: int) -> Path:
    memory = root / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{usage}\n")
    # v1 lists the cgroup's own and its hierarchy's counters; the hierarchy's (total_) is what the limit sees
    (memory / "memory.stat").write_text(f"inactive_file 7\ntotal_inactive_file {inactive_file}\n")
    return root


def test_v2_limit_less_the_working_set(tmp_path: Path) -> None:
    # 3 GiB used, 1 GiB of it inactive file cache the kernel reclaims first: 2 GiB held of a 4 GiB limit
    root = v2(tmp_path, str(4 * GiB), 3 * GiB, 1 * GiB)
    assert cgroup.available(root) == 2 * GiB


def test_v1_limit_less_the_working_set(tmp_path: Path) -> None:
    root = v1(tmp_path, 4 * GiB, 3 * GiB, 512 * 2**20)
    assert cgroup.available(root) == 4 * GiB - (3 * GiB - 512 * 2**20)


def test_over_the_limit_leaves_nothing(tmp_path: Path) -> None:
    assert cgroup.available(v2(tmp_path, str(GiB), 2 * GiB, 0)) == 0


@pytest.mark.parametrize("limit", ["max", str(9223372036854771712)])
def test_no_limit(tmp_path: Path, limit: str) -> None:
    assert cgroup.available(v2(tmp_path, limit, GiB, 0)) is None


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup.available(tmp_path) is None


def test_the_cpu_kv_pool_stays_under_a_container_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_MEMORY_FRACTION", raising=False)
    cpu = torch.device("cpu")
    host = free_memory(cpu, world_size=1, wiggle_room=1.0)
    root = v2(tmp_path / "limited", str(GiB), 256 * 2**20, 0)
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", root)
    assert host > GiB  # this machine has more than the limit leaves
    assert free_memory(cpu, world_size=1, wiggle_room=1.0) == int(768 * 2**20 * FREE_MEMORY_SHARE)
    assert free_memory(cpu, world_size=2, wiggle_room=1.0) == int(768 * 2**20 * FREE_MEMORY_SHARE / 2)
    # a limit above what the host has free changes nothing
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", v2(tmp_path / "loose", str(2**50), GiB, 0))
    assert abs(free_memory(cpu, world_size=1, wiggle_room=1.0) - host) < 0.1 * host
