"""textgen::int8_gemv (layers/int8_ops.cpp): one row of an 8-bit projection with one scale per output feature,
against the float64 product of the row and the weight, and Int8Kernel's use of it for one-row calls only while the
CPU ops are switched on (test_cpu_targets.py reruns this file on the AVX2 build); textgen::int8_rows, many rows in
bf16 pairs where the CPU has AVX512-BF16, and the row counts Int8Kernel gives it; and textgen::int8_rescale, W8A8's
sums back to floats, against torch's expression."""

from __future__ import annotations

import pytest
import torch

from textgen_server.config import DISABLE_CUSTOM_KERNELS
from textgen_server.layers import cpu_ops, quant_kernels
from textgen_server.layers.quant_kernels import BAND_ROWS, EVERY_COUNT, Int8Kernel
from textgen_server.layers.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not cpu_ops.kernel_available(), reason="no C++ compiler: torch's kernel only")

SHAPES = [
    (1, 8),  # one output: no block of four
    (7, 24),  # a block of four and three single outputs
    (5, 13),  # K not a multiple of 8: the scalar sums
    (130, 64),  # two threads' blocks of 64 outputs, the last one short
    (768, 2048),
    (2304, 768),
]


def int8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + n * k)
    ints = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) / 50 + 0.001).to(torch.bfloat16)
    return ints, scales


