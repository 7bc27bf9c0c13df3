"""Attention through a paged KV pool: `write_kv` stores a step's keys and values, `paged_attention`
attends through each row's block table (TGI's flashinfer / flashdecoding layout, `[num_blocks, block_size,
kv_heads, head_dim]` per layer; slot `s` = `block * block_size + offset`).

Decode rows (one query token) in float32 and bfloat16 go to `textgen::paged_decode_attention`, the C++ op built
with the padded decode op (decode_attention.cpp; built at first use, TEXTGEN_CPU_DECODE_KERNEL=0 turns both
off): it reads each row's keys through its block table, once for all the query heads of a group, and nothing
else. On an AVX-512 CPU, every row of several query tokens (prefills, prefill chunks, prefix-cache hits) in
float32, and in bfloat16 where the CPU has AVX512-BF16, goes to `textgen::paged_prefill_attention`
(prefill_attention.cpp; `prefill_op`), all of a step's such rows in one call per layer, which also reads keys and
values in the pool where they lie. Elsewhere (AVX2, float16, another head size) those rows take the torch path:
keys gathered from the pool, then the shard's attention kernel (`attention_for`: SDPA in float32,
`matmul_attention` in half precision) under an explicit bottom-right causal mask (`causal_attention`; in bfloat16
with the ops built, the masked softmax is `textgen::causal_softmax_bf16`); in bfloat16 on a CPU whose products the
ops of attention_products.cpp give in torch's order (`reads_pool`: AVX2), a row reads its keys and values in the
pool where they lie, with the same bits and no gather. Every path rounds where transformers' eager attention rounds
in bfloat16 (see attention_kernels.py), so the two ops differ from the torch path only where float32 sums taken in
another order round to another bfloat16.
On a GPU every decode row takes `decode_rows`, torch ops that read nothing on the host when their metadata is
on the GPU, so a decode step can be captured in a CUDA graph (models/cuda_graphs.py); prefills take SDPA.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from textgen_server.layers.attention_kernels import attention_for, causal_attention, pool_causal_attention, reads_pool
from textgen_server.layers.cpu_ops import ops_for

# Row metadata: a host tensor or, as cheaply, a Python list of ints.
Lengths = torch.Tensor | Sequence[int]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fused: bool = False,
) -> None:
    """Store k, v [T, kv_heads, head_dim] at slots [T] (int64) of the pools [num_blocks, block_size, kv_heads,
    head_dim] (contiguous or head-major, models/kv_pool.py); slot `s` is `block * block_size + offset`. `fused`:
    with `textgen::write_kv` (fused_ops.cpp)."""
    if fused and k.dtype == k_cache.dtype:
        torch.ops.textgen.write_kv(k_cache, v_cache, slots, k, v)
        return
    if k_cache.is_contiguous():
        kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def pool_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The pool's slots `slots` (int64, any shape), [*slots.shape, kv_heads, head_dim]: through its flat view where
    the pool is contiguous (a GPU's), by block and offset where it is head-major (a CPU's, models/kv_pool.py)."""
    if cache.is_contiguous():
        return cache.view(-1, cache.shape[2], cache.shape[3])[slots]
    return cache[slots // cache.shape[1], slots % cache.shape[1]]


def use_paged_kernel(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode rows of `dtype` on `device` go to the C++ op (float32 and bfloat16 on a CPU, where it
    builds, unless TEXTGEN_CPU_DECODE_KERNEL=0)."""
    return ops_for(dtype, device)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: Lengths,
    seq_lens: Lengths,
    block_tables: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_slots: Sequence[torch.Tensor | None] | None = None,
    kernel: bool | None = None,
) -> torch.Tensor:
    """Causal attention of a step's query tokens through the KV pool; returns [T, heads, head_dim] in q's dtype.

    - q [T, heads, head_dim]: the rows' query tokens one row after another (any token and head strides);
    - k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim], contiguous or head-major (models/kv_pool.py),
      q's dtype; heads // kv_heads query heads share a KV head;
    - cu_seqlens_q [B + 1] (int32 / int64 host tensor or list of ints): row b's queries are q[cu[b]:cu[b + 1]],
      at least one per row;
    - seq_lens [B] (int32 / int64 host tensor or list of ints): row b attends to its first seq_lens[b] positions,
      its new ones (already stored with `write_kv`) last;
    - block_tables int32 [B, max_blocks]: row b's position p lives in block block_tables[b, p // block_size];
    - window: sliding window, a query at position p sees keys (p - window, p]; None: all keys up to p;
    - key_slots: per row of several queries, the pool slots (int64, on the pool's device) of its seq_lens[b]
      positions, computed once per step for every layer (`row_key_slots`; not where the prefill op takes those
      rows, which reads the table itself); None: from the table, per call;
    - kernel: whether decode rows go to the C++ op and rows of several queries to theirs (`prefill_op`) or
      gather their keys with the ops (`textgen::gather_kv`), as `use_paged_kernel(q.dtype, q.device)` says (a
      model decides once at load what every layer's call would otherwise look up again); None: looked up here.

    Bottom-right aligned: query i of a row of n queries sits at position seq_lens[b] - n + i. When every row has
    one query (T == B) the metadata is never read on the host; lists avoid a tensor-to-list copy otherwise.
    """
    batch = len(seq_lens)
    block_tables = block_tables.to(torch.int32)
    if kernel is None:
        kernel = use_paged_kernel(q.dtype, q.device)
    if q.shape[0] == batch:  # every row a decode row: the common step, straight to the op or `decode_rows`
        lengths = torch.as_tensor(seq_lens, dtype=torch.int64)
        if kernel:
            return torch.ops.textgen.paged_decode_attention(
                q, k_cache, v_cache, block_tables.contiguous(), lengths, scale, window or 0
            )
        return decode_rows(q, k_cache, v_cache, block_tables, lengths, scale, window)
    cu = cu_seqlens_q.tolist() if isinstance(cu_seqlens_q, torch.Tensor) else list(cu_seqlens_q)
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=q.dtype, device=q.device)
    decode = [b for b in range(batch) if cu[b + 1] - cu[b] == 1]
    if decode:
        tokens = torch.tensor([cu[b] for b in decode], device=q.device)
        rows = torch.tensor(decode, device=block_tables.device)
        lengths = torch.tensor([lens[b] for b in decode])
        tables = block_tables[rows].contiguous()
        if kernel:
            out[tokens] = torch.ops.textgen.paged_decode_attention(
                q[tokens], k_cache, v_cache, tables, lengths, scale, window or 0
            )
        else:
            out[tokens] = decode_rows(q[tokens], k_cache, v_cache, tables, lengths, scale, window)
    if kernel and prefill_op(q, k_cache):
        torch.ops.textgen.paged_prefill_attention(
            out,
            q,
            k_cache,
            v_cache,
            block_tables.contiguous(),
            torch.tensor(lens),
            torch.tensor(cu),
            scale,
            window or 0,
        )
        return out
    for b in range(batch):
        if cu[b + 1] - cu[b] > 1:
            slots = key_slots[b] if key_slots is not None else None
            if slots is None:
                slots = row_key_slots(block_tables[b : b + 1], [lens[b]], k_cache.shape[1], k_cache.device)[0]
            out[cu[b] : cu[b + 1]] = _row(q[cu[b] : cu[b + 1]], k_cache, v_cache, slots, scale, window, kernel)
    return out


def prefill_op(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether rows of several queries go to `textgen::paged_prefill_attention` (prefill_attention.cpp), all in one
    call; the caller has checked that the ops are in use (`kernel`)."""
    return prefill_op_takes(q.dtype, q.shape[1] // k_cache.shape[2], q.shape[2])


@functools.cache
def prefill_op_takes(dtype: torch.dtype, group: int, dim: int) -> bool:
    """Whether the prefill op takes heads of `dim` values, `group` query heads a KV head, in `dtype`: float32 or
    bfloat16 where the build has its products (AVX-512; AVX512-BF16 for bfloat16), a head size that is a multiple of
    32 and at most 64 query heads a KV head."""
    return (
        dtype in (torch.float32, torch.bfloat16)
        and dim % 32 == 0
        and group <= 64
        and bool(torch.ops.textgen.paged_prefill_attention_built(dtype))
    )


def decode_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The op's work in torch (GPUs, and CPUs without the op): decode rows' queries [B, H, D] over their keys
    gathered into [B, Hkv, width, D], masked past each row's length (int64 [B]).

    With `lengths` on the host the width is the rows' longest, read there; with `lengths` on a GPU (a CUDA graph's
    static buffers) it is the whole table's, `tables.shape[1] * block_size`, and nothing is read on the host, so
    the call can be captured. Positions past a row's length read its position 0, which is written (a
    masked column's zero weight times an unwritten slot's NaN would be NaN).
    """
    block_size = k_cache.shape[1]
    if lengths.device.type == "cpu":
        tables = tables[:, : -(-int(lengths.max()) // block_size)]
    device = q.device
    tables, lengths = tables.to(device), lengths.to(device)
    keys = torch.arange(tables.shape[1] * block_size, device=device)
    last = (lengths - 1).unsqueeze(1)  # [B, 1]
    visible = keys <= last  # [B, width]
    if window is not None:
        visible &= keys > last - window
    slots = _slots(tables, torch.where(visible, keys, 0), block_size)
    k = pool_rows(k_cache, slots).transpose(1, 2)  # [B, Hkv, width, D]
    v = pool_rows(v_cache, slots).transpose(1, 2)
    attend = attention_for(q.dtype, device)
    return attend(q.unsqueeze(2), k, v, visible.view(q.shape[0], 1, 1, -1), scale).squeeze(2)


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots (int64) of `positions` through block table rows `table` (same leading shape)."""
    return table.gather(-1, positions // block_size).long() * block_size + positions % block_size


def row_key_slots(
    tables: torch.Tensor, lengths: Sequence[int], block_size: int, device: torch.device
) -> list[torch.Tensor]:
    """The pool slots of positions 0 .. lengths[i] - 1 of each row of `tables` (host, [R, max_blocks]), moved to
    `device` in one copy."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    positions = torch.arange(int(sum(lengths))) - starts[rows]
    slots = tables[rows, positions // block_size].long() * block_size + positions % block_size
    return list(slots.to(device).split(list(lengths)))


def _row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    window: int | None,
    gather_op: bool,
) -> torch.Tensor:
    """One row's n queries [n, H, D] over its keys at `slots` (the row's positions in order): read in the pool
    where the ops can, else gathered from it head by head (by `textgen::gather_kv` where `gather_op`,
    paged_attention's `kernel`) into [Hkv, L, D] contiguous, the layout transformers' eager attention multiplies:
    torch's matmul then copies neither operand, where the keys gathered in the pool's [L, Hkv, D] order cost it a
    transposing copy of both (benchmark/README.md, "W2 on AVX-512")."""
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    if reads_pool(q.dtype, q.device) and k_cache.is_contiguous():  # its ops read the pool's flat [slots, Hkv, D] view
        return pool_causal_attention(
            q, k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim), slots, scale, window
        )
    if gather_op:
        keys, values = torch.ops.textgen.gather_kv(k_cache, v_cache, slots)
    else:
        keys = pool_rows(k_cache, slots).transpose(0, 1).contiguous()
        values = pool_rows(v_cache, slots).transpose(0, 1).contiguous()
    attend = attention_for(q.dtype, q.device)
    return causal_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scale, window, attend
    )[0].transpose(0, 1)
