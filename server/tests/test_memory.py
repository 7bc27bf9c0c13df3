"""keep_freed_memory: a freed large activation buffer stays in the process for the next step."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates and touches a 64 MiB tensor, frees it, and prints how much of it the process still holds (MiB).
PROBE = """
import sys, torch
from textgen_server.utils.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20
t = torch.empty(16 * 2**20, dtype=torch.float32)
t.fill_(1.0)
touched = rss()
del t
print(64 - (touched - rss()))
"""


def kept_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_freed_activation_memory_stays_in_the_process() -> None:
    assert kept_mib("default") < 8  # glibc unmapped it: the next step page-faults it in again
    assert kept_mib("keep") > 56
