"""textgen::gemv (layers/linear_ops.cpp) and the `gemv` path of the linear choice (layers/linear_choice.py).

Oracles: for the op, its documented arithmetic written out in torch (each output's products added in order, in
runs of k_chunk values added in order, plus the bias: in float32 one fused multiply-add a value, in bfloat16 a
value pair's odd product then its even one, each sum rounded to float32, the result rounded once to bfloat16;
bfloat16 in the AVX2 build: torch's own one-row dot order, `dot_order`): the same bits on any CPU the op is built
for. For the path in bfloat16, `F.linear` itself: the kernel serves a shape only where its sums give `F.linear`'s
bits, so a served layer must give them; in float32, the product in float64 within float32's tolerance, as for
the other paths (test_linear.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_linear import assert_fp32_accurate

from textgen_common import cache_dir
from textgen_server.layers import cpu_ops
from textgen_server.layers.linear_choice import (
    BUCKET_ROWS,
    ENV,
    GemvKernel,
    available_paths,
    choose,
    choose_linear_kernels,
    time_paths,
)
from textgen_server.layers.tensor_parallel import Linear

CPU = torch.device("cpu")
HAS_BF16_GEMV = "gemv" in available_paths(torch.bfloat16, CPU)
IN_RUNS = HAS_BF16_GEMV and bool(torch.ops.textgen.gemv_sums_in_runs(torch.bfloat16))
needs_gemv = pytest.mark.skipif(not HAS_BF16_GEMV, reason="no bfloat16 gemv in this build of the CPU ops")
needs_runs = pytest.mark.skipif(not IN_RUNS, reason="no AVX512-BF16 build of the CPU ops here")
needs_dot = pytest.mark.skipif(
    not HAS_BF16_GEMV or IN_RUNS, reason="no bfloat16 gemv in torch's AVX2 order (an AVX2 build) here"
)
needs_gemv_fp32 = pytest.mark.skipif(
    "gemv" not in available_paths(torch.float32, CPU), reason="no AVX-512 or AVX2 build of the CPU ops here"
)
LOGGER = "textgen_server.layers.linear_choice"


def written_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_chunk: int) -> torch.Tensor:
    """The op's sums, step by step: in float32 each fused multiply-add as float64 rounded to float32 (the product
    of two floats is exact in float64), in bfloat16 each product exact in float32."""
    fp32 = x.dtype == torch.float32
    xs, ws = (x.double(), weight.double()) if fp32 else (x.float(), weight.float())
    k = x.shape[-1]
    run = k_chunk or k
    total = torch.zeros(x.shape[0], weight.shape[0])
    for start in range(0, k, run):
        acc = torch.zeros_like(total)
        for p in range(start, min(k, start + run), 1 if fp32 else 2):
            if fp32:
                acc = (acc.double() + xs[:, p : p + 1] * ws[:, p]).float()
                continue
            if p + 1 < k:
                acc = acc + xs[:, p + 1 : p + 2] * ws[:, p + 1]
            acc = acc + xs[:, p : p + 1] * ws[:, p]
        total = acc if start == 0 else total + acc
    if bias is not None:
        total = total + bias.float()
    return total.to(x.dtype)


def dot_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch's one-row bf16 product on AVX2, written out in float32 (a product of two bf16 values is exact there,
    so each fused multiply-add is a float32 add): per output, value i of each 64-value step into accumulator
    i // 8, lane i % 8; the 8 accumulators added pairwise (a + a+4, then a + a+2, then 0 + 1), the 8 lanes folded
    the same way; the values after the last whole step 16 at a time into one 8-lane accumulator (value l, then
    8 + l), folded and added; the last K % 16 one at a time; rounded once to bfloat16."""

    def fold(v: torch.Tensor) -> torch.Tensor:  # [..., 8] -> [...]
        v = v[..., :4] + v[..., 4:]
        v = v[..., :2] + v[..., 2:]
        return v[..., 0] + v[..., 1]

    xs, ws = x.float(), weight.float()
    k = x.shape[-1]
    whole, vec = k - k % 64, k - k % 16
    acc = torch.zeros(x.shape[0], weight.shape[0], 8, 8)
    for s in range(0, whole, 64):
        acc = acc + xs[:, None, s : s + 64].view(-1, 1, 8, 8) * ws[None, :, s : s + 64].view(1, -1, 8, 8)
    acc = acc[:, :, :4] + acc[:, :, 4:]
    acc = acc[:, :, :2] + acc[:, :, 2:]
    total = fold(acc[:, :, 0] + acc[:, :, 1])
    tail = torch.zeros(x.shape[0], weight.shape[0], 8)
    for s in range(whole, vec, 8):
        tail = tail + xs[:, None, s : s + 8] * ws[None, :, s : s + 8]
    total = total + fold(tail)
    for s in range(vec, k):
        total = total + xs[:, None, s] * ws[None, :, s]
    return total.to(x.dtype)


