"""Which CPU kernel computes each projection, chosen by measurement when the model is loaded.

A projection y = x @ W^T + b has up to four paths on a CPU, each reading W in its own layout:
- `linear`: plain `F.linear` on the weight as loaded (the GEMM library may repack W's panels on every call);
- `mkl` (float32): MKL's packed GEMM on a weight packed once at load;
- `onednn` (float32, bfloat16 where the CPU has native bf16 kernels, AMX included): oneDNN's GEMM on a weight
  reordered once at load into its blocked layout;
- `gemv` (up to 64 rows: float32 on CPUs with AVX-512 or AVX2 and FMA, bfloat16 with AVX512-BF16; any rows:
  bfloat16 with AVX2 and FMA but no AVX-512): textgen's own kernel (layers/linear_ops.cpp), which streams the
  weight from memory faster than the libraries' at one row on some CPUs, reads it once for up to six rows with
  AVX-512, and on AVX2 computes torch's own bf16 product 3-4x faster than torch at every row count. In
  bfloat16 it serves a bucket only where it reproduces `F.linear`'s bits there, checked at load (see
  `GemvKernel`).
Which is fastest depends on the CPU (MKL's fp32 kernels are slow on some vendors' cores, oneDNN's blocked layout
loses to them at one row on others) and on the row count. So the shard does not guess: for each distinct
(out, in, dtype) shape it times every available path (one row on the shard's threads, more on one thread: see
`time_paths`) at one row count per bucket of rows (1, 2-8, 9-64, >64), keeps the fastest per bucket (one main
path unless another is clearly faster, see `choose`), and each forward call picks its bucket's kernel from its
row count. The times are kept per CPU, torch and thread count for the next starts (layers/measurements.py), which
read them instead of timing again.

`TEXTGEN_CPU_LINEAR` = auto (default) | linear | mkl | onednn | gemv forces one path for every bucket
(reproducible runs); where the forced path does not exist for a dtype or device, or does not serve a bucket,
`linear` serves instead.

Outputs: in bfloat16 every path gives `F.linear`'s bits (the oneDNN reorder feeds the kernels `F.linear` uses;
`gemv` sums in their order, found by comparison);
in float32 the paths sum in different orders: the same fp32 accuracy, not the same bits (test_linear.py,
test_kernel_choice.py).
"""

from __future__ import annotations

import logging
import math
import os
import time
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from textgen_server.config import DISABLE_CUSTOM_KERNELS, UnsupportedConfigError, custom_kernels_disabled
from textgen_server.layers import cpu_ops
from textgen_server.layers.measurements import Measurements, measurements
from textgen_server.utils import cgroup
from textgen_server.utils.memory import in_huge_pages

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
# Second layouts of the measured choices (a shape whose buckets run two paths keeps its weight twice) may take
# at most this share of the memory available at load; the KV cache is sized from what is left after the load.
SECOND_LAYOUTS_SHARE = 0.25
# Timing rounds per bucket: at least MIN_ROUNDS, more until MIN_SECONDS of kernel time, at most MAX_ROUNDS.
MIN_ROUNDS, MAX_ROUNDS, MIN_SECONDS = 5, 20, 0.005

# Before each timed call, a buffer of twice the last-level cache (at most EVICT_MAX) is read, so that the call
# finds its weight in memory as a decode step does once the step's other weights went through the caches: timed
# hot, the paths ranked otherwise than in the step (benchmark/README.md, "gemv").
EVICT_MAX, EVICT_FALLBACK = 256 * 2**20, 32 * 2**20

# Both packed layouts are built for a nominal row count. Measured on torch 2.13, each gives the same results
# for every row count >= 2 whatever count it was built for, and fp32-close ones at 1 row; bfloat16 gives
# F.linear's bits (test_linear.py checks both).
_PACK_ROWS = 64


class Projection(Protocol):
    """What the choice needs of a projection layer (tensor_parallel.Linear): its shape, weight and bias, and `use`,
    which gives bucket i the kernel of path i."""

    # Read-only: Linear's are plain attributes, its bias an nn.Parameter.
    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def bias(self) -> torch.Tensor | None: ...

    def plain_weight(self) -> torch.Tensor: ...

    def use(self, paths: tuple[str, ...]) -> None: ...


def bucket(rows: int) -> int:
    """The index of the bucket `rows` falls in."""
    return bisect_left(BUCKET_LIMITS, rows)


