"""Lazy, rank-aware access to a model's safetensors weights.

A shard never reads a whole tensor it does not own: `get_partial_sharded` / `get_sharded` read only this
rank's block through safetensors' lazy slices, so per-shard memory is weights / world_size (plus the small
replicated tensors: norms, row-parallel biases). Quantized projections are the exception: every rank reads them
whole and keeps its block once unpacked (layers/tensor_parallel.py `_rank_block`), for an act-order group or an
eetq row scale spans the whole tensor; what each rank holds after the load is still its share.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

if TYPE_CHECKING:  # layers/quantized_weight imports config; weights stays a leaf module
    from textgen_server.layers.quantized_weight import QuantConfig

# The bytes of a mapped table asked into the page cache a call (`mapped_rows`): a disk's whole read-ahead window
# at the smallest (read_ahead_kb, 128 KiB by default), and a 1B Llama's table in about a thousand calls.
WILLNEED_BYTES = 128 * 2**10


class Weights:
    """Tensor name -> safetensors file map over every `*.safetensors` file of a model directory.

    `aliases` maps a wanted name to other names that may hold it (e.g. a tied `lm_head.weight` stored only
    as `model.embed_tokens.weight`). Floating tensors are converted to `dtype`, and every tensor is copied to
    `device` as memory of its own: a view into the memory-mapped file would keep the whole file mapped, and
    with it the pages read to build what replaced a weight (a fused or reordered copy), for as long as any
    view lives. `mapped_rows` is the one exception: a map of its own over just one tensor's rows.
    """

    def __init__(
        self,
        files: list[Path],
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
        aliases: dict[str, list[str]] | None = None,
        quant: QuantConfig | None = None,
    ) -> None:
        if not files:
            raise ValueError("no .safetensors weight files given")
        self.device = device
        self.dtype = dtype
        self.rank = rank
        self.world_size = world_size
        self.aliases = aliases or {}
        self.quant = quant  # the checkpoint's projections are stored quantized (layers/quantization.py)
        self._files = files
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._routing: dict[str, int] = {}
        for i, handle in enumerate(self._handles):
            for name in handle.keys():
                if name in self._routing:
                    other = files[self._routing[name]]
                    raise ValueError(f"tensor {name} is stored twice: in {other} and in {files[i]}")
                self._routing[name] = i

    @classmethod
    def from_dir(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
        aliases: dict[str, list[str]] | None = None,
        quant: QuantConfig | None = None,
    ) -> Weights:
        """All safetensors files directly inside `model_dir`, in name order."""
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no .safetensors weight files in {model_dir}")
        return cls(files, device, dtype, rank, world_size, aliases, quant)

    def names(self) -> list[str]:
        """Every stored tensor name."""
        return list(self._routing)

    def __contains__(self, name: str) -> bool:
        return self._stored_name(name) is not None

    def _stored_name(self, name: str) -> str | None:
        """`name` or the first of its aliases that a file holds; None when none does."""
        for candidate in [name, *self.aliases.get(name, [])]:
            if candidate in self._routing:
                return candidate
        return None

    def _resolve(self, name: str) -> str:
        real = self._stored_name(name)
        if real is None:
            raise ValueError(f"weight {name} does not exist")
        return real

    def get_slice(self, name: str) -> Any:  # safetensors' PySafeSlice has no importable type
        """The lazy slice of `name`: indexing it reads only the indexed part from disk."""
        real = self._resolve(name)
        return self._handles[self._routing[real]].get_slice(real)

    def get_shape(self, name: str) -> list[int]:
        return list(self.get_slice(name).get_shape())

    def _finish(self, tensor: torch.Tensor) -> torch.Tensor:
        # Integer tensors (quantisation metadata, ids) keep their dtype; only floats follow the model.
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=self.device, dtype=dtype, copy=True)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor (for replicated weights such as norms)."""
        return self._finish(self.get_slice(name)[:])

    def mapped_rows(self, name: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows [start, stop) of the 2-D float tensor `name`, in its stored dtype, as a private copy-on-write map
        of those bytes of the file; None off the CPU or for an empty block.

        For a table read a few rows at a time (the token embedding: one row per token), whose rows then cost
        memory only once a lookup reads them, and as page cache the kernel can take back. Nothing reads the
        map at load, so none of the whole file's pages are counted to the process.
        """
        if self.device.type != "cpu" or stop <= start:
            return None
        real = self._resolve(name)
        path = self._files[self._routing[real]]
        with path.open("rb") as file:
            header_len = int.from_bytes(file.read(8), "little")
            entry = json.loads(file.read(header_len))[real]
            cols = entry["shape"][1]
            dtype = self.get_slice(real)[:0].dtype  # an empty read gives the stored dtype as torch's
            row_bytes = cols * dtype.itemsize
            offset = 8 + header_len + entry["data_offsets"][0] + start * row_bytes
            aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
            length = offset - aligned + (stop - start) * row_bytes
            table = mmap.mmap(file.fileno(), length, access=mmap.ACCESS_COPY, offset=aligned)
        # One lookup reads one row: the kernel's read-ahead would bring in (and count) its neighbours too.
        table.madvise(mmap.MADV_RANDOM)
        # But the file's pages of the table are read into the page cache now, in the background (they are the
        # process's only once a lookup maps them): where the cache did not hold them, each token's first lookup
        # waited for its page from the disk, 0.2-0.5 ms a decode step on the small Llama (benchmark/README.md,
        # "A decode step's layers in two C++ calls"). The kernel reads at most its read-ahead window a call.
        for at in range(0, length, WILLNEED_BYTES):
            table.madvise(mmap.MADV_WILLNEED, at, min(WILLNEED_BYTES, length - at))
        rows = torch.frombuffer(table, dtype=dtype, count=(stop - start) * cols, offset=offset - aligned)
        return rows.view(stop - start, cols)

    def get_partial_sharded(self, name: str, dim: int) -> torch.Tensor:
        """This rank's block of `name` along `dim` (0 or 1); block = ceil(size / world), the last may be short."""
        if dim not in (0, 1):
            raise ValueError(f"can only shard on dimension 0 or 1, got {dim}")
        slice_ = self.get_slice(name)
        size = slice_.get_shape()[dim]
        block = (size + self.world_size - 1) // self.world_size
        start, stop = self.rank * block, min((self.rank + 1) * block, size)
        part = slice_[start:stop] if dim == 0 else slice_[:, start:stop]
        return self._finish(part)

    def get_sharded(self, name: str, dim: int) -> torch.Tensor:
        """Like `get_partial_sharded`, but every rank must get an equal block."""
        size = self.get_shape(name)[dim]
        if size % self.world_size != 0:
            raise ValueError(
                f"dimension {dim} of {name} has size {size}, which is not divisible by the number of shards "
                f"({self.world_size})"
            )
        return self.get_partial_sharded(name, dim)

    def get_multi_sharded(self, names: list[str], dim: int) -> torch.Tensor:
        """This rank's block of each of `names`, concatenated on `dim` (fuses e.g. q/k/v into one matmul)."""
        return torch.cat([self.get_sharded(n, dim) for n in names], dim=dim)