# (rows, out_f, in_f, k_chunk, with_bias)
OP_CASES = pytest.mark.parametrize(
    ("rows", "out_f", "in_f", "k_chunk", "with_bias"),
    [
        (1, 64, 96, 0, False),
        (1, 100, 78, 32, True),  # a partial block of outputs, runs of 32 and a shorter one
        (1, 100, 77, 0, True),  # an odd K: the last bf16 pair is half padding
        (3, 130, 256, 64, False),  # rows one after another; two whole tiles of blocks and a partial one
        (2, 96, 40, 0, True),  # with AVX-512 a tile of two blocks after a whole one (with AVX2 a whole tile and four)
        (1, 2304, 768, 512, False),  # the small Llama's q/k/v, in runs of 512
        (7, 120, 77, 0, True),  # bf16: a group of six rows and one; a whole tile whose last block is half outputs
        (13, 64, 1030, 512, False),  # bf16: groups of 6, 6 and 1 rows over runs of 512, 512 and 6 values
        (0, 48, 32, 0, True),
    ],
)


def check_op_sums(dtype: torch.dtype, rows: int, out_f: int, in_f: int, k_chunk: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows + out_f + in_f)
    weight = torch.randn(out_f, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    packed = torch.ops.textgen.gemv_pack(weight)
    out = torch.ops.textgen.gemv(x, packed, None if bias is None else bias.float(), out_f, k_chunk)
    assert out.shape == (rows, out_f) and out.dtype == dtype
    assert torch.equal(out, written_out(x, weight, bias, k_chunk))


# Two tests, not one per dtype parameter: the AVX2 build (test_cpu_targets.py) runs the float32 one alone.
@needs_gemv_fp32
@OP_CASES
def test_the_float32_op_sums_as_documented(rows: int, out_f: int, in_f: int, k_chunk: int, with_bias: bool) -> None:
    check_op_sums(torch.float32, rows, out_f, in_f, k_chunk, with_bias)


@needs_runs
@OP_CASES
def test_the_bfloat16_op_sums_as_documented(rows: int, out_f: int, in_f: int, k_chunk: int, with_bias: bool) -> None:
    check_op_sums(torch.bfloat16, rows, out_f, in_f, k_chunk, with_bias)


@needs_dot
@pytest.mark.parametrize(
    ("rows", "out_f", "in_f"),
    [
        (1, 2304, 768),  # the small Llama's q/k/v: whole 64-value steps
        (1, 100, 64 + 48 + 5),  # a step, three 16-value groups, five values one by one
        (3, 33, 40),  # no whole step; rows one after another
        (5, 131, 192 + 16 + 3),  # rows over four interleaved quarters of each block, and the outputs left over
        (1, 70, 13),
        (0, 48, 64),
    ],
)
def test_the_avx2_bfloat16_op_sums_in_torch_s_order(rows: int, out_f: int, in_f: int) -> None:
    g = torch.Generator().manual_seed(rows + out_f + in_f)
    weight = torch.randn(out_f, in_f, generator=g).to(torch.bfloat16)
    x = (3 * torch.randn(rows, in_f, generator=g)).to(torch.bfloat16)
    packed = torch.ops.textgen.gemv_pack(weight)
    out = torch.ops.textgen.gemv(x, packed, None, out_f, 0)
    assert out.shape == (rows, out_f) and out.dtype == torch.bfloat16
    assert torch.equal(out, dot_order(x, weight))
    if "avx512f" not in cpu_ops.cpu_flags():
        # The order written out is F.linear's own on an AVX2 CPU: a second oracle for the same bits. (An AVX-512
        # CPU running the AVX2 build, test_cpu_targets.py, multiplies bf16 through oneDNN instead.)
        assert all(torch.equal(out[r : r + 1], F.linear(x[r : r + 1], weight)) for r in range(rows))


@needs_dot
def test_the_avx2_bfloat16_op_refuses_runs_a_bias_and_bad_inputs() -> None:
    weight = torch.randn(32, 16).bfloat16()
    packed = torch.ops.textgen.gemv_pack(weight)
    x = torch.randn(2, 1, 16).bfloat16()
    assert torch.equal(torch.ops.textgen.gemv(x, packed, None, 32, 0)[1, 0], dot_order(x[1], weight)[0])
    with pytest.raises(RuntimeError, match="k_chunk must be 0"):
        torch.ops.textgen.gemv(x, packed, None, 32, 8)
    with pytest.raises(RuntimeError, match="takes no bias"):
        torch.ops.textgen.gemv(x, packed, torch.zeros(32), 32, 0)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        torch.ops.textgen.gemv(torch.randn(1, 20).bfloat16(), packed, None, 32, 0)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        torch.ops.textgen.gemv(x, packed, None, 64, 0)
    with pytest.raises(RuntimeError, match="packed by gemv_pack"):
        torch.ops.textgen.gemv(x, packed.t(), None, 32, 0)


@needs_dot
def test_a_bfloat16_layer_with_a_bias_is_never_served_on_avx2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # F.linear with a bias takes another path than torch's dot there: no order of this op can be checked against it.
    monkeypatch.setenv(cache_dir.ENV, str(tmp_path))
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert not GemvKernel(weight, torch.zeros(64).bfloat16()).serves(0)
    assert GemvKernel(weight, None).serves(0)


@needs_runs
def test_the_op_keeps_leading_dimensions_and_refuses_bad_inputs() -> None:
    weight = torch.randn(32, 16).bfloat16()
    packed = torch.ops.textgen.gemv_pack(weight)
    x = torch.randn(2, 1, 16).bfloat16()
    assert torch.equal(torch.ops.textgen.gemv(x, packed, None, 32, 0)[1, 0], written_out(x[1], weight, None, 0)[0])
    with pytest.raises(RuntimeError, match="of one dtype, float32 or bfloat16"):
        torch.ops.textgen.gemv(x.float(), packed, None, 32, 0)
    with pytest.raises(RuntimeError, match="of one dtype, float32 or bfloat16"):
        torch.ops.textgen.gemv(x.half(), torch.ops.textgen.gemv_pack(weight.float()).half(), None, 32, 0)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        torch.ops.textgen.gemv(torch.randn(1, 20).bfloat16(), packed, None, 32, 0)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        torch.ops.textgen.gemv(x, packed, None, 64, 0)
    with pytest.raises(RuntimeError, match="k_chunk must be a multiple of 2"):
        torch.ops.textgen.gemv(x, packed, None, 32, 3)
    with pytest.raises(RuntimeError, match="packed by gemv_pack"):
        torch.ops.textgen.gemv(x, weight, None, 32, 0)
    with pytest.raises(RuntimeError, match="float32 bias of 32 values"):
        torch.ops.textgen.gemv(x, packed, torch.zeros(3), 32, 0)
    with pytest.raises(RuntimeError, match="float32 bias of 32 values"):
        torch.ops.textgen.gemv(x, packed, torch.zeros(32).bfloat16(), 32, 0)
    with pytest.raises(RuntimeError, match="a 2-D float32 or bfloat16 weight"):
        torch.ops.textgen.gemv_pack(weight.half())


@needs_gemv_fp32
@pytest.mark.parametrize(
    "shape", [(2304, 768), (768, 768), (768, 2048), (16000, 768), (320, 64), (8, 6)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_float32_is_within_float32_s_tolerance(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    weight, bias = torch.randn(shape, generator=g), torch.randn(shape[0], generator=g)
    kernel = GemvKernel(weight, bias)
    # 1-64 rows, prefills left to the libraries.
    assert [kernel.serves(b) for b in range(len(BUCKET_ROWS))] == [True, True, True, False]
    for rows in (1, 1, 1, 1, 3, 8, 13, 64):
        x = torch.randn(rows, shape[1], generator=g)
        assert_fp32_accurate(kernel(x), x, weight, bias)
    assert kernel(torch.randn(0, shape[1])).shape == (0, shape[0])


# Rows per bucket (1, 2-8, 9-64, >64): a count at each bucket's ends and between.
ROWS_IN_BUCKET = ((1,), (2, 5, 8), (9, 40), (65, 130))


def assert_expected_buckets(served: list[int]) -> None:
    """The buckets a bf16 layer's `gemv` serves here: where it sums in runs, one row and those of 2-64 rows where
    every row count gave F.linear's bits (which depends on the CPU's oneDNN), never prefills; every bucket for the
    AVX2 order on an AVX2 CPU, whose `F.linear` is torch's dot product at every row count."""
    if IN_RUNS:
        assert 0 in served and len(BUCKET_ROWS) - 1 not in served
    elif "avx512f" not in cpu_ops.cpu_flags():
        assert served == list(range(len(BUCKET_ROWS)))


@needs_gemv
@pytest.mark.parametrize("shape", [(2304, 768), (768, 2048), (16000, 768), (320, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_served_shape_gives_f_linear_s_bits(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(shape, generator=g).bfloat16()
    kernel = GemvKernel(weight, None)
    served = [b for b in range(len(BUCKET_ROWS)) if kernel.serves(b)]
    if not served:
        pytest.skip(f"F.linear sums {shape} in another order on this CPU: the kernel stays unused")
    assert_expected_buckets(served)
    for bucket in served:
        for rows in ROWS_IN_BUCKET[bucket]:
            for _ in range(64 // rows or 1):
                x = torch.randn(rows, shape[1], generator=g).bfloat16()
                assert torch.equal(kernel(x), F.linear(x, weight))


@needs_runs
def test_a_shape_no_run_length_reproduces_is_never_chosen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Runs of 2 values sum in an order no oneDNN kernel uses: no length found, as on a CPU whose oneDNN differs.
    # Measured into a folder of its own: a run length another test found for this shape would be read back.
    monkeypatch.setattr(GemvKernel, "CHUNKS", (2,))
    monkeypatch.setenv(cache_dir.ENV, str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    weight = torch.randn(256, 192, generator=torch.Generator().manual_seed(5)).bfloat16()
    kernel = GemvKernel(weight, None)
    assert kernel.k_chunks[0] is None and not kernel.serves(0)
    with pytest.raises(RuntimeError, match="no run length"):
        kernel(torch.randn(1, 192).bfloat16())
    times = time_paths(weight, None, available_paths(torch.bfloat16, CPU))
    assert times["gemv"] == [float("inf")] * len(BUCKET_ROWS)
    assert "gemv" not in choose(times)
    layer = Linear(weight.clone(), None)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        choose_linear_kernels([layer])
    assert "gemv" not in layer.paths
    monkeypatch.setenv(ENV, "gemv")
    layer = Linear(weight.clone(), None)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        choose_linear_kernels([layer])
    assert layer.paths == ("linear",) * len(BUCKET_ROWS)
    assert f"{ENV}=gemv: linear where gemv does not serve" in caplog.records[-1].getMessage()


@needs_runs
def test_each_bucket_takes_the_run_length_that_gives_f_linear_s_bits_at_all_its_row_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN's run length moves with the row count. A stand-in for the comparison with F.linear: runs of 512 give
    # its bits at 1-5 rows, runs of 1024 at 3 rows and more. Checked into a folder of its own (no earlier finding).
    monkeypatch.setenv(cache_dir.ENV, str(tmp_path))
    checked: list[tuple[int, int]] = []

    def same_bits(self: GemvKernel, weight: torch.Tensor, bias: object, chunk: int, rows: int, outputs: int) -> bool:
        checked.append((chunk, rows))
        return (chunk == 512 and rows <= 5) or (chunk == 1024 and rows >= 3)

    monkeypatch.setattr(GemvKernel, "_same_bits", same_bits)
    weight = torch.randn(64, 2048, generator=torch.Generator().manual_seed(8)).bfloat16()
    kernel = GemvKernel(weight, None)
    # 2-8 rows: no one length gives the bits at every count; 9-64: 1024; past 64 rows: never checked nor served.
    assert kernel.k_chunks == (512, None, 1024, None)
    assert [kernel.serves(b) for b in range(len(BUCKET_ROWS))] == [True, False, True, False]
    assert max(rows for _, rows in checked) == 64 and (1024, 64) in checked
    assert {rows for chunk, rows in checked if chunk == 1024} >= set(range(9, 65))
    direct_ints = [None if (d := kernel.direct(b)) is None else d.ints for b in range(len(BUCKET_ROWS))]
    assert direct_ints == [(64, 512), (64, 512), (64, 1024), (64, 512)]
    # Found once: another kernel of the shape reads the finding (kept for the next starts), the check not run again.
    checked.clear()
    assert GemvKernel(weight, None).k_chunks == kernel.k_chunks and not checked
    x = torch.randn(40, 2048).bfloat16()
    assert torch.equal(kernel(x), written_out(x, weight, None, 1024))


@needs_gemv
def test_forcing_gemv_serves_its_buckets_and_f_linear_the_rest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV, "gemv")
    g = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(2304, 768, generator=g).bfloat16(), torch.randn(2304, generator=g).bfloat16()
    # The AVX2 order takes no bias (test_a_bfloat16_layer_with_a_bias_is_never_served_on_avx2).
    bias = bias if IN_RUNS else None
    layer = Linear(weight.clone(), None if bias is None else bias.clone())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        choose_linear_kernels([layer])
    if layer.paths[0] != "gemv":
        pytest.skip("F.linear sums this shape in another order on this CPU")
    kernel = GemvKernel(weight, bias)
    served = [b for b in range(len(BUCKET_ROWS)) if kernel.serves(b)]
    assert_expected_buckets(served)
    assert layer.paths == tuple("gemv" if b in served else "linear" for b in range(len(BUCKET_ROWS)))
    for rows in (1, 4, 40, 70):
        x = torch.randn(rows, 768, generator=g).bfloat16()
        assert torch.equal(layer(x), F.linear(x, weight, bias))


def test_gemv_is_offered_where_the_ops_have_its_instructions() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        expected = cpu_ops.ops_for(dtype, CPU) and bool(torch.ops.textgen.gemv_supported(dtype))
        assert ("gemv" in available_paths(dtype, CPU)) == expected
    assert "gemv" not in available_paths(torch.float16, CPU)