class Direct(NamedTuple):
    """A kernel's projection as the C++ decode blocks call it (layers/decode_blocks.cpp, whose header lists what
    `tensors` and `ints` hold for each `kind`)."""

    kind: int
    tensors: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    ints: tuple[int, int]


# Direct.kind: the op a projection runs (decode_blocks.cpp's `Kind`).
DIRECT_LINEAR, DIRECT_GEMV, DIRECT_INT4, DIRECT_INT8 = range(4)


def bucket_max_rows(bucket_index: int) -> int | None:
    """The most rows bucket `bucket_index` takes (None: no limit)."""
    return BUCKET_LIMITS[bucket_index] if bucket_index < len(BUCKET_LIMITS) else None


class Kernel(ABC):
    """One path of y = x @ W^T + b, holding W in the layout it reads."""

    path: ClassVar[str]

    @staticmethod
    @abstractmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this torch build and CPU have the path for weights of `dtype` on `device`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias

    def serves(self, bucket_index: int) -> bool:
        """Whether this kernel computes the rows of bucket `bucket_index` as its path promises."""
        return True

    def direct(self, bucket_index: int) -> Direct | None:
        """This kernel's `__call__` on the rows of bucket `bucket_index` as one op the C++ decode blocks call with
        the same arguments, or None where it is not one such op."""
        return None

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

    def direct(self, bucket_index: int) -> Direct | None:
        return Direct(DIRECT_LINEAR, (self.weight, self.bias, None), (0, 0))

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


