"""The CPU kernels that compute y = x @ W^T + b on quantized weights kept packed, and which one a weight gets.

- `Int4Kernel`: torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) reads 4 bits a weight and dequantizes in
  registers, W = (q - 8) * scale + offset per group of 32-256 consecutive input features: a checkpoint's
  (q - zero) * scale is fed as scale and offset = (8 - zero) * scale, and a checkpoint group of G features is fed
  as G / g kernel groups of g features with the same scale. Act-order checkpoints (GPTQ `desc_act`), whose groups
  are scattered over the input features, are served by permuting the input features once at load (the groups
  become consecutive) and the activations' columns the same way at each call. bfloat16 activations only: its
  float32 path is a scalar fallback, 6x slower than F.linear on the dequantized weight at one row on a 2-core Zen 3
  (benchmark/README.md, "Quantized models"). One row (a batch-1 decode step) goes to textgen's own
  `textgen::int4_gemv` (int4_ops.cpp) on the same packed weight and scales where the CPU ops are on (cpu_ops.py):
  torch's kernel streams the weight well below the memory's bandwidth there. So do a few rows (a batched decode
  step: four rows a read of the weight on torch's AVX2 layout, all of them on its AVX-512 one where the CPU has
  VNNI, else row by row), up to the count where that measured faster at load (`gemv_until`; on a Zen 4 with VNNI,
  every count, prefills included). More rows run as a GEMM on the weight dequantized for the call
  (`textgen::int4_dequantize`; in bfloat16 where the CPU multiplies it natively, else float32: `gemm_dtype`) from
  the row count where that measured faster at load, if any.
- `Int8Kernel`: int8 weights with one scale per output feature (symmetric, per-channel: eetq, and 8-bit
  checkpoints quantized that way): one row by `textgen::int8_gemv` (int8_ops.cpp) where the CPU ops are on; more
  by `textgen::int8_rows` (bf16 pair products, where the CPU has AVX512-BF16) over the row counts where that
  measured faster at load (`rows_band`), else by torch's `_weight_int8pack_mm`, and from the row count where it
  measured faster at load as a GEMM on the weight dequantized for the call, as the int4 kernel
  (`dequantize_from`); bfloat16 activations (torch's float32 path, like its int4 kernel's, is a scalar fallback:
  float32 shards dequantize at load). Both share `PackedKernel`.
- `Int8DynamicKernel`: the same weights (both int8 kernels hold them as `Int8Weights`) with the activations
  quantized to int8 per row at each call (compressed-tensors W8A8), the integers multiplied by the path timed
  fastest at load (`torch._int_mm` where the CPU has an int8 dot product).

`packed_kernel(weight)` gives the kernel that serves a weight, or the reason none does (the weight is then
dequantized at load and served like a float one).
"""

from __future__ import annotations

import functools
import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar, TypeVar

import torch
import torch.nn.functional as F

from textgen_server.config import UnsupportedConfigError, custom_kernels_disabled
from textgen_server.layers import cpu_ops
from textgen_server.layers.linear_choice import (
    BUCKET_NAMES,
    BUCKET_ROWS,
    DIRECT_INT4,
    DIRECT_INT8,
    Direct,
    Kernel,
    bucket,
    bucket_max_rows,
    last_level_cache_bytes,
)
from textgen_server.layers.measurements import measurements
from textgen_server.layers.quantized_weight import QuantizedWeight
from textgen_server.utils.memory import in_huge_pages

logger = logging.getLogger(__name__)
T = TypeVar("T")
Product = Callable[[torch.Tensor], torch.Tensor]  # rows [M, K] -> their product with a weight, [M, N]

