"""Scaled dot-product attention, with a plain-matmul path for half-precision weights on a CPU.

torch's CPU `scaled_dot_product_attention` is fast in float32, but in bfloat16 it ran a batch-64 decode step
about twice as slow as in float32 (benchmark/README.md), while two bf16 matmuls with an fp32
softmax between them beat the float32 SDPA, provided their operands are whole KV buffers rather than strided
windows of them (`PaddedKVCache.whole`; `python benchmark/attention.py` measures all four). That is the
computation transformers' own "eager" attention does, so it also rounds the way the reference model does.
bf16 decode steps of the padded cache go to the op of decode_attention.py instead, which reads only live keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

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
    scores = torch.matmul(queries, k.transpose(-1, -2)).float()
    if mask is None and seq > 1:
        mask = torch.ones(1, 1, seq, total, dtype=torch.bool, device=q.device).tril(total - seq)
    if mask is not None:
        # [B, 1, S, T] against the scores seen as [B, H_kv, G, S, T]
        scores.view(batch, kv_heads, group, seq, total).masked_fill_(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(batch, heads, seq, dim)


def uses_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Half precision on a CPU: attention by two matmuls (and decode over whole KV buffers, see kv_cache.py)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def attention_for(dtype: torch.dtype, device: torch.device) -> AttentionFn:
    """The faster kernel for a model of `dtype` on `device` (SDPA everywhere but half precision on a CPU)."""
    return matmul_attention if uses_matmul(dtype, device) else sdpa
