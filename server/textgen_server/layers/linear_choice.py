"""Which CPU kernel computes each projection, chosen by measurement when the model is loaded.

A projection y = x @ W^T + b has up to three paths on a CPU, each reading W in its own layout:
- `linear`: plain `F.linear` on the weight as loaded (the GEMM library may repack W's panels on every call);
- `mkl` (float32): MKL's packed GEMM on a weight packed once at load;
- `onednn` (float32, bfloat16 where the CPU has native bf16 kernels, AMX included): oneDNN's GEMM on a weight
  reordered once at load into its blocked layout.
Which is fastest depends on the CPU (MKL's fp32 kernels are slow on some vendors' cores, oneDNN's blocked layout
loses to them at one row on others) and on the row count. So the shard does not guess: for each distinct
(out, in, dtype) shape it times every available path (on one thread, see `time_paths`) at one row count per
bucket of rows (1, 2-8, 9-64, >64), keeps the fastest per bucket (one main path unless another is clearly
faster, see `choose`), and each forward call picks its bucket's kernel from its row count.

`TEXTGEN_CPU_LINEAR` = auto (default) | linear | mkl | onednn forces one path for every bucket (reproducible
runs); where the forced path does not exist for a dtype or device, `linear` serves instead.

Outputs: in bfloat16 every path gives `F.linear`'s bits (the oneDNN reorder feeds the kernels `F.linear` uses);
in float32 the paths sum in different orders: the same fp32 accuracy, not the same bits (test_linear.py,
test_kernel_choice.py).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from textgen_server.config import UnsupportedConfigError

if TYPE_CHECKING:
    from textgen_server.layers.tensor_parallel import Linear

logger = logging.getLogger("textgen_server.layers.linear_choice")

ENV = "TEXTGEN_CPU_LINEAR"
# The largest row count of each bucket but the last (which takes every count above).
BUCKET_LIMITS = (1, 8, 64)
BUCKET_NAMES = ("1", "2-8", "9-64", ">64")
# The row count each bucket is timed at.
BUCKET_ROWS = (1, 4, 32, 128)
# A path serves a bucket instead of the layer's main path only when it is at least this much faster there:
# each layout kept costs one more copy of the weight in memory (benchmark/README.md), worth it only for a
# gain above the measurement's noise.
MARGIN = 0.10
# Timing rounds per bucket: at least MIN_ROUNDS, more until MIN_SECONDS of kernel time, at most MAX_ROUNDS.
MIN_ROUNDS, MAX_ROUNDS, MIN_SECONDS = 5, 20, 0.005

# Both packed layouts are built for a nominal row count. Measured on torch 2.13, each gives the same results
# for every row count >= 2 whatever count it was built for, and fp32-close ones at 1 row; bfloat16 gives
# F.linear's bits (test_linear.py checks both).
_PACK_ROWS = 64


def bucket(rows: int) -> int:
    """The index of the bucket `rows` falls in."""
    return bisect_left(BUCKET_LIMITS, rows)


class Kernel(ABC):
    """One path of y = x @ W^T + b, holding W in the layout it reads."""

    path: ClassVar[str]

    @staticmethod
    @abstractmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this torch build and CPU have the path for weights of `dtype` on `device`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class PlainKernel(Kernel):
    path = "linear"

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        return True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MklKernel(Kernel):
    path = "mkl"

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), _PACK_ROWS)
        # The packed op reads only the dtype and shape of the original weight (it would fall back to it if its
        # row-count argument did not match x, and it always does here): a zero-stride stand-in.
        self.shape_only = weight.new_empty(()).expand(weight.shape)
        self.in_features = weight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape_only, self.bias, rows)


class OnednnKernel(Kernel):
    path = "onednn"

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        dtype_ok = dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype_ok

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


KERNELS: dict[str, type[Kernel]] = {k.path: k for k in (PlainKernel, MklKernel, OnednnKernel)}
CHOICES = ("auto", *KERNELS)


def available_paths(dtype: torch.dtype, device: torch.device) -> list[str]:
    return [path for path, kernel in KERNELS.items() if kernel.available(dtype, device)]


def forced_path() -> str | None:
    """The path `TEXTGEN_CPU_LINEAR` forces, None for auto; UnsupportedConfigError for an unknown value."""
    value = os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise UnsupportedConfigError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return None if value == "auto" else value


def time_paths(weight: torch.Tensor, bias: torch.Tensor | None, paths: list[str]) -> dict[str, list[float]]:
    """Least seconds of each path at each bucket's row count on one thread, the paths called in turn so that
    each sees the same machine state.

    One thread, whatever the shard runs with: with several, a call whose sibling thread waits for a core that
    other work holds takes milliseconds, and on a busy machine every path measured alike, so the choice was
    noise (benchmark/README.md). What differs between the paths is each core's kernel (ISA, blocking, packing);
    their order on one thread matched their order on two where we measured. The least, not the median: other
    load only adds time, and the least run is the one it disturbed least."""
    kernels = [KERNELS[path](weight, bias) for path in paths]
    g = torch.Generator(device=weight.device).manual_seed(0)
    least: dict[str, list[float]] = {path: [] for path in paths}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for rows in BUCKET_ROWS:
                x = torch.randn(rows, weight.shape[1], generator=g, device=weight.device).to(weight.dtype)
                for kernel in kernels:
                    kernel(x)  # first-touch allocations
                times: list[list[float]] = [[] for _ in kernels]
                spent = 0.0
                while len(times[0]) < MAX_ROUNDS and (len(times[0]) < MIN_ROUNDS or spent < MIN_SECONDS):
                    for kernel, out in zip(kernels, times, strict=True):
                        start = time.perf_counter()
                        kernel(x)
                        out.append(time.perf_counter() - start)
                        spent += out[-1]
                for path, t in zip(paths, times, strict=True):
                    least[path].append(min(t))
    finally:
        torch.set_num_threads(threads)
    return least


def choose(times: dict[str, list[float]]) -> tuple[str, ...]:
    """One path per bucket from `time_paths`' times: the main path (least time relative to each bucket's
    fastest, summed over the buckets) everywhere, except in a bucket where another is more than MARGIN
    faster."""
    buckets = range(len(BUCKET_ROWS))
    fastest = [min(times, key=lambda p: times[p][b]) for b in buckets]
    main = min(times, key=lambda p: sum(times[p][b] / times[fastest[b]][b] for b in buckets))
    return tuple(main if times[main][b] <= times[fastest[b]][b] * (1 + MARGIN) else fastest[b] for b in buckets)


def choose_linear_kernels(layers: Iterable[Linear]) -> None:
    """Give every layer its kernel per bucket: measured once per distinct (out, in, dtype) shape on the first
    layer of that shape (or forced by TEXTGEN_CPU_LINEAR), one log line per shape."""
    forced = forced_path()
    groups: dict[tuple[int, int, torch.dtype, torch.device], list[Linear]] = {}
    for layer in layers:
        weight = layer.plain_weight()
        groups.setdefault((layer.out_features, layer.in_features, weight.dtype, weight.device), []).append(layer)
    for (out_f, in_f, dtype, device), group in groups.items():
        paths = available_paths(dtype, device)
        shape = f"{out_f}x{in_f} {str(dtype).removeprefix('torch.')} ({len(group)} layers)"
        if forced is not None:
            path = forced if forced in paths else "linear"
            choice: tuple[str, ...] = (path,) * len(BUCKET_ROWS)
            how = f"{ENV}={forced}" + ("" if forced in paths else f": no {forced} path here")
        elif len(paths) == 1:
            choice = (paths[0],) * len(BUCKET_ROWS)
            how = "the only path here"
        else:
            first = group[0]
            times = time_paths(first.plain_weight(), first.bias, paths)
            choice = choose(times)
            rows = "/".join(map(str, BUCKET_ROWS))
            how = f"measured, least ms at {rows} rows: " + ", ".join(
                f"{p} " + "/".join(f"{t * 1e3:.3f}" for t in times[p]) for p in paths
            )
        for layer in group:
            layer.use(choice)
        by_bucket = ", ".join(f"{name}: {path}" for name, path in zip(BUCKET_NAMES, choice, strict=True))
        logger.info("CPU linear %s, rows %s (%s)", shape, by_bucket, how)
