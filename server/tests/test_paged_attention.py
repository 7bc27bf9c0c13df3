"""Attention through the paged KV pool: the C++ decode op and the torch path against a plain per-row reference."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import pytest
import torch

from textgen_server.layers import attention_kernels
from textgen_server.layers import paged_attention as paged_attention_module
from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.layers.paged_attention import paged_attention, pool_rows, use_paged_kernel, write_kv
from textgen_server.models.kv_pool import KVPool, PoolShape

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the decode attention op"
)

# (query tokens, keys seen) per row
DECODE = [(1, 37), (1, 1), (1, 16), (1, 64), (1, 5), (1, 17)]
PREFILL = [(9, 9), (1, 1), (16, 16), (5, 5)]  # no cached prefix
PREFIX = [(7, 20), (1, 33), (16, 64), (3, 4)]  # cached prefix before the new tokens
MIXED = [(1, 40), (12, 12), (1, 1), (6, 30), (1, 17), (2, 2)]
BATCHES = {"decode": DECODE, "prefill": PREFILL, "prefix": PREFIX, "mixed": MIXED}


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    keys: list[torch.Tensor]  # per row [L, Hkv, D], as written
    values: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


def make_case(
    rows: list[tuple[int, int]], dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, dim: int, seed: int = 0
) -> Case:
    """A pool whose unwritten slots are NaN (one stray read shows), rows' blocks shuffled over it, and block
    table entries past each row's blocks pointing outside the pool (one stray lookup fails)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-length // block_size) for _, length in rows]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    tables = torch.full((len(rows), max(needed) + 2), num_blocks + 100, dtype=torch.int32)
    keys, values = [], []
    for b, (_, length) in enumerate(rows):
        blocks = [order.pop() for _ in range(needed[b])]
        tables[b, : needed[b]] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.arange(length)
        slots = tables[b, positions // block_size].long() * block_size + positions % block_size
        keys.append(torch.randn(length, kv_heads, dim, generator=g).to(dtype))
        values.append(torch.randn(length, kv_heads, dim, generator=g).to(dtype))
        write_kv(k_cache, v_cache, slots, keys[-1], values[-1])
    counts = torch.tensor([0] + [n for n, _ in rows])
    q = torch.randn(int(counts.sum()), heads, dim, generator=g).to(dtype)
    seq_lens = torch.tensor([length for _, length in rows], dtype=torch.int32)
    return Case(q, keys, values, k_cache, v_cache, counts.cumsum(0), seq_lens, tables)


def reference(case: Case, scale: float, window: int | None) -> torch.Tensor:
    """Per row and head, softmax(q k^T * scale) v under an explicit bottom-right causal (and window) mask; float32
    in float64, bfloat16 rounded where transformers' eager attention rounds."""
    out = []
    heads, kv_heads = case.q.shape[1], case.keys[0].shape[1]
    bf16 = case.q.dtype == torch.bfloat16
    for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.q[int(case.cu_seqlens_q[b]) : int(case.cu_seqlens_q[b + 1])]
        count, length = q.shape[0], k.shape[0]
        position = torch.arange(length - count, length).unsqueeze(1)
        key = torch.arange(length)
        visible = key <= position
        if window is not None:
            visible &= key > position - window
        heads_out = []
        for h in range(heads):
            kh, vh = k[:, h // (heads // kv_heads)], v[:, h // (heads // kv_heads)]
            if bf16:
                qs = (q[:, h].float() * scale).bfloat16().float()
                scores = (qs @ kh.float().T).bfloat16().float().masked_fill(~visible, float("-inf"))
                probs = torch.softmax(scores, -1).bfloat16().float()
                heads_out.append((probs @ vh.float()).bfloat16())
            else:
                scores = (q[:, h].double() @ kh.double().T * scale).masked_fill(~visible, float("-inf"))
                heads_out.append((torch.softmax(scores, -1) @ vh.double()).float())
        out.append(torch.stack(heads_out, 1))
    return torch.cat(out)


def run(case: Case, scale: float, window: int | None, lists: bool = False) -> torch.Tensor:
    cu, lens = (case.cu_seqlens_q.tolist(), case.seq_lens.tolist()) if lists else (case.cu_seqlens_q, case.seq_lens)
    return paged_attention(case.q, case.k_cache, case.v_cache, cu, lens, case.block_tables, scale, window)


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if got.dtype == torch.bfloat16:
        # The reference's float32 products sum in another order than the bf16 matmul's or the op's: a score can
        # round to the neighbouring bfloat16 (2^-8 of it apart), which moves that key's probability by as much and
        # a few outputs by up to about one bfloat16 unit at the values' scale (~1): 2^-7 absolute.
        torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=2**-7)
        assert (got == expected).float().mean() > 0.95
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(params=["op", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both paths: the C++ op where it builds, and the torch path it falls back to."""
    if request.param == "op":
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler to build the decode attention op")
        assert kernel_available()
    else:
        monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", "0")
    return str(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_equals_reference(
    path: str, dtype: torch.dtype, block_size: int, batch: str, window: int | None
) -> None:
    heads, kv_heads, dim = {1: (4, 2, 64), 16: (6, 3, 24), 64: (4, 1, 32)}[block_size]  # GQA, all dim paths
    case = make_case(BATCHES[batch], dtype, block_size, heads, kv_heads, dim)
    assert_matches(run(case, dim**-0.5, window), reference(case, dim**-0.5, window))


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_metadata_as_lists_or_int64_tensors(path: str, batch: str) -> None:
    case = make_case(BATCHES[batch], torch.float32, 16, 4, 2, 64)
    expected = run(case, 0.125, None)
    torch.testing.assert_close(run(case, 0.125, None, lists=True), expected, rtol=0, atol=0)
    case.cu_seqlens_q, case.seq_lens = case.cu_seqlens_q.int(), case.seq_lens.long()
    torch.testing.assert_close(run(case, 0.125, None), expected, rtol=0, atol=0)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
# (heads, KV heads, head size): in bfloat16 on a CPU with AVX512-BF16 the op multiplies bf16 pairs where the head
# size is a multiple of 32 (the first two, one with query groups) and widens to float32 otherwise (the third).
@pytest.mark.parametrize("heads", [(12, 12, 64), (8, 2, 96), (4, 4, 48)], ids=["64", "96-grouped", "48"])
def test_op_agrees_with_torch_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, window: int | None, heads: tuple[int, int, int]
) -> None:
    # Many long rows, so that a rounding difference would show; odd lengths leave a slot without a pair.
    rows = [(1, n) for n in (300, 257, 200, 129, 64, 33, 20, 1)]
    case = make_case(rows, dtype, 16, *heads, seed=1)
    got = run(case, 0.125, window)
    monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", "0")
    expected = run(case, 0.125, window)
    if dtype == torch.bfloat16:
        # Both round at the same points (the scaled query, the scores, the probabilities, the output) and mostly
        # agree to the bit; only the order of the float32 sums differs (the matmul's blocking and torch's softmax
        # against the op's straight loops), which moves a rare output to the neighbouring bfloat16.
        gap = (got.float() - expected.float()).abs()
        ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(got.float().abs(), expected.float().abs()))) - 7)
        assert bool((gap <= ulp).all())
        assert (got == expected).float().mean() > 0.99
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads", [(12, 12, 64), (8, 2, 64), (4, 4, 48)], ids=["64", "64-grouped", "48"])
def test_prefill_rows_read_in_the_pool_give_the_gathered_keys_bits(
    monkeypatch: pytest.MonkeyPatch, window: int | None, heads: tuple[int, int, int]
) -> None:
    if not attention_kernels.reads_pool(torch.bfloat16, CPU):
        pytest.skip("bfloat16 prefill rows read the pool only through the ops of an AVX2 build")
    case = make_case([(24, 200), (9, 9), (1, 50), (16, 64), (3, 70)], torch.bfloat16, 16, *heads, seed=2)
    got = run(case, 0.125, window)
    monkeypatch.setattr(paged_attention_module, "reads_pool", lambda dtype, device: False)
    assert torch.equal(got, run(case, 0.125, window))


@needs_compiler
def test_op_splits_heads_at_a_small_batch_and_reads_strided_queries() -> None:
    assert kernel_available()
    case = make_case([(1, 50)], torch.bfloat16, 16, 8, 4, 64)
    fused = torch.cat([case.q, torch.zeros_like(case.q)], dim=2)[:, :, :64]  # token stride 2 * H * D
    got = paged_attention(fused, case.k_cache, case.v_cache, [0, 1], [50], case.block_tables, 0.125)
    assert_matches(got, reference(case, 0.125, None))


@needs_compiler
def test_op_refuses_a_block_outside_the_pool() -> None:
    assert kernel_available()
    case = make_case([(1, 20), (1, 3)], torch.float32, 16, 2, 2, 16)
    case.block_tables[1, 0] = case.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        run(case, 0.25, None)


def test_float16_takes_the_torch_path() -> None:
    assert not use_paged_kernel(torch.float16, CPU)
    case = make_case(BATCHES["mixed"], torch.float16, 16, 4, 2, 32)
    got = run(case, 32**-0.5, None)
    case.q, case.keys, case.values = case.q.float(), [k.float() for k in case.keys], [v.float() for v in case.values]
    torch.testing.assert_close(got.float(), reference(case, 32**-0.5, None), rtol=1e-2, atol=2e-3)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """`cache`'s values in the CPU pool's head-major order (models/kv_pool.py): the same [N, S, Hkv, D] tensor, each
    block's slots of one KV head side by side in memory."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("window", [None, 6])
def test_head_major_pool_gives_the_same_bits(
    path: str, dtype: torch.dtype, block_size: int, batch: str, window: int | None
) -> None:
    case = make_case(BATCHES[batch], dtype, block_size, 8, 2, 64)
    expected = run(case, 0.125, window)
    case.k_cache, case.v_cache = head_major(case.k_cache), head_major(case.v_cache)
    assert not case.k_cache.is_contiguous() or block_size == 1
    assert torch.equal(run(case, 0.125, window), expected)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_major_pool_in_the_op_over_long_rows(dtype: torch.dtype) -> None:
    # Several tiles a row, an odd last tile, heads split over tasks at a small batch and not at a large one.
    for rows in ([(1, n) for n in (300, 257, 200, 129, 64, 33, 20, 1)], [(1, 75)]):
        case = make_case(rows, dtype, 16, 12, 12, 64, seed=3)
        expected = run(case, 0.125, None)
        case.k_cache, case.v_cache = head_major(case.k_cache), head_major(case.v_cache)
        assert torch.equal(run(case, 0.125, None), expected)


@pytest.mark.parametrize("fused", [False, True])
def test_write_kv_and_pool_rows_in_a_head_major_pool(fused: bool) -> None:
    if fused and not kernel_available():
        pytest.skip("no C++ compiler to build the ops")
    flat = torch.zeros(4, 16, 3, 8, dtype=torch.bfloat16)
    pool = head_major(torch.zeros_like(flat))
    slots = torch.tensor([37, 2, 63, 16])
    k, v = torch.randn(4, 3, 8).bfloat16(), torch.randn(4, 3, 8).bfloat16()
    write_kv(flat, flat.clone(), slots, k, v, fused)
    values = pool.clone()
    write_kv(pool, values, slots, k, v, fused)
    assert torch.equal(pool, flat) and torch.equal(pool_rows(values, slots), v)
    assert torch.equal(pool_rows(pool, slots.view(2, 2)), k.view(2, 2, 3, 8))
    if fused:
        keys, vals = torch.ops.textgen.gather_kv(pool, values, slots)
        assert torch.equal(keys, k.transpose(0, 1)) and torch.equal(vals, v.transpose(0, 1))


def test_ops_refuse_a_pool_in_another_order() -> None:
    if not kernel_available():
        pytest.skip("no C++ compiler to build the ops")
    pool = torch.zeros(4, 3, 16, 8).transpose(0, 1)  # blocks not outermost
    with pytest.raises(RuntimeError, match="head-major"):
        torch.ops.textgen.write_kv(pool, pool, torch.tensor([0]), torch.zeros(1, 4, 8), torch.zeros(1, 4, 8))


def test_the_cpu_pool_is_head_major() -> None:
    pool = KVPool(PoolShape(2, 16, 4, 64, torch.float32), 3, CPU)
    for cache in (*pool.keys, *pool.values):
        assert cache.shape == (3, 16, 4, 64) and cache.stride() == (4 * 16 * 64, 64, 16 * 64, 1)


def test_write_kv_stores_each_token_at_its_slot() -> None:
    k_cache = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([37, 2, 63, 16])
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    write_kv(k_cache, v_cache, slots, k, v)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 16, slot % 16], k[i].bfloat16())
        assert torch.equal(v_cache.view(-1, 2, 8)[slot], v[i].bfloat16())
    assert int(k_cache.ne(0).any(-1).any(-1).sum()) == 4
