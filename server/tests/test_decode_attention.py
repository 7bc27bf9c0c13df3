"""The bf16 CPU decode attention op: what the masked matmul attention computes, reading only live keys."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from textgen_server.layers.attention_kernels import matmul_attention
from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.layers.decode_attention import decode_attention, first_visible, use_decode_kernel

CPU = torch.device("cpu")
# Skipped only where torch's builder has no compiler to call; with one, the op must build.
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the decode attention op"
)


def cache_case(
    batch: int, heads: int, kv_heads: int, dim: int, capacity: int, offset: int, window: int, lengths: list[int]
) -> tuple[torch.Tensor, ...]:
    """q [B, H, 1, D], whole buffers [B, H_kv, capacity, D] whose columns outside each row's live run
    [offset + window - length, offset + window) hold NaN, and the equivalent window mask [B, 1, 1, window]."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, heads, dim, generator=g).bfloat16().transpose(1, 2)  # as the model makes it
    keys = torch.full((batch, kv_heads, capacity, dim), float("nan"), dtype=torch.bfloat16)
    values = keys.clone()
    mask = torch.zeros(batch, 1, 1, window, dtype=torch.bool)
    for b, n in enumerate(lengths):
        live = slice(offset + window - n, offset + window)
        keys[b, :, live] = torch.randn(kv_heads, n, dim, generator=g).bfloat16()
        values[b, :, live] = torch.randn(kv_heads, n, dim, generator=g).bfloat16()
        mask[b, ..., window - n :] = True
    return q, keys, values, mask


@needs_compiler
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 12, 64), (4, 2, 64), (6, 3, 24), (4, 1, 16)])
def test_op_equals_masked_matmul_attention_without_reading_dead_columns(heads: int, kv_heads: int, dim: int) -> None:
    assert kernel_available()
    # Columns left of the window, left padding and spare columns are NaN: one read of them would show.
    lengths = [37, 37, 30, 21, 9, 2, 1, 16]
    offset, window, capacity = 5, 37, 60
    q, keys, values, mask = cache_case(len(lengths), heads, kv_heads, dim, capacity, offset, window, lengths)
    first = first_visible(mask, len(lengths), CPU)
    assert first is not None and first.tolist() == [window - n for n in lengths]
    got = decode_attention(q, keys, values, first, offset, window, dim**-0.5)

    live = slice(offset, offset + window)
    zeroed = lambda x: torch.nan_to_num(x[:, :, live], nan=0.0)  # noqa: E731  (the matmul reads all of them)
    expected = matmul_attention(q, zeroed(keys), zeroed(values), mask, dim**-0.5)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)  # bf16's tolerance: sums taken in another order
    assert (got == expected).float().mean() > 0.98  # and most values to the bit


@needs_compiler
def test_op_builds_and_serves_bfloat16_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernel_available()
    assert use_decode_kernel(torch.bfloat16, CPU)
    assert not use_decode_kernel(torch.float32, CPU)
    assert not use_decode_kernel(torch.float16, CPU)
    assert not use_decode_kernel(torch.bfloat16, torch.device("cuda"))
    monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", "0")
    assert not use_decode_kernel(torch.bfloat16, CPU)


def test_first_visible_finds_each_rows_run_or_refuses_a_hole() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.bool).view(3, 1, 1, 4)
    first = first_visible(mask, 3, CPU)
    assert first is not None and first.tolist() == [0, 2, 3]
    assert first_visible(None, 2, CPU).tolist() == [0, 0]  # type: ignore[union-attr]
    holed = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool).view(1, 1, 1, 4)
    assert first_visible(holed, 1, CPU) is None


def torch_causal_softmax(scores: torch.Tensor, offset: int, window: int) -> torch.Tensor:
    """What matmul_attention computes between its two matmuls, in torch."""
    seq, total = scores.shape[-2:]
    positions = torch.arange(offset, offset + seq).unsqueeze(1)
    keys = torch.arange(total)
    visible = keys <= positions
    if window > 0:
        visible &= keys > positions - window
    return torch.softmax(scores.float().masked_fill(~visible, float("-inf")), -1).to(torch.bfloat16)


@needs_compiler
@pytest.mark.parametrize(
    ("shape", "window"),
    [
        ((1, 12, 224, 500), 0),  # a prefill chunk over earlier positions
        ((2, 3, 1, 37), 0),  # S = 1
        ((1, 4, 50, 50), 0),  # S = T
        ((1, 4, 5, 9), 0),  # T shorter than a vector
        ((1, 4, 17, 17), 0),
        ((1, 4, 13, 13), 3),  # windows
        ((1, 4, 100, 300), 64),
        ((1, 2, 40, 1000), 17),
        ((1, 1, 1, 1), 0),
    ],
)
def test_causal_softmax_op_equals_torch_bit_for_bit(shape: tuple[int, ...], window: int) -> None:
    assert kernel_available()
    g = torch.Generator().manual_seed(1)
    scores = (torch.randn(*shape, generator=g) * 3).bfloat16()
    offset = shape[-1] - shape[-2]
    out = torch.ops.textgen.causal_softmax_bf16(scores, offset, window)
    expected = torch_causal_softmax(scores, offset, window)
    # torch's own vector exp and summation order: every value equal (allowing one bf16 ulp on 0.1%, in case a
    # torch build takes another exp; none differed with torch 2.13 on AVX-512).
    ulps = (out.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 1e-3


@needs_compiler
@pytest.mark.parametrize("window", [None, 5, 1000])
@pytest.mark.parametrize(("seq", "total"), [(1, 20), (7, 7), (6, 40)])
def test_causal_attention_by_the_op_equals_the_masked_matmul(
    monkeypatch: pytest.MonkeyPatch, window: int | None, seq: int, total: int
) -> None:
    from textgen_server.layers.attention_kernels import causal_attention

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, seq, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, total, 64, generator=g).bfloat16() for _ in range(2))
    fast = causal_attention(q, k, v, 0.125, window, matmul_attention)
    monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", "0")
    slow = causal_attention(q, k, v, 0.125, window, matmul_attention)
    assert torch.equal(fast, slow)
    if window is None:  # mask None: matmul_attention's own causal block, by the op and by torch
        monkeypatch.delenv("TEXTGEN_CPU_DECODE_KERNEL")
        assert torch.equal(matmul_attention(q, k, v, None, 0.125), slow)