INT4_GROUP_SIZES = (256, 128, 64, 32)  # what the int4 kernel takes, largest first
# Row counts at which a many-row int4 or int8 product is timed both ways at load (`dequantize_from`).
DEQUANTIZE_ROWS = (32, 64, 128, 512)
# Row counts at which textgen's int4 op is timed against the path the kernel takes without it (`gemv_until`).
GEMV_ROWS = (8, 64, 256, 512, 2048)
# Row counts at which textgen's many-row int8 op is timed against the path the kernel takes without it (`rows_band`).
BAND_ROWS = (4, 8, 16, 32, 64, 256, 512, 2048)
# `gemv_until` (and `rows_band`'s last count) where the op won at every count: it then serves every count. Past
# 2,048 rows both ways cost about the same per row (the int4 op passes over the weight for every 256 rows; the
# dequantized GEMM's one dequantize is spread over more rows: 2-5% of its time at 2,048 on the Zen 4).
EVERY_COUNT = 1 << 62
# The rounds of each timing at load (the least counts).
TIMING_ROUNDS = 3
# The int4 kernel's K tiling, as torch's int4 weight-only quantization (torchao) packs for CPUs.
INNER_K_TILES = 2


def packed_kernel(weight: QuantizedWeight, bias: torch.Tensor | None) -> PackedKernel | str:
    """The kernel that computes `weight` packed, or why none does."""
    device = weight.q.device.type
    if weight.dynamic_activations:
        # Dequantizing would silently drop the checkpoint's activation quantization: no kernel, no start.
        why = f"a {device} device" if device != "cpu" else Int8DynamicKernel.why_not(weight)
        if why is not None:
            raise UnsupportedConfigError(f"W8A8 weights with {why} are not supported")
        return Int8DynamicKernel(weight, bias)
    if device != "cpu":
        return f"a {device} device (the packed kernels are torch's CPU ones)"
    kernel: type[Int4Kernel | Int8Kernel] = Int8Kernel if weight.bits == 8 else Int4Kernel
    reason = kernel.why_not(weight)
    return kernel(weight, bias) if reason is None else reason


def least_seconds(call: Callable[[], object], rounds: int) -> float:
    """The least wall time of `rounds` calls, after one untimed call."""
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def kept_measurement(key: str, field: str, measure: Callable[[], T], report: Callable[[T], None]) -> T:
    """`measure()`'s result, kept under `key` in this CPU's measurements (layers/measurements.py) for the next
    starts: measured, and told to `report`, only where no earlier start kept it. The load writes the process's
    measurements once, with the linear choice's (choose_linear_kernels, run on the model's float layers after every
    quantized one is built)."""
    known = measurements(last_level_cache_bytes())
    found = known.get(key)
    if not isinstance(found, dict) or field not in found:
        found = {field: measure()}
        known.put(key, found)
        report(found[field])
    return found[field]


