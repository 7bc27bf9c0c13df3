"""Scaled dot-product attention, with a plain-matmul path for half-precision weights on a CPU.

torch's CPU `scaled_dot_product_attention` is fast in float32, but in bfloat16 it ran a batch-64 decode step
about twice as slow as in float32 (benchmark/README.md), while two bf16 matmuls with an fp32
softmax between them beat the float32 SDPA, provided their operands are whole KV buffers rather than strided
windows of them (`PaddedKVCache.whole`; `python benchmark/attention.py` measures all four). That is the
computation transformers' own "eager" attention does, so it also rounds the way the reference model does.
bf16 decode steps of the padded cache go to the op of decode_attention.py instead, which reads only live keys.

In bfloat16, causal blocks (a prefill, a prefill chunk: `mask` None, or `causal_attention` with a window) take
their masked float32 softmax from `textgen::causal_softmax_bf16` (decode_attention.cpp) where it builds: one
pass over the bf16 scores instead of four elementwise passes over a float32 copy, bit for bit torch's result.
On a CPU whose bf16 matmuls are torch's own loops (AVX2 without AVX-512), their two products come from
`textgen::causal_scores_bf16` and `textgen::causal_values_bf16` (attention_products.cpp): torch's sums in torch's
order, over only the keys each query sees (`torch_order_products`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from textgen_server.layers import cpu_ops
from textgen_server.layers.decode_attention import use_decode_kernel

# (q [B, H, S, D], k / v [B, H_kv, T, D], bool mask [B, 1, S, T] or None for causal / none, scale) -> [B, H, S, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """torch's fused kernel; without a mask a multi-token query is causal."""
    causal = mask is None and q.shape[2] > 1
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )


def matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v: both products in q's dtype, the softmax in float32.

    Grouped-query heads are folded into the query rows ([B, H_kv, G * S, D]) instead of repeating K and V,
    so every cached byte is read once per step.
    """
    batch, heads, seq, dim = q.shape
    kv_heads, total = k.shape[1], k.shape[2]
    group = heads // kv_heads
    queries = (q * scale).reshape(batch, kv_heads, group * seq, dim)
    if mask is None and seq > 1 and use_decode_kernel(q.dtype, q.device):
        return _causal_op(queries, k, v, 0, heads, seq)
    scores = torch.matmul(queries, k.transpose(-1, -2)).float()
    if mask is None and seq > 1:
        mask = torch.ones(1, 1, seq, total, dtype=torch.bool, device=q.device).tril(total - seq)
    if mask is not None:
        # [B, 1, S, T] against the scores seen as [B, H_kv, G, S, T]
        scores.view(batch, kv_heads, group, seq, total).masked_fill_(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(batch, heads, seq, dim)


def _causal_op(
    queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, heads: int, seq: int
) -> torch.Tensor:
    """matmul_attention's bottom-right causal block with the softmax by the op: queries [B, H_kv, G * S, D]
    (scaled), k / v [B, H_kv, T, D]; query s sees keys (T - S + s - window, T - S + s] (window 0: all up to it)."""
    batch, kv_heads, rows, dim = queries.shape
    total = k.shape[2]
    if torch_order_products():
        flat = batch * kv_heads
        out = _torch_order_block(
            queries.reshape(flat, rows, dim),
            k.reshape(flat, total, dim),
            v.reshape(flat, total, dim),
            None,
            seq,
            window,
        )
        return out.view(batch, heads, seq, dim)
    scores = torch.matmul(queries, k.transpose(-1, -2)).view(batch, kv_heads, rows // seq, seq, total)
    probs = torch.ops.textgen.causal_softmax_bf16(scores.contiguous(), total - seq, window)
    return torch.matmul(probs.view(batch, kv_heads, rows, total), v).view(batch, heads, seq, dim)


def _torch_order_block(
    queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None, seq: int, window: int
) -> torch.Tensor:
    """The causal block by the ops of attention_products.cpp: queries [N, R, D] (scaled, R = G * seq), k / v
    [N, T, D], or [N, S, D] read at `slots` (int64 [T]); returns [N, R, D]."""
    flat, rows, _ = queries.shape
    total = k.shape[1] if slots is None else slots.shape[0]
    scores = torch.ops.textgen.causal_scores_bf16(queries, k, seq, window, slots)
    probs = torch.ops.textgen.causal_softmax_bf16(scores.view(1, flat, rows // seq, seq, total), total - seq, window)
    return torch.ops.textgen.causal_values_bf16(probs.view(flat, rows, total), v, seq, window, slots)


def reads_pool(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a paged prefill's attention reads its keys in the pool (`pool_causal_attention`): bfloat16 by the
    ops of attention_products.cpp."""
    return use_decode_kernel(dtype, device) and torch_order_products()  # the first: bfloat16 on a CPU with the ops


