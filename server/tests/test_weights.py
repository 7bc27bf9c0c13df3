"""`Weights`: name -> file routing over several safetensors files, per-rank blocks, dtype and alias rules."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from textgen_server.utils.weights import Weights

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("weights")
    save_file(
        {"a.weight": torch.arange(35, dtype=torch.float32).reshape(7, 5), "ids": torch.arange(4, dtype=torch.int64)},
        str(d / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"b.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6)}, str(d / "model-00002-of-00002.safetensors")
    )
    return d


def test_routes_names_across_files_and_converts_only_floats(model_dir: Path) -> None:
    w = Weights.from_dir(model_dir, CPU, torch.bfloat16)
    assert "a.weight" in w and "b.weight" in w and "missing" not in w
    assert w.get_tensor("b.weight").dtype == torch.bfloat16
    assert torch.equal(w.get_tensor("b.weight").float(), torch.arange(24.0).reshape(4, 6))
    assert w.get_tensor("ids").dtype == torch.int64
    with pytest.raises(ValueError, match="weight missing does not exist"):
        w.get_tensor("missing")


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_its_even_block(model_dir: Path, rank: int) -> None:
    w = Weights.from_dir(model_dir, CPU, torch.float32, rank=rank, world_size=2)
    full = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(w.get_sharded("b.weight", dim=0), full[2 * rank : 2 * rank + 2])
    assert torch.equal(w.get_sharded("b.weight", dim=1), full[:, 3 * rank : 3 * rank + 3])
    assert torch.equal(
        w.get_multi_sharded(["b.weight", "b.weight"], dim=1), torch.cat([full[:, 3 * rank : 3 * rank + 3]] * 2, dim=1)
    )


def test_uneven_blocks_are_ceil_sized_with_a_short_last_block(model_dir: Path) -> None:
    full = torch.arange(35.0).reshape(7, 5)
    blocks = [
        Weights.from_dir(model_dir, CPU, torch.float32, rank=r, world_size=2).get_partial_sharded("a.weight", 0)
        for r in range(2)
    ]
    assert torch.equal(blocks[0], full[:4]) and torch.equal(blocks[1], full[4:])
    w = Weights.from_dir(model_dir, CPU, torch.float32, rank=0, world_size=2)
    with pytest.raises(ValueError, match="size 7, which is not divisible by the number of shards \\(2\\)"):
        w.get_sharded("a.weight", dim=0)
    with pytest.raises(ValueError, match="dimension 0 or 1"):
        w.get_partial_sharded("a.weight", dim=2)


def test_aliases_resolve_a_tied_name(model_dir: Path) -> None:
    w = Weights.from_dir(model_dir, CPU, torch.float32, aliases={"lm_head.weight": ["b.weight"]})
    assert "lm_head.weight" in w
    assert torch.equal(w.get_tensor("lm_head.weight"), w.get_tensor("b.weight"))


def test_a_name_stored_twice_or_no_files_is_an_error(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"x": torch.ones(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ValueError, match="tensor x is stored twice"):
        Weights.from_dir(tmp_path, CPU, torch.float32)
    with pytest.raises(ValueError, match="no .safetensors weight files in"):
        Weights.from_dir(tmp_path / "empty", CPU, torch.float32)


def test_loaded_tensors_do_not_keep_the_file_mapped(model_dir: Path) -> None:
    # Same dtype, same device, whole tensor: the case where safetensors would hand out a view into its mmap.
    w = Weights.from_dir(model_dir, CPU, torch.float32)
    kept = [w.get_tensor("a.weight"), w.get_tensor("ids"), w.get_sharded("b.weight", dim=0)]
    del w
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(model_dir) not in maps
    assert torch.equal(kept[0], torch.arange(35.0).reshape(7, 5)) and torch.equal(kept[1], torch.arange(4))


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line whose range holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return line
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.parametrize("start, stop", [(0, 2000), (1000, 2000), (1999, 2000)])
def test_mapped_rows_are_the_stored_rows_in_a_map_of_the_file(tmp_path: Path, start: int, stop: int) -> None:
    # 2000 x 7 floats: most row starts are not page-aligned, and the table follows another tensor in the file.
    table = torch.randn(2000, 7)
    save_file({"a": torch.arange(5.0), "table": table}, str(tmp_path / "model.safetensors"))
    file_bytes = (tmp_path / "model.safetensors").read_bytes()
    w = Weights.from_dir(tmp_path, CPU, torch.bfloat16)
    rows = w.mapped_rows("table", start, stop)
    del w
    gc.collect()
    assert rows is not None and rows.dtype == torch.float32  # the stored dtype: a lookup converts
    assert torch.equal(rows, table[start:stop])
    assert _mapping_of(rows.data_ptr()).endswith(str(tmp_path / "model.safetensors"))
    rows.add_(1.0)  # private: a write changes this process's copy of the page, never the file
    assert (tmp_path / "model.safetensors").read_bytes() == file_bytes


def _pages_in_memory(address: int, length: int) -> tuple[int, int]:
    """(pages in memory, pages) of the `length` bytes at `address`, by mincore(2): for a map of a file, whether
    the page cache holds them."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = address - address % mmap.PAGESIZE
    length += address - start
    flags = (ctypes.c_ubyte * (-(-length // mmap.PAGESIZE)))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), flags) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in flags), len(flags)


def test_mapped_rows_are_read_into_the_page_cache_at_once(tmp_path: Path) -> None:
    # A cold page cache made each token's first lookup a read from the disk. The table (32 MiB) follows 32 MiB of
    # another tensor: reading the header reads ahead (up to the disk's read_ahead_kb, 8 MiB here), not that far;
    # and the kernel reads at most that window for one madvise.
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(8 * 2**20), "table": torch.randn(8192, 1024)}, str(path))
    with path.open("rb") as file:
        os.fsync(file.fileno())  # dirty pages stay cached: once on the disk, the file's pages can be dropped
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    weights = Weights.from_dir(tmp_path, CPU, torch.float32)
    with path.open("rb") as file:
        probe = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    table_bytes = 8192 * 1024 * 4
    cold = _pages_in_memory(ctypes.addressof(ctypes.c_char.from_buffer(probe)) + len(probe) - table_bytes, table_bytes)
    if cold[0] > cold[1] // 4:
        pytest.skip("this file system keeps the file's pages in memory: there is no cold page cache to read into")
    rows = weights.mapped_rows("table", 0, 8192)
    assert rows is not None
    deadline = time.monotonic() + 10
    while (found := _pages_in_memory(rows.data_ptr(), table_bytes))[0] < found[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert found[0] == found[1]


def test_no_mapped_rows_off_the_cpu_or_for_an_empty_block(model_dir: Path) -> None:
    assert Weights.from_dir(model_dir, torch.device("meta"), torch.float32).mapped_rows("a.weight", 0, 7) is None
    assert Weights.from_dir(model_dir, CPU, torch.float32).mapped_rows("a.weight", 7, 7) is None
