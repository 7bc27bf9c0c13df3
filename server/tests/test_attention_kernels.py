"""The matmul attention path (half precision on a CPU) computes what SDPA computes, GQA and masks included."""

from __future__ import annotations

import pytest
import torch

from textgen_server.layers.attention_kernels import attention_for, matmul_attention, sdpa

CPU = torch.device("cpu")


def qkv(batch: int, heads: int, kv_heads: int, seq: int, total: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    # q as the model makes it: [B, S, H, D] seen through a transpose (not contiguous).
    q = torch.randn(batch, seq, heads, 8, generator=g).transpose(1, 2)
    return q, torch.randn(batch, kv_heads, total, 8, generator=g), torch.randn(batch, kv_heads, total, 8, generator=g)


def padded_mask(batch: int, seq: int, total: int) -> torch.Tensor:
    """Causal, row r left-padded by r columns, every query seeing itself (as tp_llama's masks are)."""
    q_pos = torch.arange(total - seq, total)[:, None]
    k_pos = torch.arange(total)[None, :]
    real = torch.arange(total)[None, :] >= torch.arange(batch)[:, None]
    return (((k_pos <= q_pos)[None] & real[:, None, :]) | (k_pos == q_pos)[None])[:, None]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(("seq", "total", "masked"), [(1, 9, True), (1, 9, False), (5, 5, False), (5, 7, True)])
def test_matmul_attention_equals_sdpa(heads: int, kv_heads: int, seq: int, total: int, masked: bool) -> None:
    q, k, v = qkv(3, heads, kv_heads, seq, total)
    mask = padded_mask(3, seq, total) if masked else None
    torch.testing.assert_close(matmul_attention(q, k, v, mask, 0.3), sdpa(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-5)


def test_matmul_attention_takes_a_sliced_mask() -> None:
    # Row groups attend on views of q, K, V and the mask (rows and leading columns cut).
    q, k, v = qkv(4, 4, 2, 3, 8)
    mask = padded_mask(4, 3, 8)
    args = (q[1:3], k[1:3, :, 2:], v[1:3, :, 2:], mask[1:3, :, :, 2:], 0.5)
    torch.testing.assert_close(matmul_attention(*args), sdpa(*args), atol=1e-5, rtol=1e-5)


def test_half_precision_on_a_cpu_takes_the_matmul_path() -> None:
    assert attention_for(torch.bfloat16, CPU) is matmul_attention
    assert attention_for(torch.float16, CPU) is matmul_attention
    assert attention_for(torch.float32, CPU) is sdpa
    assert attention_for(torch.bfloat16, torch.device("cuda")) is sdpa