class GemvKernel(Kernel):
    """textgen::gemv (layers/linear_ops.cpp) on a weight packed in blocks of 16 (AVX-512) or 8 (AVX2) outputs
    (bfloat16 on AVX2: the weight as it is).

    float32: up to 64 rows (with AVX-512 up to six at once over each read of the weight, with AVX2 one at a time);
    each output sums its products in order, in runs of FLOAT32_RUN values then added, which keeps it within
    float32's tolerance like the other paths (test_linear.py).

    bfloat16 with AVX512-BF16: up to 64 rows (the op takes up to six at once over each read of the weight);
    oneDNN's bf16 kernels (behind `F.linear`) sum each output's products in order, in runs of K values that are
    then added; the run length is oneDNN's own choice, and it moves with the row count (on a Zen 4, for a K over
    1024: 512 values at one row, 1024 at 2-64; benchmark/README.md, "gemv" and "2-64 rows in `gemv`"). This kernel
    sums in runs of `k_chunks[b]` in bucket b, found at load per shape and thread count: the first of CHUNKS whose
    outputs equal `F.linear`'s at every row count of the bucket (CHECK_ROWS), on CHECK_OUTPUTS random values at one
    row and ROWS_CHECK_OUTPUTS at each other count; a bucket where none does (another CPU, AMX, another oneDNN, a
    row count where oneDNN changes its runs) is not served. Past 64 rows (prefills) oneDNN's kernels keep it.

    bfloat16 on AVX2 (`gemv_sums_in_runs` False): the op sums in the order of torch's own dot product, which is
    `F.linear`'s there at every row count; it has that one order (k_chunk 0) and no bias. The same check at
    load, at each bucket's row count, decides which buckets it may serve (a layer with a bias: none, `F.linear`
    then takes another path); the timing then decides which it does."""

    path = "gemv"
    FLOAT32_RUN = 256
    # bfloat16 run lengths tried, most likely first; 0 sums the whole K in one run.
    CHUNKS = (512, 1024, 256, 2048, 0)
    # Outputs compared per run length: enough for a wrong length to show dozens of differing ones (benchmark/README.md).
    CHECK_OUTPUTS = 2**19
    # The row counts checked for each bucket bf16 runs may serve (all but the last, prefills): every count, as
    # oneDNN's runs move with the count.
    CHECK_ROWS = tuple(
        tuple(range(low + 1, high + 1)) for low, high in zip((0, *BUCKET_LIMITS[:-1]), BUCKET_LIMITS, strict=True)
    )
    # Outputs compared at each row count past one: a wrong length differs in 1-5 of 10,000 outputs (one bf16 step),
    # so 2**17 shows dozens.
    ROWS_CHECK_OUTPUTS = 2**17

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        return cpu_ops.ops_for(dtype, device) and bool(torch.ops.textgen.gemv_supported(dtype))

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.textgen.gemv_pack(weight.contiguous())
        if self.packed.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():  # not the weight itself
            self.packed = in_huge_pages(self.packed)  # read whole at every one-row step: fewer TLB misses
        self.bias_f32 = None if bias is None else bias.float().contiguous()
        # The run length of each bucket's sums; None where the kernel does not serve the bucket.
        self.k_chunks: tuple[int | None, ...] = (None,) * len(BUCKET_ROWS)
        if weight.dtype == torch.float32:  # no bits to match: 1-64 rows, the timing at load decides
            self.k_chunks = (self.FLOAT32_RUN,) * len(self.CHECK_ROWS) + (None,)
            return
        # Found once per CPU, torch, shape and thread count (layers/measurements.py): the check runs F.linear and
        # the kernel at every row count of each bucket it may serve, per run length tried (`_check`).
        known = measurements(last_level_cache_bytes())
        shape = f"{self.out_features}x{self.in_features}"
        key = f"gemv runs {shape} bias {bias is not None} threads {torch.get_num_threads()}"
        found = known.get(key)
        if not isinstance(found, list) or len(found) != len(BUCKET_ROWS):
            found = self._check(weight, bias)
            known.put(key, found)
        self.k_chunks = tuple(chunk if isinstance(chunk, int) else None for chunk in found)

    def _check(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[int | None]:
        """Each bucket's run length that gives `F.linear`'s bits at every row count checked; None where none."""
        if torch.ops.textgen.gemv_sums_in_runs(weight.dtype):
            # A run of K or more is the same sums as 0.
            chunks = [c for c in self.CHUNKS if c < self.in_features or c == 0]
            found: list[int | None] = []
            for counts in self.CHECK_ROWS:
                outputs = self.CHECK_OUTPUTS if counts == (1,) else self.ROWS_CHECK_OUTPUTS
                # The length the last bucket found first.
                last = next((c for c in reversed(found) if c is not None), None)
                tried = chunks if last is None else [last, *(c for c in chunks if c != last)]
                found.append(
                    next(
                        (c for c in tried if all(self._same_bits(weight, bias, c, rows, outputs) for rows in counts)),
                        None,
                    )
                )
            return found + [None] * (len(BUCKET_ROWS) - len(found))
        if bias is not None:
            return [None] * len(BUCKET_ROWS)
        share = self.CHECK_OUTPUTS // len(BUCKET_ROWS)
        return [0 if self._same_bits(weight, None, 0, rows, share) else None for rows in BUCKET_ROWS]

    def _same_bits(self, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int, rows: int, outputs: int) -> bool:
        g = torch.Generator(device=weight.device).manual_seed(0)
        samples = -(-outputs // (self.out_features * rows))
        xs = torch.randn(samples, rows, self.in_features, generator=g).to(weight.dtype)
        with torch.inference_mode():
            return all(
                torch.equal(
                    torch.ops.textgen.gemv(x, self.packed, self.bias_f32, self.out_features, chunk),
                    F.linear(x, weight, bias),
                )
                for x in xs
            )

    def serves(self, bucket_index: int) -> bool:
        return self.k_chunks[bucket_index] is not None

    def _chunk(self, bucket_index: int) -> int | None:
        """The run length rows of the bucket are summed in: its own, else (a bucket not served, called all the same)
        the first bucket's that has one."""
        own = self.k_chunks[bucket_index]
        return own if own is not None else next((c for c in self.k_chunks if c is not None), None)

    def direct(self, bucket_index: int) -> Direct | None:
        chunk = self._chunk(bucket_index)
        if chunk is None:
            return None
        return Direct(DIRECT_GEMV, (self.packed, self.bias_f32, None), (self.out_features, chunk))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        chunk = self._chunk(bucket(x.numel() // self.in_features))
        if chunk is None:
            raise RuntimeError("gemv: no run length gives F.linear's bits for this shape on this CPU")
        return torch.ops.textgen.gemv(x, self.packed, self.bias_f32, self.out_features, chunk)


KERNELS: dict[str, type[Kernel]] = {k.path: k for k in (PlainKernel, MklKernel, OnednnKernel, GemvKernel)}
CHOICES = ("auto", *KERNELS)


def available_paths(dtype: torch.dtype, device: torch.device) -> list[str]:
    return [path for path, kernel in KERNELS.items() if kernel.available(dtype, device)]


def forced_path() -> str | None:
    """The path `TEXTGEN_CPU_LINEAR` forces, None for auto; UnsupportedConfigError for an unknown value."""
    value = os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise UnsupportedConfigError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return None if value == "auto" else value


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size as Linux reports it (/sys); EVICT_FALLBACK where it says nothing."""
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes) or EVICT_FALLBACK


def time_paths(weight: torch.Tensor, bias: torch.Tensor | None, paths: list[str]) -> dict[str, list[float]]:
    """Least seconds of each path at each bucket's row count, the paths called in turn so that each sees the
    same machine state, each with its weight out of the caches (EVICT_MAX); infinite where a path does not serve
    the bucket (`Kernel.serves`).

    The buckets of several rows are timed on one thread, whatever the shard runs with: with several, a call whose
    sibling thread waits for a core that other work holds takes milliseconds, and on a busy machine every path
    measured alike, so the choice was noise (benchmark/README.md). What differs between the paths there is each
    core's kernel (ISA, blocking, packing); their order on one thread matched their order on two where we
    measured. One row is timed on the shard's threads: it is bound by memory, and a path's speed there is how
    much of the cores' combined bandwidth it draws, which one thread does not show (on an AVX2 Zen 3, MKL's
    one-row product ran about as fast on two threads as on one and `gemv` 1.5-1.9x faster on two, while on one
    they were within 10%; benchmark/README.md, "gemv"). The least, not the median: other load only adds time, and
    the least run is the one it disturbed least."""
    kernels = [KERNELS[path](weight, bias) for path in paths]
    g = torch.Generator(device=weight.device).manual_seed(0)
    evict = torch.ones(min(2 * last_level_cache_bytes(), EVICT_MAX) // 4)
    least: dict[str, list[float]] = {path: [] for path in paths}
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for index, rows in enumerate(BUCKET_ROWS):
                torch.set_num_threads(threads if rows == 1 else 1)
                x = torch.randn(rows, weight.shape[1], generator=g, device=weight.device).to(weight.dtype)
                times = least_times([kernel for kernel in kernels if kernel.serves(index)], x, evict)
                for path in paths:
                    least[path].append(times.get(path, math.inf))
    finally:
        torch.set_num_threads(threads)
    return least


def least_times(
    kernels: list[Kernel], x: torch.Tensor, evict: torch.Tensor, keep_within: float = math.inf
) -> dict[str, float]:
    """Least seconds of each kernel on `x`, the kernels called in turn, each after reading `evict` (its weight
    out of the caches): at least MIN_ROUNDS rounds, more until MIN_SECONDS of kernel time, at most MAX_ROUNDS.
    After the first round a kernel more than `keep_within` times slower than the fastest is not called again."""
    for kernel in kernels:
        kernel(x)  # first-touch allocations
    least = {kernel.path: math.inf for kernel in kernels}
    spent, rounds = 0.0, 0
    while rounds < MAX_ROUNDS and (rounds < MIN_ROUNDS or spent < MIN_SECONDS):
        if rounds == 1 and kernels:
            fastest = min(least.values())
            kernels = [kernel for kernel in kernels if least[kernel.path] <= keep_within * fastest]
        for kernel in kernels:
            evict.sum()
            start = time.perf_counter()
            kernel(x)
            took = time.perf_counter() - start
            least[kernel.path] = min(least[kernel.path], took)
            spent += took
        rounds += 1
    return least


def main_path(times: dict[str, list[float]]) -> str:
    """The path with the least time relative to each bucket's fastest, summed over the buckets."""
    buckets = range(len(BUCKET_ROWS))
    fastest = [min(t[b] for t in times.values()) for b in buckets]
    return min(times, key=lambda p: sum(times[p][b] / fastest[b] for b in buckets))


def choose(times: dict[str, list[float]]) -> tuple[str, ...]:
    """One path per bucket from `time_paths`' times: the main path everywhere, except in a bucket where another
    is more than MARGIN faster."""
    main = main_path(times)
    buckets = range(len(BUCKET_ROWS))
    fastest = [min(times, key=lambda p: times[p][b]) for b in buckets]
    return tuple(main if times[main][b] <= times[fastest[b]][b] * (1 + MARGIN) else fastest[b] for b in buckets)


def forced_choice(forced: str, paths: list[str], layer: Projection) -> tuple[tuple[str, ...], str]:
    """The forced path in every bucket it serves for `layer`'s shape, `linear` in the others; and why."""
    if forced not in paths:
        return ("linear",) * len(BUCKET_ROWS), f"{ENV}={forced}: no {forced} path here"
    kernel = KERNELS[forced](layer.plain_weight(), layer.bias)
    choice = tuple(forced if kernel.serves(b) else "linear" for b in range(len(BUCKET_ROWS)))
    if "linear" in choice and forced != "linear":
        return choice, f"{ENV}={forced}: linear where {forced} does not serve"
    return choice, f"{ENV}={forced}"


class Plan(NamedTuple):
    """The kernels one projection shape's layers will use, and the log line's reason."""

    shape: str  # for the log line
    group: list[Projection]
    choice: tuple[str, ...]  # a path per bucket
    how: str
    main: str | None = None  # the measured main path; None where forced or the only one

    def second_layout_bytes(self) -> int:
        """Memory the measured choice's layouts take beyond one copy of the weights."""
        if self.main is None:
            return 0
        return (len(set(self.choice)) - 1) * sum(layer.plain_weight().nbytes for layer in self.group)

    def main_only(self) -> Plan:
        return self if self.main is None else self._replace(choice=(self.main,) * len(BUCKET_ROWS))


def choose_linear_kernels(layers: Iterable[Projection]) -> None:
    """Give every layer its kernel per bucket: measured once per distinct (out, in, dtype) shape on the first
    layer of that shape (or forced by TEXTGEN_CPU_LINEAR), one log line per shape. Where the measured choices'
    second layouts would take more than SECOND_LAYOUTS_SHARE of the memory available, every shape keeps its main
    path alone."""
    if custom_kernels_disabled():
        # Every layer keeps the F.linear it was built with: no timing at load, no other layout.
        logger.info("CPU linear: F.linear everywhere (%s)", DISABLE_CUSTOM_KERNELS)
        return
    forced = forced_path()
    known = measurements(last_level_cache_bytes())
    groups: dict[tuple[int, int, torch.dtype, torch.device], list[Projection]] = {}
    for layer in layers:
        weight = layer.plain_weight()
        groups.setdefault((layer.out_features, layer.in_features, weight.dtype, weight.device), []).append(layer)
    plans: list[Plan] = []
    for (out_f, in_f, dtype, device), group in groups.items():
        paths = available_paths(dtype, device)
        shape = f"{out_f}x{in_f} {str(dtype).removeprefix('torch.')} ({len(group)} layers)"
        if forced is not None:
            plans.append(Plan(shape, group, *forced_choice(forced, paths, group[0])))
        elif len(paths) == 1:
            plans.append(Plan(shape, group, (paths[0],) * len(BUCKET_ROWS), "the only path here"))
        else:
            times, when = path_times(group[0], paths, known)
            rows = "/".join(map(str, BUCKET_ROWS))
            how = f"measured{when}, least ms at {rows} rows: " + ", ".join(
                f"{p} " + "/".join(f"{t * 1e3:.3f}" for t in times[p]) for p in paths
            )
            plans.append(Plan(shape, group, choose(times), how, main_path(times)))
    second = sum(plan.second_layout_bytes() for plan in plans)
    available = cgroup.available_memory()  # a container's limit counts
    if second and second > SECOND_LAYOUTS_SHARE * available:
        logger.warning(
            "CPU linear: the fastest kernels per row count would keep %d MiB of second weight layouts, more than"
            " %.0f%% of the %d MiB available: each shape keeps its main path alone",
            second >> 20,
            SECOND_LAYOUTS_SHARE * 100,
            available >> 20,
        )
        plans = [plan.main_only() for plan in plans]
    for plan in plans:
        for layer in plan.group:
            layer.use(plan.choice)
        by_bucket = ", ".join(f"{name}: {path}" for name, path in zip(BUCKET_NAMES, plan.choice, strict=True))
        logger.info("CPU linear %s, rows %s (%s)", plan.shape, by_bucket, plan.how)
    known.save()


def path_times(layer: Projection, paths: list[str], known: Measurements) -> tuple[dict[str, list[float]], str]:
    """`time_paths` for `layer`'s shape, from an earlier start's measurement where one timed every path; and
    how the log line says where the times come from."""
    weight = layer.plain_weight()
    key = (
        f"times {layer.out_features}x{layer.in_features} {weight.dtype} bias {layer.bias is not None}"
        f" threads {torch.get_num_threads()}"
    )
    stored = known.get(key)
    if isinstance(stored, dict) and all(path in stored for path in paths):
        return {path: stored[path] for path in paths}, " at an earlier start"
    times = time_paths(weight, layer.bias, paths)
    known.put(key, times)
    return times, ""
