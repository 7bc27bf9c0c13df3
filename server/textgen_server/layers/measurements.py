"""What a shard measured of this CPU at load, kept for its next starts: each projection shape's kernel times
(linear_choice.time_paths) and the bfloat16 `gemv` run length of each bucket of rows that gives `F.linear`'s bits
(linear_choice.GemvKernel).

Measuring is most of a small model's load (every path timed per shape, each call after a read of twice the
last-level cache), and its result depends only on the CPU, the libraries and the kernels. So the figures are kept
in one JSON file under TEXTGEN_CACHE_DIR (textgen_common/cache_dir.py; empty: nothing is kept), named after a hash
of what changes them: the CPU's model name and feature flags, its last-level cache size, torch's version (with its
oneDNN and MKL), and the kernels' own code (KERNEL_CODE). Another CPU, a VM that hides flags, another torch or
another version of the kernels measures anew.

Ranks that load at once may both write: each write merges with the file as it is then and lands whole
(cache_dir.write_whole), so a reader never sees half a file and at worst one start measures a shape again.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
from pathlib import Path

import torch

from textgen_common.cache_dir import kept_file, write_whole
from textgen_server.layers.cpu_ops import HEADERS, SOURCES, cpu_flags, files_digest

logger = logging.getLogger(__name__)


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line for line in cpuinfo if line.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor()


# The code whose behaviour the figures record: the C++ ops, and the modules that decide which rows each kernel
# serves and time them. A kept time of a path that then served fewer buckets would otherwise outlive the change.
KERNEL_CODE = (
    *SOURCES,
    *HEADERS,
    Path(__file__).with_name("linear_choice.py"),
    Path(__file__).with_name("quant_kernels.py"),
)


@functools.cache
def kernels_tag() -> str:
    """A short hash of KERNEL_CODE."""
    return files_digest(KERNEL_CODE)[:12]


def cache_file(last_level_cache: int) -> Path | None:
    """This CPU's, torch's and the kernels' file under TEXTGEN_CACHE_DIR; None where the variable is set empty."""
    identity = (
        f"{cpu_model_name()}|{' '.join(sorted(cpu_flags()))}|{last_level_cache}|torch {torch.__version__}"
        f"|kernels {kernels_tag()}"
    )
    return kept_file("cpu-measurements", identity)


class Measurements:
    """Figures by key (a shape and what was measured of it), read from `path` and written back by `save`."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, object] = self._read()
        self.added: dict[str, object] = {}

    def _read(self) -> dict[str, object]:
        if self.path is None:
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: measured again and rewritten
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> object | None:
        return self.entries.get(key)

    def put(self, key: str, value: object) -> None:
        self.entries[key] = self.added[key] = value

    def save(self) -> None:
        """Merge what this process added into the file; a failure to write costs only a later measurement."""
        if self.path is None or not self.added:
            return
        merged = {**self._read(), **self.added}
        try:
            write_whole(self.path, json.dumps(merged, indent=1, sort_keys=True))
        except OSError as err:
            logger.warning("CPU measurements not kept for the next start (%s): %s", self.path, err)
            return
        self.added = {}


def measurements(last_level_cache: int) -> Measurements:
    """The process's one view of this CPU's file under the TEXTGEN_CACHE_DIR now set (read once; `save` writes
    what was added)."""
    return _measurements_at(cache_file(last_level_cache))


@functools.cache
def _measurements_at(path: Path | None) -> Measurements:
    return Measurements(path)
