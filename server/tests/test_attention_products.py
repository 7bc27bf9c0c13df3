"""textgen::causal_scores_bf16 and textgen::causal_values_bf16 (layers/attention_products.cpp), and their use in a
causal block's bf16 attention (layers/attention_kernels.py).

Oracles: the documented sums written out in torch (scores: torch's bf16 dot order, `dot_order` of test_gemv.py;
values: four float32 partial sums by key index, added in order), the same bits on any CPU the ops are built for;
and on an AVX2 CPU `torch.matmul` itself, whose bf16 products there are exactly those sums.
"""

from __future__ import annotations

import pytest
import torch
from test_gemv import dot_order

from textgen_server.layers import attention_kernels, cpu_ops

BUILT = cpu_ops.kernel_available() and bool(torch.ops.textgen.torch_order_products())
needs_ops = pytest.mark.skipif(not BUILT, reason="no AVX2 build (without AVX-512) of the CPU ops here")
# torch multiplies bf16 with its own loops only without AVX-512 (with it, through oneDNN: another order).
TORCH_ORDER_HERE = "avx512f" not in cpu_ops.cpu_flags()


def seen(rows: int, seq: int, total: int, window: int) -> torch.Tensor:
    """[rows, total]: the keys each row's query sees (row r is query r % seq, at position total - seq + r % seq)."""
    hi = (total - seq + torch.arange(rows) % seq).unsqueeze(1)
    keys = torch.arange(total).unsqueeze(0)
    return (keys <= hi) & (keys > hi - window) if window else keys <= hi


def values_order(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs @ v as the op documents it: per output, key t's product into partial sum t % 4 (the keys after the
    last whole four into sum 0), each product exact in float32, the sums added ((0 + 1) + 2) + 3."""
    total = probs.shape[-1]
    whole = total - total % 4
    parts = [torch.zeros(*probs.shape[:-1], v.shape[-1]) for _ in range(4)]
    for t in range(total):
        part = t % 4 if t < whole else 0
        parts[part] = parts[part] + probs[..., t : t + 1].float() * v[:, t : t + 1, :].float()
    return (((parts[0] + parts[1]) + parts[2]) + parts[3]).bfloat16()


# (heads, group, seq, total, dim, window)
CASES = pytest.mark.parametrize(
    ("heads", "group", "seq", "total", "dim", "window"),
    [
        (3, 1, 40, 40, 64, 0),  # a whole prompt
        (2, 2, 24, 61, 64, 0),  # a chunk after 37 cached tokens, two query heads a KV head, keys not in fours
        (2, 1, 30, 30, 64, 8),  # a sliding window
        (1, 1, 17, 23, 80, 0),  # a head size with a 16-value tail (scores) and no 16-column tail (values)
        (1, 1, 9, 12, 72, 0),  # 8 trailing values: dot's scalar tail, values' last columns one by one
        (2, 1, 1, 5, 64, 0),  # one query
        (2, 1, 20, 45, 128, 0),  # a head of two 64-value steps: key-major scores with the step count run-time
        (8, 1, 128, 256, 64, 0),  # 65,536 outputs: enough for another order of the scores' sums to show
    ],
)


@needs_ops
@CASES
def test_the_ops_sum_as_documented(heads: int, group: int, seq: int, total: int, dim: int, window: int) -> None:
    g = torch.Generator().manual_seed(seq + total + dim)
    rows = group * seq
    q = torch.randn(heads, rows, dim, generator=g).bfloat16()
    k, v = (torch.randn(heads, total, dim, generator=g).bfloat16() for _ in range(2))
    visible = seen(rows, seq, total, window)
    scores = torch.ops.textgen.causal_scores_bf16(q, k, seq, window)
    assert scores.shape == (heads, rows, total) and scores.dtype == torch.bfloat16
    assert not scores[:, ~visible].any()  # unseen: 0
    want = torch.stack([dot_order(q[h], k[h]) for h in range(heads)])
    assert torch.equal(scores[:, visible], want[:, visible])
    # Any weights the op may skip as 0 where unseen, not only a softmax's: signed ones cancel in the sums, so
    # that another order shows in many more bf16 outputs.
    probs = (torch.randn(heads, rows, total, generator=g) * visible).bfloat16()
    out = torch.ops.textgen.causal_values_bf16(probs, v, seq, window)
    assert out.shape == (heads, rows, dim) and torch.equal(out, values_order(probs, v))
    if TORCH_ORDER_HERE:  # the orders written out are torch.matmul's own on this CPU
        assert torch.equal(scores[:, visible], torch.matmul(q, k.transpose(-1, -2))[:, visible])
        assert torch.equal(out, torch.matmul(probs, v))


@needs_ops
@pytest.mark.parametrize(("heads", "seq", "total", "dim", "window"), [(2, 24, 61, 64, 0), (3, 9, 40, 80, 5)])
def test_the_ops_read_keys_in_a_pool_through_slots(heads: int, seq: int, total: int, dim: int, window: int) -> None:
    """The ops over a pool [S, N, D] at `slots` give the bits they give over the same keys gathered [N, T, D]; the
    pool's other slots are NaN, so that one stray read shows."""
    g = torch.Generator().manual_seed(total)
    pool_k, pool_v = (torch.full((3 * total, heads, dim), float("nan")).bfloat16() for _ in range(2))
    slots = torch.randperm(3 * total, generator=g)[:total]
    k, v = (torch.randn(total, heads, dim, generator=g).bfloat16() for _ in range(2))
    pool_k[slots], pool_v[slots] = k, v
    q = torch.randn(heads, seq, dim, generator=g).bfloat16()
    scores = torch.ops.textgen.causal_scores_bf16(q, pool_k.transpose(0, 1), seq, window, slots)
    assert torch.equal(scores, torch.ops.textgen.causal_scores_bf16(q, k.transpose(0, 1).contiguous(), seq, window))
    probs = (torch.rand(heads, seq, total, generator=g) * seen(seq, seq, total, window)).bfloat16()
    out = torch.ops.textgen.causal_values_bf16(probs, pool_v.transpose(0, 1), seq, window, slots)
    assert torch.equal(out, torch.ops.textgen.causal_values_bf16(probs, v.transpose(0, 1).contiguous(), seq, window))
    with pytest.raises(RuntimeError, match="a slot out of range"):
        torch.ops.textgen.causal_scores_bf16(q, pool_k.transpose(0, 1), seq, window, slots + 3 * total)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        torch.ops.textgen.causal_values_bf16(probs, pool_v.transpose(0, 1), seq, window, slots.int())


