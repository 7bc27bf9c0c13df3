"""The shard's Linear on each of its CPU paths: MKL-packed and oneDNN-reordered weights, plain `F.linear`.

Oracles: for float32 the product in float64. Each packed path must be as accurate as `F.linear` for every row
count the shard produces (1-row decode, small and large batches, 3-D prefill input, no rows at all), and must
not depend on the row count the weight was packed for. For bfloat16, `F.linear` itself: the reordered weight
feeds the same oneDNN kernels, so the results must be bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from textgen_server.layers.linear_choice import BUCKET_ROWS, choose_linear_kernels
from textgen_server.layers.tensor_parallel import Linear

# (out, in): the small model's fused q/k/v, o, gate/up, down and head, and the tests' tiny layers.
SHAPES = [(2304, 768), (768, 768), (4096, 768), (768, 2048), (16000, 768), (320, 64), (8, 6)]
ROWS = [0, 1, 2, 3, 7, 8, 63, 64, 65, 300]

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
# The float32 packed paths, each skipped where this torch lacks it.
FP32_PACKED = [pytest.param("mkl", marks=needs_mkl), pytest.param("onednn", marks=needs_onednn)]
needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="no native oneDNN bfloat16 kernels on this CPU / torch build",
)


class Float64Product:
    """The float64 oracle of `x @ weight^T (+ bias)`, its products computed once for any bias: the larger shapes'
    float64 products are most of this file's time."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        x, weight = x.double(), weight.double()
        self.exact = F.linear(x, weight)
        self.magnitude = F.linear(x.abs(), weight.abs())
        self.rows, self.depth = x.shape[0], x.shape[-1]

    def check(self, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        """|out - exact| <= eps * (sqrt(K) * sum|x w| + |exact|): rounding errors that grow like a random walk over
        the K products, plus the output's own rounding. F.linear stays below 0.4 of it on these shapes."""
        exact, magnitude = self.exact, self.magnitude
        if bias is not None:
            exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
        bound = torch.finfo(torch.float32).eps * (math.sqrt(self.depth) * magnitude + exact.abs())
        excess = (out.double() - exact).abs() - bound
        assert excess.max().item() <= 0, f"{self.rows} rows: error above the fp32 bound by {excess.max().item()}"


def assert_fp32_accurate(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> None:
    """`out` is `x @ weight^T + bias` to float32's accuracy (Float64Product.check)."""
    Float64Product(x, weight).check(out, bias)


def packed(weight: torch.Tensor, bias: torch.Tensor | None, path: str) -> Linear:
    """A Linear computing every row count on `path`."""
    layer = Linear(weight, bias)
    layer.use((path,) * len(BUCKET_ROWS))
    return layer


@pytest.mark.parametrize("path", FP32_PACKED)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_is_as_accurate_as_f_linear_at_every_row_count(path: str, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(shape, generator=g), torch.randn(shape[0], generator=g)
    layers = [(b, packed(weight.clone(), b, path)) for b in (None, bias)]
    assert all(layer.weight is None for _, layer in layers)  # the unpacked copy is not kept
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=g)
        oracle = Float64Product(x, weight)
        for b, layer in layers:
            out = layer(x)
            assert out.shape == (rows, shape[0])
            if rows:
                oracle.check(out, b)


def product_packed_for(path: str, weight: torch.Tensor, pack_rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight^T on `path`'s layout built for `pack_rows` rows."""
    if path == "mkl":
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, pack_rows)
        return lambda x: torch.ops.mkl._mkl_linear(x, mkl, weight, None, x.shape[0])
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, pack_rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")


@pytest.mark.parametrize("path", FP32_PACKED)
def test_packed_result_does_not_depend_on_the_row_count_it_was_packed_for(path: str) -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(768, 2048, generator=g)
    layer = packed(weight.clone(), None, path)
    for pack_rows in (2, 16, 1000):
        other = product_packed_for(path, weight, pack_rows)
        for rows in (2, 5, 64, 257):
            x = torch.randn(rows, 2048, generator=g)
            assert torch.equal(layer(x), other(x))


@pytest.mark.parametrize("path", ["linear", *FP32_PACKED])
def test_three_dimensional_input_keeps_its_leading_dims(path: str) -> None:
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3, 5, 24, generator=g)
    layer = packed(weight, bias, path)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))
    torch.testing.assert_close(layer(x.transpose(0, 1)), F.linear(x.transpose(0, 1), weight, bias))


@needs_onednn_bf16
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bfloat16_reordered_weight_gives_f_linears_bits_at_every_row_count(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(shape, generator=g).bfloat16()
    bias = torch.randn(shape[0], generator=g).bfloat16()
    for b in (None, bias):
        layer = packed(weight.clone(), b, "onednn")
        assert layer.weight is None
        for rows in ROWS:
            x = torch.randn(rows, shape[1], generator=g).bfloat16()
            out = layer(x)
            assert out.shape == (rows, shape[0])
            assert torch.equal(out, F.linear(x, weight, b)), f"{rows} rows"
    # A strided 3-D input: the same bits as F.linear on its contiguous copy (F.linear itself takes another
    # path for the strided one, off by a bf16 rounding step).
    x = torch.randn(3, 5, shape[1], generator=g).bfloat16().transpose(0, 1)
    assert torch.equal(layer(x), F.linear(x.contiguous(), weight, bias))


def test_other_dtypes_keep_the_plain_weight_and_f_linear() -> None:
    weight = torch.randn(40, 24, dtype=torch.float16)
    layer = Linear(weight, None)
    choose_linear_kernels([layer])
    assert layer.paths == ("linear",) * len(BUCKET_ROWS) and layer.weight is not None
    x = torch.randn(7, 24, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, weight))