def assert_near(got: torch.Tensor, x: torch.Tensor, ints: torch.Tensor, scales: torch.Tensor) -> None:
    """Within a bf16 rounding of each output, plus the float32 rounding of sums over K products."""
    want = (x.double() @ ints.double().t()) * scales.double()
    magnitude = (x.double().abs() @ ints.double().abs().t()) * scales.double()
    bound = want.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-24
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert bool(((got.double() - want).abs() <= bound).all()), (got.double() - want).abs().max()


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_one_row_is_the_product_with_the_scales(n: int, k: int) -> None:
    ints, scales = int8_weight(n, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    assert_near(torch.ops.textgen.int8_gemv(x, ints, scales), x, ints, scales)


def test_several_rows_are_computed_one_by_one() -> None:
    ints, scales = int8_weight(40, 96)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = torch.ops.textgen.int8_gemv(x, ints, scales)
    assert_near(got, x, ints, scales)
    assert torch.equal(got[3:4], torch.ops.textgen.int8_gemv(x[3:4], ints, scales))


def test_a_weight_that_does_not_match_is_refused() -> None:
    ints, scales = int8_weight(16, 64)
    x = torch.randn(1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.textgen.int8_gemv(torch.randn(1, 32).to(torch.bfloat16), ints, scales)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.textgen.int8_gemv(x, ints, scales[:8])
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.textgen.int8_gemv(x.float(), ints, scales)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.textgen.int8_gemv(x, ints.to(torch.uint8), scales)


class Spy:
    """torch.ops.textgen with int8_gemv counted."""

    def __init__(self) -> None:
        self.real = torch.ops.textgen
        self.calls = 0

    def int8_gemv(self, *args: object) -> torch.Tensor:
        self.calls += 1
        return self.real.int8_gemv(*args)


def per_channel_weight() -> QuantizedWeight:
    return QuantizedWeight.per_channel_int8(torch.randn(48, 128, generator=torch.Generator().manual_seed(0)).bfloat16())


def test_int8_kernel_serves_one_row_with_the_op_and_more_with_torch_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    kernel = Int8Kernel(per_channel_weight(), None)
    assert kernel.gemv
    spy = Spy()
    monkeypatch.setattr(torch.ops, "textgen", spy)
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    got = kernel(x)
    assert spy.calls == 1 and got.shape == (1, 1, 48)
    assert torch.equal(got[0], spy.real.int8_gemv(x[0], kernel.ints, kernel.scales))
    rows = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(kernel(rows), torch._weight_int8pack_mm(rows, kernel.ints, kernel.scales))
    assert spy.calls == 1


@pytest.mark.parametrize(("variable", "value"), [(DISABLE_CUSTOM_KERNELS, "True"), (cpu_ops.ENV_SWITCH, "0")])
def test_with_custom_kernels_off_int8_kernel_never_calls_the_op(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    monkeypatch.setenv(variable, value)
    kernel = Int8Kernel(per_channel_weight(), None)
    assert not kernel.gemv
    spy = Spy()
    monkeypatch.setattr(torch.ops, "textgen", spy)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    assert torch.equal(kernel(x), torch._weight_int8pack_mm(x, kernel.ints, kernel.scales))
    assert spy.calls == 0
    assert kernel.dequantize_from is None  # nothing timed at load either


@pytest.mark.parametrize("native_bf16", [False, True], ids=["float32-gemm", "bfloat16-gemm"])
def test_many_rows_run_as_a_gemm_from_the_measured_row_count(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    """Float32 where the CPU has no bf16 multiply; bf16 (the dequantized weight rounded to bf16) where it has."""
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    monkeypatch.setattr(cpu_ops, "x86_bf16_hardware", lambda: native_bf16)
    floats = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    weight = QuantizedWeight.per_channel_int8(floats)
    kernel = Int8Kernel(weight, None)
    kernel.dequantize_from, kernel.rows_band = 8, None  # as if measured (test_quantized.py checks the measurement)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    held = kernel.ints.float() * kernel.scales.float()[:, None]
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    assert torch.equal(kernel(x), torch.nn.functional.linear(x.to(dtype), held.to(dtype)).to(torch.bfloat16))
    assert (kernel(x).float() - x.float() @ held.t()).abs().max() <= 0.01 * (x.float() @ held.t()).abs().max()
    assert torch.equal(kernel(x[:7]), torch._weight_int8pack_mm(x[:7], kernel.ints, kernel.scales))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_gives_torch_s_bits(dtype: torch.dtype) -> None:
    """The weight for a many-row GEMM in one pass: `(weight.float() * scales.float()[:, None]).to(dtype)`'s bits."""
    g = torch.Generator().manual_seed(6)
    ints = torch.randint(-128, 128, (40, 100), generator=g, dtype=torch.int8)
    scales = (torch.rand(40, generator=g) * 1e-2).to(torch.bfloat16)
    got = torch.ops.textgen.int8_dequantize(ints, scales, dtype)
    assert got.dtype == dtype and torch.equal(got, (ints.float() * scales.float()[:, None]).to(dtype))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.textgen.int8_dequantize(ints, scales, torch.float16)
    with pytest.raises(RuntimeError, match="bf16 scales"):
        torch.ops.textgen.int8_dequantize(ints, scales.float(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rescale_gives_torch_s_bits(dtype: torch.dtype) -> None:
    """W8A8's integer sums back to floats in one pass: `(sums.float() * row_scale * col_scale).to(dtype)`'s bits,
    sums past 2^24 (rounded to float32 first) and a row whose scale is NaN (a NaN in x) included."""
    g = torch.Generator().manual_seed(4)
    sums = torch.randint(-(2**30), 2**30, (37, 70), generator=g, dtype=torch.int32)
    row_scale = torch.rand(37, 1, generator=g) * 1e-3
    row_scale[5] = float("nan")
    col_scale = torch.rand(70, generator=g) * 1e-2
    want = (sums.float() * row_scale * col_scale).to(dtype)
    got = torch.ops.textgen.int8_rescale(sums, row_scale, col_scale, dtype)
    assert got.dtype == dtype and bool(got[5].isnan().all())
    assert torch.equal(torch.cat([got[:5], got[6:]]), torch.cat([want[:5], want[6:]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_gives_torch_s_bits(dtype: torch.dtype) -> None:
    """W8A8's activations to integers in one pass: the compressed-tensors expression's bits (a row of zeros takes
    float32's epsilon as its scale; halves round to even), and nothing (empty tensors) where a row holds an infinity
    or a NaN, whose conversion to int8 torch leaves to the CPU."""
    x = (torch.randn(21, 45, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    x[1] = 0
    x[2, :4] = torch.tensor([127.5, 2.5, -2.5, 0.5])  # scale 1: ties at 2.5, -2.5 and 0.5
    floats = x.float()
    scale = floats.abs().amax(dim=1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    want = torch.round(floats / scale).clamp(-128, 127).to(torch.int8)
    ints, got_scale = torch.ops.textgen.int8_quantize_rows(x)
    assert torch.equal(ints, want) and torch.equal(got_scale, scale)
    assert ints[2, :4].tolist() == [127, 2, -2, 0]
    for bad in (float("nan"), float("inf")):
        x[7, 3] = bad
        assert [t.numel() for t in torch.ops.textgen.int8_quantize_rows(x)] == [0, 0]


def many_rows(x: torch.Tensor, ints: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """textgen::int8_rows' product; None on a build without AVX512-BF16, once it has refused the op there."""
    if not torch.ops.textgen.int8_rows_supported():
        with pytest.raises(RuntimeError, match="without AVX512-BF16"):
            torch.ops.textgen.int8_rows(x, ints, scales)
        return None
    return torch.ops.textgen.int8_rows(x, ints, scales)


@pytest.mark.parametrize(("n", "k", "rows"), [(16, 32, 2), (48, 96, 9), (2304, 768, 37), (768, 2048, 130)])
def test_many_rows_are_the_product_each_row_as_alone(n: int, k: int, rows: int) -> None:
    """Blocks of 16 outputs, 8 rows at a time, passes of 128 rows (130: two): each row within the bounds of its
    float sums, and with the bits it has alone. A build without AVX512-BF16 refuses the op."""
    ints, scales = int8_weight(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = many_rows(x, ints, scales)
    if got is None:
        return
    assert_near(got, x, ints, scales)
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(got[i], torch.ops.textgen.int8_rows(x[i : i + 1], ints, scales)[0])


def test_many_rows_turn_every_int8_value_into_its_own_bf16() -> None:
    """Every value from -128 to 127 at every position of a block (16 outputs x 32 values), read out exactly: row r
    of x picks value r of each output (1 there, 0 elsewhere), with scales of 1. A build without AVX512-BF16 refuses
    the op."""
    n, k = 32, 256
    ints = ((torch.arange(n)[:, None] * 37 + torch.arange(k)[None, :]) % 256 - 128).to(torch.int8)
    got = many_rows(torch.eye(k).to(torch.bfloat16), ints, torch.ones(n, dtype=torch.bfloat16))
    if got is not None:
        assert torch.equal(got, ints.t().to(torch.bfloat16))


def test_many_rows_refuse_a_shape_they_do_not_take() -> None:
    ints, scales = int8_weight(16, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.textgen.int8_rows(torch.randn(2, 48).to(torch.bfloat16), ints, scales)
    ints, scales = int8_weight(24, 64)
    with pytest.raises(RuntimeError, match="N of 16"):
        torch.ops.textgen.int8_rows(torch.randn(2, 64).to(torch.bfloat16), ints, scales)


def test_the_band_is_the_first_run_of_counts_won(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the first count won to the last before a loss; through the last measured count: every count beyond."""
    cases = [
        ((False, False, True, True, True, False, True, False), (16, 64)),
        ((True,) * len(BAND_ROWS), (4, EVERY_COUNT)),
        ((False,) * len(BAND_ROWS), None),
    ]
    monkeypatch.setattr(quant_kernels, "kept_measurement", lambda key, field, measure, report: measure())
    for outcomes, want in cases:
        wins = iter(zip(BAND_ROWS, outcomes, strict=True))
        monkeypatch.setattr(quant_kernels, "_wins", lambda *args, wins=wins: wins)
        assert quant_kernels.rows_band("test", torch.nn.Identity(), torch.nn.Identity(), 64, torch.bfloat16) == want


def test_int8_kernel_gives_the_band_s_rows_to_the_many_row_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows within the measured band go to int8_rows, the others as before; a build without the op measures none."""
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    kernel = Int8Kernel(per_channel_weight(), None)
    if not torch.ops.textgen.int8_rows_supported():
        assert kernel.rows_band is None
        return
    kernel.rows_band, kernel.dequantize_from = (4, 16), None  # as if measured
    x = torch.randn(20, 128, dtype=torch.bfloat16)
    for rows in (4, 9, 16):
        assert torch.equal(kernel(x[:rows]), torch.ops.textgen.int8_rows(x[:rows], kernel.ints, kernel.scales))
    for rows in (3, 17):
        assert torch.equal(kernel(x[:rows]), torch._weight_int8pack_mm(x[:rows], kernel.ints, kernel.scales))