def pool_causal_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """`causal_attention` of one row's n queries q [n, H, D] over its keys at pool `slots` (int64 [T], the row's
    positions in order; k_pool / v_pool [S, H_kv, D]) where `reads_pool` says: the same bits as gathering the keys
    first and calling `causal_attention` with `matmul_attention`. Returns [n, H, D]."""
    seq, heads, dim = q.shape
    kv_heads, total = k_pool.shape[1], slots.shape[0]
    queries = (q.transpose(0, 1) * scale).reshape(kv_heads, heads // kv_heads * seq, dim)
    narrowed = window if window is not None and window < total else 0
    out = _torch_order_block(queries, k_pool.transpose(0, 1), v_pool.transpose(0, 1), slots, seq, narrowed)
    return out.view(heads, seq, dim).transpose(0, 1)


@functools.cache
def torch_order_products() -> bool:
    """Whether the causal block's two products come from the ops of attention_products.cpp: built (AVX2 without
    AVX-512), and giving `torch.matmul`'s bits on this CPU, checked once on random operands (a library built for
    AVX2 on an AVX-512 CPU, where torch multiplies bf16 through oneDNN, would not)."""
    if not (cpu_ops.kernel_available() and torch.ops.textgen.torch_order_products()):
        return False
    g = torch.Generator().manual_seed(0)
    # 8 heads of 128 queries over 256 keys: about 200,000 seen scores and 65,000 outputs, enough for another
    # order to show differing ones (a few per 10,000 outputs differ between the orders measured).
    q, k, v = (torch.randn(8, rows, 64, generator=g).bfloat16() for rows in (128, 256, 256))
    seen = torch.ones(128, 256, dtype=torch.bool).tril(128)
    with torch.inference_mode():
        scores = torch.ops.textgen.causal_scores_bf16(q, k, 128, 0)
        if not torch.equal(scores[:, seen], torch.matmul(q, k.transpose(-1, -2))[:, seen]):
            return False
        # Signed weights (0 where unseen, as the op requires) cancel in the sums: another order shows more often.
        weights = (torch.randn(8, 128, 256, generator=g) * seen).bfloat16()
        return torch.equal(torch.ops.textgen.causal_values_bf16(weights, v, 128, 0), torch.matmul(weights, v))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None, attend: AttentionFn
) -> torch.Tensor:
    """Bottom-right causal attention of q [B, H, S, D] over k / v [B, H_kv, T, D] (query s at position T - S + s)
    within `window` keys (None: all up to it): by the op's softmax for bf16 matmul attention, else `attend` under
    an explicit mask (SDPA's own causal mask is top-left aligned)."""
    batch, heads, seq, dim = q.shape
    total = k.shape[2]
    windowed = window is not None and window < total
    if attend is matmul_attention and use_decode_kernel(q.dtype, q.device):
        queries = (q * scale).reshape(batch, k.shape[1], -1, dim)
        return _causal_op(queries, k, v, window if window is not None and windowed else 0, heads, seq)
    mask = None
    if seq != total or windowed:
        positions = torch.arange(total - seq, total, device=q.device).unsqueeze(1)
        keys = torch.arange(total, device=q.device)
        visible = keys <= positions
        if window is not None:
            visible &= keys > positions - window
        mask = visible.view(1, 1, seq, total)
    return attend(q, k, v, mask, scale)


def uses_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Half precision on a CPU: attention by two matmuls (and decode over whole KV buffers, see kv_cache.py)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def attention_for(dtype: torch.dtype, device: torch.device) -> AttentionFn:
    """The faster kernel for a model of `dtype` on `device` (SDPA everywhere but half precision on a CPU)."""
    return matmul_attention if uses_matmul(dtype, device) else sdpa