@needs_ops
@pytest.mark.parametrize("dim", [64, 80])
def test_a_nan_key_gives_nan_scores_as_torch_does(dim: int) -> None:
    g = torch.Generator().manual_seed(dim)
    q, k = torch.randn(2, 12, dim, generator=g).bfloat16(), torch.randn(2, 20, dim, generator=g).bfloat16()
    k[1, 11, 5] = float("nan")
    scores = torch.ops.textgen.causal_scores_bf16(q, k, 12, 0)
    visible = seen(12, 12, 20, 0)
    assert scores[1, visible[:, 11], 11].isnan().all() and not scores[0].isnan().any()
    assert not scores[1, :, torch.arange(20) != 11].isnan().any()


@needs_ops
@pytest.mark.parametrize("where", ["query", "key"])
def test_scores_past_float32_s_range_keep_torch_s_bits(where: str) -> None:
    """A 64-value head's scores add each pair of products in one fused multiply-add, exact only while products are
    normal float32 numbers. Here one product is 2^128, past the largest: torch's rounds it to infinity before adding
    -2^127, a fused multiply-add would give 2^127. A tile with such a value, or a task with such a query, sums
    as torch does; so do values below 2^-63, whose products may be subnormal."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 16, 64, generator=g).bfloat16(), torch.randn(2, 40, 64, generator=g).bfloat16()
    q[1, 14, 0], q[1, 14, 32], k[1, 30, 0], k[1, 30, 32] = -(2.0**64), 2.0**64, 2.0**63, 2.0**64
    if where == "query":  # head 0's queries and keys below 2^-63: their products subnormal, near 2^-140
        q[0], k[0] = q[0] * 2.0**-70, k[0] * 2.0**-70
    else:  # a tile of head 0's keys below 2^-63
        k[0, :8] = k[0, :8] * 2.0**-70
    scores = torch.ops.textgen.causal_scores_bf16(q, k, 16, 0)
    visible = seen(16, 16, 40, 0)
    want = torch.stack([dot_order(q[h], k[h]) for h in range(2)])
    assert want[1, 14, 30] == float("inf") and visible[14, 30]
    assert torch.equal(scores[:, visible], want[:, visible])


@needs_ops
def test_the_ops_refuse_what_they_cannot_compute() -> None:
    q, k = torch.randn(2, 8, 64).bfloat16(), torch.randn(2, 10, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bf16 operands"):
        torch.ops.textgen.causal_scores_bf16(q.float(), k.float(), 8, 0)
    with pytest.raises(RuntimeError, match="bf16 operands"):
        torch.ops.textgen.causal_scores_bf16(q, k[:1], 8, 0)
    with pytest.raises(RuntimeError, match="whole groups of seq queries"):
        torch.ops.textgen.causal_scores_bf16(q, k, 3, 0)
    with pytest.raises(RuntimeError, match="one head size"):
        torch.ops.textgen.causal_scores_bf16(q, k[..., :32], 8, 0)
    with pytest.raises(RuntimeError, match="fewer keys than queries"):
        torch.ops.textgen.causal_scores_bf16(q, k[:, :4], 8, 0)
    with pytest.raises(RuntimeError, match="one probability a key"):
        torch.ops.textgen.causal_values_bf16(torch.zeros(2, 8, 9).bfloat16(), k, 8, 0)


@needs_ops
def test_a_causal_block_takes_the_ops_where_they_give_torch_s_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert attention_kernels.torch_order_products() == TORCH_ORDER_HERE
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 12, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 20, 64, generator=g).bfloat16() for _ in range(2))
    through_ops = attention_kernels.causal_attention(q, k, v, 0.125, None, attention_kernels.matmul_attention)
    # The same block by torch's matmuls (the path where the ops are not built, or not torch's order).
    monkeypatch.setattr(attention_kernels, "torch_order_products", lambda: False)
    through_torch = attention_kernels.causal_attention(q, k, v, 0.125, None, attention_kernels.matmul_attention)
    if TORCH_ORDER_HERE:
        assert torch.equal(through_ops, through_torch)
