"""The memory a container's limit leaves a shard: its cgroup's limit less the memory the cgroup holds, and the memory
a shard may take (`available_memory`: the host's or that, the smaller).

A CPU shard sizes its KV pool from the available memory (models/kv_pool.py). In a container, /proc/meminfo and so
psutil report the host's memory, not the limit Docker's `--memory` or a Kubernetes pod's `resources.limits.memory`
sets; a pool sized from the host would fill past the limit as requests write it, and the kernel's OOM killer
would stop the shard mid-request. The limit is read from the cgroup filesystem (v2 or v1) the container sees at
/sys/fs/cgroup. What the cgroup holds is counted as the kubelet counts a working set: its usage less the inactive
file cache (pages of the mmap'ed weights among them), which the kernel reclaims before it kills.
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A v1 cgroup without a limit reports one near 2**63 (rounded to the page size).
NO_LIMIT = 2**60


def available(root: Path | None = None) -> int | None:
    """Bytes the cgroup limit still allows; None where there is no limit (or no cgroup file to read it)."""
    root = root or CGROUP_ROOT
    for limit_file, usage_file, inactive_key, directory in (
        ("memory.max", "memory.current", "inactive_file", root),  # v2
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", root / "memory"),  # v1
    ):
        try:
            limit_text = (directory / limit_file).read_text().strip()
            usage = int((directory / usage_file).read_text())
            stat = (directory / "memory.stat").read_text()
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        inactive = next((int(line.split()[1]) for line in stat.splitlines() if line.split()[0] == inactive_key), 0)
        return max(0, int(limit_text) - (usage - inactive))
    return None


def available_memory() -> int:
    """Bytes a process may still take: the host's available memory, or what the container's limit leaves when that
    is less (what every load-time sizing reads: the KV pool, the linear choice's second layouts)."""
    host = psutil.virtual_memory().available
    limited = available()
    return host if limited is None else min(host, limited)