def _wins(
    first: Product, second: Product, row_counts: tuple[int, ...], in_features: int, dtype: torch.dtype
) -> Iterator[tuple[int, bool]]:
    """(rows, whether `first` ran faster than `second` on that many random rows), a count at a time as asked for."""
    g = torch.Generator().manual_seed(0)
    for rows in row_counts:
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        first_s = least_seconds(functools.partial(first, x), TIMING_ROUNDS)
        yield rows, first_s < least_seconds(functools.partial(second, x), TIMING_ROUNDS)


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a many-row product on a weight dequantized for the call, for rows of `dtype`: bfloat16 rows
    where the CPU multiplies bfloat16 natively (oneDNN's bf16 GEMM ran 2.2-2.9x its float32 one at 2,048 rows on a
    Zen 4 with AVX512-BF16; the weight is then rounded to bf16 as a bf16 checkpoint's is), float32 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 and cpu_ops.x86_bf16_hardware() else torch.float32


def dequantize_from(label: str, kernel: Product, gemm: Product, in_features: int, dtype: torch.dtype) -> int | None:
    """The fewest rows (of DEQUANTIZE_ROWS) whose product runs faster through `gemm` (a GEMM in `gemm_dtype` on
    the weight dequantized for the call) than through torch's packed `kernel`, None where none does: measured once
    per CPU, torch, shape and thread count. On a CPU without bf16 arithmetic torch's int4 and int8 kernels ran
    1.5-2x slower than the float32 GEMM from 512 rows on; with AVX512-BF16, 2.2-2.3x slower than the bf16 GEMM at
    2,048 rows (benchmark/README.md, "Quantized models"), and on a Zen 4 the int4 weight dequantized to bf16 and
    multiplied beat torch's int4 kernel from 32-64 rows ("int4 and int8 prefills")."""

    def measure() -> int | None:
        return next((rows for rows, won in _wins(gemm, kernel, DEQUANTIZE_ROWS, in_features, dtype) if won), None)

    def report(rows: int | None) -> None:
        how = (
            f"from {rows} rows as a {gemm_dtype(dtype)} GEMM on the dequantized weight"
            if rows
            else "the packed kernel only"
        )
        logger.info("CPU %s, many rows: %s (measured)", label, how)

    key = f"{label} dequantize threads {torch.get_num_threads()}"
    return kept_measurement(key, "rows", measure, report)


def gemv_until(label: str, gemv: Product, kernel: Product, in_features: int, dtype: torch.dtype) -> int:
    """The most rows (1, one of GEMV_ROWS, or EVERY_COUNT where it won at all of them) up to which `gemv` (textgen's
    op: row by row, each row streaming the whole weight, or many rows a read on AVX2 and on AVX-512 with VNNI) ran
    faster than `kernel` (what runs without it: torch's packed kernel, or the GEMM on the weight dequantized for the
    call) at every measured count: measured once per CPU, torch, shape and thread count. On the 2-core Zen 3 the
    int4 op, row by row, took 0.5-0.7x torch's int4 kernel's time from 2 to 64 rows (benchmark/README.md, "Quantized
    models"); on a Zen 4 with VNNI, 0.65-0.92x the dequantized GEMM's at 512 and 2,048 rows on the small and the
    `1b` model's shapes ("int4 at many rows")."""

    def measure() -> int:
        until = 1
        for rows, won in _wins(gemv, kernel, GEMV_ROWS, in_features, dtype):
            if not won:
                return until
            until = rows
        return EVERY_COUNT

    def report(rows: int) -> None:
        most = "every count of rows" if rows == EVERY_COUNT else f"up to {rows} rows"
        logger.info("CPU %s: textgen's op %s (measured)", label, most)

    key = f"{label} gemv threads {torch.get_num_threads()}"
    return kept_measurement(key, "rows", measure, report)


def rows_band(label: str, op: Product, kernel: Product, in_features: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """The row counts (first, last: of BAND_ROWS, the last EVERY_COUNT where it won through all of them) over which
    `op` ran faster than `kernel` at load, the first measured count it won and every one after it up to a loss; None
    where it won at none. For textgen::int8_rows, whose conversion of each block of the weight to bf16 pairs loses
    to torch's int8 kernel at a few rows, and whose bf16 sums can lose to a GEMM on the dequantized weight at many
    (benchmark/README.md, "int8 at many rows"). Measured once per CPU, torch, shape and thread count."""

    def measure() -> list[int] | None:
        band: list[int] = []
        for rows, won in _wins(op, kernel, BAND_ROWS, in_features, dtype):
            if won:
                band = [band[0] if band else rows, rows]
            elif band:
                return band
        return [band[0], EVERY_COUNT] if band else None

    def report(band: list[int] | None) -> None:
        if band is None:
            logger.info("CPU %s: textgen's many-row op at no row count (measured)", label)
        else:
            last = "every count" if band[1] == EVERY_COUNT else str(band[1])
            logger.info("CPU %s: textgen's many-row op from %d rows to %s (measured)", label, band[0], last)

    band = kept_measurement(f"{label} rows threads {torch.get_num_threads()}", "band", measure, report)
    return None if band is None else (band[0], band[1])


def without_op(rows: torch.Tensor, dequantize_from: int | None, gemm: Product, packed: Product) -> torch.Tensor:
    """The rows a packed kernel does not give textgen's own op: from `dequantize_from` rows (where measured faster)
    `gemm`, the GEMM on the weight dequantized for the call, else `packed`, torch's kernel on the packed weight."""
    if dequantize_from is not None and rows.shape[0] >= dequantize_from:
        return gemm(rows)
    return packed(rows)


def _consecutive_groups(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the input-feature order that makes every group G consecutive features, each block's group id), or None."""
    order = torch.argsort(weight.g_idx, stable=True)
    blocks = weight.g_idx[order].view(-1, weight.group_size)
    if not bool((blocks == blocks[:, :1]).all()) or blocks[:, 0].unique().numel() != blocks.shape[0]:
        return None
    return order, blocks[:, 0]


class PackedKernel(Kernel):
    """A kernel on a quantized weight: the rows of x through `product`, the bias added, x's leading shape back."""

    # The activations' dtypes the kernel runs at speed (torch's float32 int4/int8 paths are scalar loops: 6-10x
    # slower than F.linear on the float weight at one row on the 2-core Zen 3, benchmark/README.md, "Quantized models").
    activation_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)

    def __init__(self, data: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__(data, bias)
        self.in_features = in_features

    @classmethod
    def available(cls, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in cls.activation_dtypes

    @classmethod
    def _dtype_refused(cls, weight: QuantizedWeight) -> str | None:
        """Why this kernel does not take the weight's activation dtype (its scales'), or None."""
        if cls.available(weight.scales.dtype, weight.q.device):
            return None
        return f"{weight.scales.dtype} activations (the {cls.path} kernel runs bfloat16 only at speed)"

    @abstractmethod
    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] @ W^T -> [M, N], without the bias."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


class Int4Kernel(PackedKernel):
    """The packed 4-bit weight and its per-group scale and offset."""

    path = "int4"

    @classmethod
    def why_not(cls, weight: QuantizedWeight) -> str | None:
        """Why the int4 kernel cannot compute this weight, or None when it can."""
        n, k = weight.shape
        if weight.bits != 4:
            return f"{weight.bits}-bit weights"
        if (refused := cls._dtype_refused(weight)) is not None:
            return refused
        if k % weight.group_size or n % 16 or not any(weight.group_size % g == 0 for g in INT4_GROUP_SIZES):
            return f"shape {n}x{k} with groups of {weight.group_size}"
        if _consecutive_groups(weight) is None:
            return "act-order groups of unequal sizes in this shard's input features"
        return None

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        reason = self.why_not(weight)
        if reason is not None:
            raise ValueError(f"the int4 kernel cannot serve this weight: {reason}")
        consecutive = _consecutive_groups(weight)
        assert consecutive is not None
        order, groups = consecutive
        self.order = None if bool((order == torch.arange(order.numel())).all()) else order
        q = weight.q if self.order is None else weight.q[:, order]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
        packed = in_huge_pages(packed)  # read whole at every one-row step (utils/memory.py)
        super().__init__(packed, bias, weight.shape[1])
        self.packed = packed
        self.group_size = next(g for g in INT4_GROUP_SIZES if weight.group_size % g == 0)
        repeat = weight.group_size // self.group_size
        scales, zeros = weight.scales.float()[:, groups], weight.zeros.float()[:, groups]
        # [kernel groups, N, 2]: the scale and the offset of each kernel group and output feature
        pairs = torch.stack([scales, (8 - zeros) * scales], dim=-1).repeat_interleave(repeat, dim=1)
        self.scales_offsets = pairs.transpose(0, 1).contiguous().to(weight.scales.dtype)
        # One row, and as many more as measured faster, by textgen::int4_gemv, which reads the same packed weight
        # and scales (no second copy).
        self.gemv = cpu_ops.ops_for(weight.scales.dtype, weight.q.device)
        n, k = self.packed.shape[0], self.in_features
        label = f"int4 {n}x{k} group {self.group_size}"
        self.dequantize_from = (
            dequantize_from(label, self._int4, self._gemm, k, weight.scales.dtype) if self.gemv else None
        )
        self.gemv_until = gemv_until(label, self._op, self._without_op, k, weight.scales.dtype) if self.gemv else 0

    def direct(self, bucket_index: int) -> Direct | None:
        most = bucket_max_rows(bucket_index)
        if self.order is not None or not self.gemv or most is None or most > self.gemv_until:
            return None
        return Direct(DIRECT_INT4, (self.packed, self.bias, self.scales_offsets), (self.group_size, 0))

    def _op(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.textgen.int4_gemv(rows, self.packed, self.scales_offsets, self.group_size)

    def _int4(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_offsets)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        dtype = gemm_dtype(rows.dtype)
        weight = torch.ops.textgen.int4_dequantize(self.packed, self.scales_offsets, self.group_size, dtype)
        return F.linear(rows.to(dtype), weight).to(rows.dtype)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            rows = rows[:, self.order]
        rows = rows.contiguous()
        if rows.shape[0] <= self.gemv_until:
            return self._op(rows)
        return self._without_op(rows)

    def _without_op(self, rows: torch.Tensor) -> torch.Tensor:
        """Past `gemv_until`."""
        return without_op(rows, self.dequantize_from, self._gemm, self._int4)


class Int8Weights(PackedKernel):
    """int8 weights [N, K] and one scale per output feature: what both int8 kernels multiply."""

    path = "int8"

    @classmethod
    def why_not(cls, weight: QuantizedWeight) -> str | None:
        """Why this kernel cannot compute this weight, or None when it can."""
        if weight.bits != 8:
            return f"{weight.bits}-bit weights"
        if (refused := cls._dtype_refused(weight)) is not None:
            return refused
        if bool((weight.g_idx != weight.g_idx[0]).any()):
            return "8-bit groups (the int8 kernel takes one scale per output feature)"
        if bool((weight.zeros != 128).any()):
            return "8-bit zero points (the int8 kernel is symmetric)"
        return None

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        reason = self.why_not(weight)
        if reason is not None:
            raise ValueError(f"the {self.path} kernel cannot serve this weight: {reason}")
        ints = in_huge_pages((weight.q.to(torch.int16) - 128).to(torch.int8).contiguous())
        super().__init__(ints, bias, weight.shape[1])
        self.ints = ints
        self.scales = weight.scales[:, int(weight.g_idx[0])].contiguous()


class Int8Kernel(Int8Weights):
    """Weight-only int8 (eetq, W8A16): the activations stay float."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        # One row by textgen::int8_gemv (int8_ops.cpp), on the same weight and scales: 1.4-2x torch's kernel there.
        self.gemv = cpu_ops.ops_for(self.scales.dtype, weight.q.device)
        n, k = self.ints.shape
        label = f"int8 {n}x{k}"
        self.dequantize_from = (
            dequantize_from(label, self._int8, self._gemm, k, self.scales.dtype) if self.gemv else None
        )
        # More rows by textgen::int8_rows where the CPU multiplies bf16 pairs, over the counts measured faster.
        shares = self.gemv and n % 16 == 0 and k % 32 == 0 and torch.ops.textgen.int8_rows_supported()
        self.rows_band = rows_band(label, self._rows, self._without_op, k, self.scales.dtype) if shares else None

    def direct(self, bucket_index: int) -> Direct | None:
        if not self.gemv or bucket_max_rows(bucket_index) != 1:
            return None
        return Direct(DIRECT_INT8, (self.ints, self.bias, self.scales), (0, 0))

    def _int8(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.ints, self.scales)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        dtype = gemm_dtype(rows.dtype)
        weight = torch.ops.textgen.int8_dequantize(self.ints, self.scales, dtype)  # only measured with the ops on
        return F.linear(rows.to(dtype), weight).to(rows.dtype)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.textgen.int8_rows(rows, self.ints, self.scales)

    def _without_op(self, rows: torch.Tensor) -> torch.Tensor:
        """Outside `rows_band` (and past one row)."""
        return without_op(rows, self.dequantize_from, self._gemm, self._int8)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.contiguous()
        if self.gemv and rows.shape[0] == 1:
            return torch.ops.textgen.int8_gemv(rows, self.ints, self.scales)
        if self.rows_band is not None and self.rows_band[0] <= rows.shape[0] <= self.rows_band[1]:
            return self._rows(rows)
        return self._without_op(rows)


class Int8DynamicKernel(Int8Weights):
    """compressed-tensors W8A8: int8 weights per output feature, and each row of x quantized to int8 at every call
    as the compressed-tensors package does it (symmetric: scale = max |x_row| / 127.5, round half to even, clamp
    to [-128, 127]); the product of the two integer matrices, scaled back by both scales.

    That product has three paths, timed at load per bucket of rows (linear_choice.BUCKET_ROWS) and kept per CPU,
    torch, shape and thread count (layers/measurements.py):
    - `int_mm`: summed in int32 by `torch._int_mm`, fast where the CPU multiplies int8 (VNNI, AMX) but a plain
      loop elsewhere: 4 GOP/s on the 2-core Zen 3 against 100 GFLOP/s for float32 `F.linear`;
    - `float`: the same integers as float32 through `F.linear`, on the weight converted for the call (no second
      copy kept): exact, so `int_mm`'s result, while a sum of products stays below 2^24;
    - `gemv` (one row, bfloat16 where the CPU ops are on): `textgen::int8_gemv` on the activations' integers
      (exact in bfloat16), its float32 sum rounded to bfloat16 before the activations' scale.
    benchmark/README.md, "Quantized models", has the times."""

    path = "w8a8"
    # The product is integer: float32 activations run as fast as bfloat16 ones.
    activation_dtypes = (torch.float32, torch.bfloat16)
    PATHS: ClassVar[tuple[str, ...]] = ("int_mm", "float", "gemv")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.scales_f32 = self.scales.float()
        # textgen::int8_quantize_rows and int8_rescale: the activations to integers and the integer sums back to
        # floats, each in one pass where torch's expressions take six and four, with their bits (on a 2-core Zen 4,
        # 9,239 x 2,048 activations 140 -> 10 ms, 2,048 x 4,096 sums 38 -> 1.5 ms: each as long as the product)
        self.ops = cpu_ops.ops_for(self.scales.dtype, weight.q.device)
        # int8_gemv takes bfloat16 scales: a float32 shard's would be rounded
        self.gemv = self.ops and self.scales.dtype == torch.bfloat16
        # --disable-custom-kernels: torch's integer product at every row count, nothing timed at load
        self.paths = ("int_mm",) * len(BUCKET_ROWS) if custom_kernels_disabled() else self._choose_paths()

    def _choose_paths(self) -> tuple[str, ...]:
        """The fastest path for each bucket of rows, measured once per CPU, torch, shape, dtype and thread count."""
        n, k = self.ints.shape
        dtype = str(self.scales.dtype).removeprefix("torch.")

        def report(paths: list[str]) -> None:
            by_bucket = ", ".join(f"{name}: {path}" for name, path in zip(BUCKET_NAMES, paths, strict=True))
            logger.info("CPU W8A8 %dx%d %s, rows %s (measured)", n, k, dtype, by_bucket)

        key = f"w8a8 {n}x{k} {dtype} gemv {self.gemv} threads {torch.get_num_threads()}"
        paths: list[str] = kept_measurement(key, "paths", self._measure_paths, report)
        return tuple(paths)

    def _measure_paths(self) -> list[str]:
        g = torch.Generator().manual_seed(0)
        chosen = []
        for rows in BUCKET_ROWS:
            x = torch.randn(rows, self.in_features, generator=g).to(self.scales.dtype)
            ints, scale = self._quantize(x)
            paths = [p for p in self.PATHS if p != "gemv" or (self.gemv and rows == 1)]
            times = {
                p: least_seconds(functools.partial(self._product, p, ints, scale, x.dtype), TIMING_ROUNDS)
                for p in paths
            }
            chosen.append(min(times, key=times.__getitem__))
        return chosen

    def _quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's int8 values and its float32 scale [M, 1]."""
        if self.ops:
            ints, scale = torch.ops.textgen.int8_quantize_rows(rows)
            if ints.shape == rows.shape:  # else a row holds an infinity or a NaN: torch's expression below
                return ints, scale
        floats = rows.float()
        scale = floats.abs().amax(dim=1, keepdim=True) / 127.5
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
        return torch.round(floats / scale).clamp(-128, 127).to(torch.int8), scale

    def _product(self, path: str, ints: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if path == "gemv":
            sums = torch.ops.textgen.int8_gemv(ints.to(torch.bfloat16), self.ints, self.scales).float()
            return (sums * scale).to(dtype)
        if path == "float":
            sums = F.linear(ints.float(), self.ints.float())
        else:
            # W^T as a view: _int_mm reads the [N, K] weight through it 3x faster than a [K, N] copy (2048x2048, one
            # row, Zen 3), and no second copy of the weight is kept.
            integers = torch._int_mm(ints, self.ints.t())
            if self.ops:
                return torch.ops.textgen.int8_rescale(integers, scale, self.scales_f32, dtype)
            sums = integers.float()
        return (sums * scale * self.scales_f32).to(dtype)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        ints, scale = self._quantize(rows)
        return self._product(self.paths[bucket(rows.shape[0])], ints, scale, rows.dtype)
