"""bfloat16 decode attention on a CPU that reads only each row's live keys: a small C++ op built at first use.

A batch-64 W1 decode step spent most of its time in the two bf16 matmuls of `matmul_attention`, reading whole
KV buffers: left padding, spare columns and all (`PaddedKVCache.whole`), well below the memory bandwidth.
`textgen::decode_attention` (decode_attention.cpp) reads, per row and KV head, the contiguous run of columns the
row attends to, once for all the query heads of its group, which cuts the attention's and the decode step's time
(figures and commands: benchmark/README.md, "Figures behind the shard's code"). It rounds where the matmul
attention rounds, so its output differs from it only where float32 sums taken in another order round to another
bfloat16 (a few values, by one unit in the last place).

decode_attention.cpp also holds `textgen::paged_decode_attention`, the decode op of the paged KV pool
(paged_attention.py), which shares its helpers.

The op is built with the others of layers/cpu_ops.py (once per machine). Where it cannot be built, or with
TEXTGEN_CPU_DECODE_KERNEL=0, the model keeps the matmul attention over whole buffers (the paged pool: its torch
path).
"""

from __future__ import annotations

import torch

from textgen_server.layers.cpu_ops import ops_for


def use_decode_kernel(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of `dtype` on `device` decodes with the op (bf16 on a CPU, unless switched off)."""
    return dtype == torch.bfloat16 and ops_for(dtype, device)


def first_visible(mask: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor | None:
    """Per row of a decode step's bool mask [B, 1, 1, T], the first column it attends to (int64 [B]); None when
    some row's visible columns are not one run ending at the last column (the op covers only such runs).
    A None mask (everything visible) gives zeros."""
    if mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    rows = mask.reshape(mask.shape[0], -1)
    first = rows.shape[1] - rows.sum(1)
    # argmax finds each row's first visible column; it is `first` exactly when the run has no hole.
    if not bool(rows.to(torch.uint8).argmax(1).eq(first).all()):
        return None
    return first


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: torch.Tensor,
    offset: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one query per row, q [B, H, 1, D], over whole cache buffers [B, H_kv, C, D]: row b sees
    columns [offset + first[b], offset + window). Returns [B, H, 1, D] in q's dtype (bfloat16). Needs the op
    loaded: `kernel_available()` returned True."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    # Grouped-query heads folded per KV head, as matmul_attention does; scaled in bf16 as it does too.
    queries = (q * scale).reshape(batch, kv_heads, heads // kv_heads, dim).contiguous()
    out = torch.ops.textgen.decode_attention(queries, keys, values, first, offset, window)
    return out.view(batch, heads, 1, dim)
