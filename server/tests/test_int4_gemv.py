"""textgen::int4_gemv (layers/int4_ops.cpp): one row of a 4-bit projection on torch's own packed weight
(`_convert_weight_to_int4pack_for_cpu`) and scales, against the float32 product of the row and the dequantized
weight, and Int4Kernel's use of it for one-row calls only while the CPU ops are switched on.

The op reads whichever packed layout torch writes in the process (its CPU capability: AVX-512, AVX2 or none);
test_cpu_targets.py reruns this file with torch held to AVX2, and one test here runs torch without vectors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textgen_server.config import DISABLE_CUSTOM_KERNELS
from textgen_server.layers import cpu_ops, quant_kernels
from textgen_server.layers.quant_kernels import EVERY_COUNT, GEMV_ROWS, Int4Kernel
from textgen_server.layers.quantized_weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not cpu_ops.kernel_available(), reason="no C++ compiler: torch's kernel only")

HERE = Path(__file__).parent


def packed_weight(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(torch's packed weight, scales_offsets bf16 [K/G, N, 2], the weight it stands for in float32 [N, K])."""
    gen = torch.Generator().manual_seed(seed + n * k + group)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=gen) / 50 + 0.001
    offsets = torch.randn(k // group, n, generator=gen) / 100
    scales_offsets = torch.stack([scales, offsets], dim=-1).to(torch.bfloat16).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    s = scales_offsets[..., 0].float().t().repeat_interleave(group, dim=1)
    o = scales_offsets[..., 1].float().t().repeat_interleave(group, dim=1)
    return packed, scales_offsets, (q.float() - 8) * s + o


def assert_near(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """bf16 outputs of sums of x [M, K] times w [N, K]: within a bf16 rounding of each output, float32 noise of the
    sums, and what the integer path's x changes (each value within half a step of x, the step being the largest |x|
    of its 32 values over 127; half a step and a little, for the rounding of x / step) times |w|."""
    want = x.float() @ w.t()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = x.float().abs().view(x.shape[0], -1, 32).amax(dim=2) / 127
    moved = (0.51 * step).repeat_interleave(32, dim=1) @ w.abs().t()
    bound = want.abs() * 2.0**-8 + want.abs().amax(dim=1, keepdim=True) * 1e-5 + moved
    assert bool(((got.float() - want).abs() <= bound).all()), (got.float() - want).abs().max()


SHAPES = [
    (16, 32, 32),  # one 16-output block
    (48, 64, 32),  # a full block and a 16-output tail (a 48-output tail with AVX-512)
    (80, 128, 64),
    (112, 256, 128),
    (96, 512, 256),
    (64, 1024, 32),
    (768, 2048, 128),
    (2304, 768, 64),
    (4096, 768, 128),
]


@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_one_row_is_the_float_product_of_the_dequantized_weight(n: int, k: int, group: int) -> None:
    packed, scales_offsets, w = packed_weight(n, k, group)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    got = torch.ops.textgen.int4_gemv(x, packed, scales_offsets, group)
    assert got.shape == (1, n)
    assert_near(got, x, w)


@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_dequantize_gives_the_weight_the_formula_gives(n: int, k: int, group: int) -> None:
    """In float32, and in bfloat16 as the float32 weight rounds to it."""
    packed, scales_offsets, w = packed_weight(n, k, group)
    assert torch.equal(torch.ops.textgen.int4_dequantize(packed, scales_offsets, group, torch.float32), w)
    got = torch.ops.textgen.int4_dequantize(packed, scales_offsets, group, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.textgen.int4_dequantize(packed, scales_offsets, group, torch.float16)


@pytest.mark.parametrize("rows", [2, 3, 5, 7, 9, 37])
def test_several_rows_give_each_row_s_own_bits(rows: int) -> None:
    """Rows that share each read of the weight (all of a call's on AVX-512 with VNNI, the first four as a block is
    gathered and the others four at a time over its kept quads; four at a time on torch's AVX2 layout; full blocks
    and a short one here; 37 rows are quantized by more than one thread) sum as one row alone does."""
    packed, scales_offsets, w = packed_weight(80, 256, 64)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = torch.ops.textgen.int4_gemv(x, packed, scales_offsets, 64)
    assert_near(got, x, w)
    alone = torch.cat([torch.ops.textgen.int4_gemv(x[i : i + 1], packed, scales_offsets, 64) for i in range(rows)])
    assert torch.equal(got, alone)


def test_a_row_the_integer_path_declines_leaves_its_neighbours_bits() -> None:
    """A NaN in one row sends that row through the op's float path alone: every other row keeps the bits it has
    alone, and the NaN reaches only its own row."""
    packed, scales_offsets, _ = packed_weight(96, 256, 64)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[2, 10] = float("nan")
    got = torch.ops.textgen.int4_gemv(x, packed, scales_offsets, 64)
    assert bool(got[2].isnan().all())
    for i in (0, 1, 3, 4, 5, 6):
        assert torch.equal(got[i : i + 1], torch.ops.textgen.int4_gemv(x[i : i + 1], packed, scales_offsets, 64))


def test_a_zero_group_and_a_non_finite_input_are_computed_as_float_sums_would() -> None:
    """A group of zeros has no step to divide by, and a group of tiny values a step below float32's normal numbers
    (whatever its integers, they count for step times themselves); a NaN or an infinity cannot be quantized and
    must reach the outputs, as it does through float sums (the op then takes the float path for the row)."""
    packed, scales_offsets, w = packed_weight(64, 256, 64)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[0, 64:128] = 0
    assert_near(torch.ops.textgen.int4_gemv(x, packed, scales_offsets, 64), x, w)
    x[0, 64:128] = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 1e-37
    got = torch.ops.textgen.int4_gemv(x, packed, scales_offsets, 64)
    assert got.isfinite().all()
    assert_near(got, x, w)
    x[0, 200] = float("nan")
    assert bool(torch.ops.textgen.int4_gemv(x, packed, scales_offsets, 64).isnan().all())
    x[0, 200] = float("inf")
    assert not bool(torch.ops.textgen.int4_gemv(x, packed, scales_offsets, 64).isfinite().any())


def test_a_weight_that_does_not_match_is_refused() -> None:
    packed, scales_offsets, _ = packed_weight(32, 128, 32)
    x = torch.randn(1, 128).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.textgen.int4_gemv(torch.randn(1, 64).to(torch.bfloat16), packed, scales_offsets, 32)
    with pytest.raises(RuntimeError, match="scales_offsets"):
        torch.ops.textgen.int4_gemv(x, packed, scales_offsets, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.textgen.int4_gemv(x.float(), packed, scales_offsets, 32)


def test_torch_s_layout_without_vectors_is_read_too() -> None:
    """torch without AVX2 packs output pairs into each byte (layout 0, int4_ops.cpp): a process of its own, as
    torch reads ATEN_CPU_CAPABILITY once."""
    script = (
        "import torch, test_int4_gemv as t; from textgen_server.layers import cpu_ops; "
        "assert cpu_ops.kernel_available(); assert torch.ops.textgen.int4_gemv_layout() == 0\n"
        "for shape in [(16, 32, 32), (48, 64, 32), (96, 256, 128)]: t.test_one_row_is_the_float_product_of_the_"
        "dequantized_weight(*shape); t.test_dequantize_gives_the_weight_the_formula_gives(*shape)\n"
        "print('ok')"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", cpu_ops.ENV_SWITCH: "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=HERE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split() == ["ok"], run.stderr[-4000:]


def int4_weight(n: int, k: int, group: int, act_order: bool) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(n + k + group)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantizedWeight(
        torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        torch.randint(0, 16, (n, k // group), generator=gen).to(torch.bfloat16),
        (torch.rand(n, k // group, generator=gen) / 50 + 0.001).to(torch.bfloat16),
        g_idx,
        4,
        group,
    )


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_kernel_serves_one_row_with_the_op_as_torch_s_kernel_does(
    act_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    weight = int4_weight(96, 512, 128, act_order)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    kernel = Int4Kernel(weight, bias)
    assert kernel.gemv
    x = torch.randn(1, 1, 512, generator=gen).to(torch.bfloat16)
    got = kernel(x)
    # torch's kernel on the same row, as a 2-row call computes it where the op takes one row only
    kernel.gemv_until = 1
    torch_s = kernel(torch.cat([x, torch.zeros_like(x)], dim=1))[:, :1]
    assert got.shape == (1, 1, 96) and got.dtype == torch.bfloat16
    # The op's row on an 8-bit grid per 32 values moves an output by up to 1.5% of the largest one (the worst of 400
    # random rows and biases per case; 1% held only for the 16-bit grid it replaced): 3% of it.
    scale = torch_s.float().abs().max()
    assert (got.float() - torch_s.float()).abs().max() <= 0.03 * scale
    want = x.float() @ weight.dequantize().float().t() + bias.float()
    assert (got.float() - want).abs().max() <= 0.03 * want.abs().max()


@pytest.mark.parametrize(("variable", "value"), [(DISABLE_CUSTOM_KERNELS, "True"), (cpu_ops.ENV_SWITCH, "0")])
def test_with_custom_kernels_off_int4_kernel_never_calls_the_op(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = torch.ops.textgen.int4_gemv

    real_dequantize = torch.ops.textgen.int4_dequantize

    class Spy:
        def int4_gemv(self, *args: object) -> torch.Tensor:
            calls.append(1)
            return real(*args)

        def int4_dequantize(self, *args: object) -> torch.Tensor:
            calls.append(2)
            return real_dequantize(*args)

    monkeypatch.setattr(torch.ops, "textgen", Spy())
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    weight = int4_weight(32, 128, 32, False)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    Int4Kernel(weight, None)(x)
    assert 1 in calls  # the spy sees the op when the kernels are on
    calls.clear()
    monkeypatch.setenv(variable, value)
    kernel = Int4Kernel(weight, None)
    assert not kernel.gemv and kernel.dequantize_from is None and kernel.gemv_until == 0
    for rows in (x, torch.randn(600, 128, dtype=torch.bfloat16)):
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, kernel.packed, kernel.group_size, kernel.scales_offsets)
        assert torch.equal(kernel(rows), want)
    assert calls == []


@pytest.mark.parametrize("native_bf16", [False, True], ids=["float32-gemm", "bfloat16-gemm"])
def test_many_rows_run_as_a_gemm_from_the_measured_row_count(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    """Float32 where the CPU has no bf16 multiply; bf16 (the dequantized weight rounded to bf16) where it has."""
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    monkeypatch.setattr(cpu_ops, "x86_bf16_hardware", lambda: native_bf16)
    weight = int4_weight(112, 256, 128, act_order=True)
    kernel = Int4Kernel(weight, None)
    kernel.dequantize_from, kernel.gemv_until = 8, 1  # as if measured (test_quantized.py checks the measurement)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    permuted = x[:, kernel.order].contiguous()  # act order: the kernel's input features, its groups consecutive
    # the product of x and the weight as the kernel holds it (its offsets rounded to bf16), rounded once
    held = torch.ops.textgen.int4_dequantize(kernel.packed, kernel.scales_offsets, kernel.group_size, torch.float32)
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    assert torch.equal(kernel(x), torch.nn.functional.linear(permuted.to(dtype), held.to(dtype)).to(torch.bfloat16))
    want = x.float() @ weight.dequantize().float().t()  # the checkpoint's weight: offsets not rounded
    assert (kernel(x).float() - want).abs().max() <= 0.01 * want.abs().max()
    assert torch.equal(kernel(x[:7]), kernel._int4(permuted[:7]))


def test_a_few_rows_go_to_the_op_row_by_row_up_to_the_measured_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    weight = int4_weight(96, 512, 128, act_order=True)
    kernel = Int4Kernel(weight, None)
    kernel.gemv_until, kernel.dequantize_from = 4, None  # as if measured (test_quantized.py checks the measurement)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    permuted = x[:, kernel.order].contiguous()
    assert torch.equal(
        kernel(x[:4]), torch.ops.textgen.int4_gemv(permuted[:4], kernel.packed, kernel.scales_offsets, 128)
    )
    # a row's outputs are the same whichever rows share its call
    assert torch.equal(kernel(x[:4])[2], kernel(x[2:3])[0])
    assert torch.equal(kernel(x), kernel._int4(permuted))


def test_measured_faster_at_every_count_the_op_serves_any_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Winning at every measured count (up to 2,048 rows) makes the op serve every count, prefills of more rows
    included (its passes of 256 rows: 600 rows here, three of them, each row as alone); a loss keeps the last
    count won."""
    for outcomes, want in (((True,) * len(GEMV_ROWS), EVERY_COUNT), ((True, True, False, True, True), 64)):
        wins = iter(zip(GEMV_ROWS, outcomes, strict=True))
        monkeypatch.setattr(quant_kernels, "_wins", lambda *args, wins=wins: wins)
        monkeypatch.setattr(quant_kernels, "kept_measurement", lambda key, field, measure, report: measure())
        assert quant_kernels.gemv_until("test", torch.nn.Identity(), torch.nn.Identity(), 64, torch.bfloat16) == want
    monkeypatch.undo()
    monkeypatch.delenv(DISABLE_CUSTOM_KERNELS, raising=False)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    kernel = Int4Kernel(int4_weight(64, 256, 128, act_order=False), None)
    kernel.gemv_until = EVERY_COUNT
    monkeypatch.setattr(kernel, "_without_op", lambda rows: pytest.fail("not the op"))
    x = torch.randn(600, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = kernel(x)
    for i in (0, 255, 256, 511, 599):
        assert torch.equal(got[i], kernel(x[i : i + 1])[0])
