"""keep_freed_memory: a freed large activation buffer stays in the process for the next step, whichever thread
freed it. in_huge_pages: a weight's copy on 2 MiB-aligned memory advised for huge pages, its bytes and nothing past
them."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textgen_server.utils.memory import HUGE_PAGE, in_huge_pages

# On the main thread or on a thread of its own (as the shard's model thread), allocates and touches a 128 MiB
# tensor (past a thread arena's 64 MiB heaps), frees it, and prints how much of it the process still holds (MiB).
PROBE = """
import sys, threading, torch
from textgen_server.utils.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20
def probe():
    t = torch.empty(32 * 2**20, dtype=torch.float32)
    t.fill_(1.0)
    touched = rss()
    del t
    print(128 - (touched - rss()))
if sys.argv[2] == "main":
    probe()
else:
    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
"""


def kept_mib(mode: str, where: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, where], capture_output=True, text=True, check=True, timeout=120
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_freed_activation_memory_stays_in_the_process(where: str) -> None:
    assert kept_mib("default", where) < 8  # glibc unmapped it: the next step page-faults it in again
    assert kept_mib("keep", where) > 120


def huge_pages_of(t: torch.Tensor) -> int:
    """Bytes of `t`'s mapping that the kernel backs with huge pages (/proc/self/smaps, the VMA holding it)."""
    start = t.data_ptr()
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= start < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mmap's MADV_HUGEPAGE, /proc")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_large_weight_is_copied_onto_memory_advised_for_huge_pages(dtype: torch.dtype) -> None:
    weight = torch.randn(2 * HUGE_PAGE // 2 + 12_345, 2).to(dtype)  # two whole huge pages and a tail at least
    copy = in_huge_pages(weight)
    assert torch.equal(copy, weight) and copy.dtype == dtype and copy.shape == weight.shape and copy.is_contiguous()
    assert copy.data_ptr() != weight.data_ptr() and copy.data_ptr() % HUGE_PAGE == 0
    whole = copy.numel() * copy.element_size() // HUGE_PAGE * HUGE_PAGE
    # Huge pages at fault time: THP not off, and the fault may compact memory to find a free 2 MiB page.
    thp = all(
        Path(f"/sys/kernel/mm/transparent_hugepage/{knob}").is_file()
        and not any(f"[{off}]" in Path(f"/sys/kernel/mm/transparent_hugepage/{knob}").read_text() for off in offs)
        for knob, offs in (("enabled", ("never",)), ("defrag", ("never", "defer")))
    )
    # Only the whole 2 MiB runs are advised: where THP waits for advice, the tail stays on 4 KiB pages, so no page
    # past the copy is touched (under "always" the kernel may back any run itself).
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if enabled.is_file() and "[madvise]" in enabled.read_text():
        assert huge_pages_of(copy) <= whole
    if thp:
        assert huge_pages_of(copy) > 0
    expected = weight.float().sum()
    del weight
    gc.collect()
    assert torch.equal(copy.float().sum(), expected)  # the copy outlives its source: it holds its own mapping


def test_a_small_or_foreign_tensor_is_left_as_it_is() -> None:
    small = torch.randn(100, 100)
    assert in_huge_pages(small) is small
