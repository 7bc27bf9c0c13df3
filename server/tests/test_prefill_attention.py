"""`textgen::paged_prefill_attention` (prefill_attention.cpp): every row of several queries of a step in one call,
reading keys and values in the pool, against the torch path it replaces (keys gathered; bf16 eager matmul
attention, float32 SDPA) and the per-row reference of test_paged_attention.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_paged_attention import Case, head_major, make_case, reference

from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.layers.paged_attention import paged_attention, prefill_op

# (query tokens, keys seen) per row: decode rows between them (left to the decode op), a row of two queries, rows
# past a task's 64 query rows, a long cached prefix, rows shorter than 16 keys (torch's softmax sums those serially).
ROWS = [(1, 40), (70, 300), (2, 2), (130, 130), (1, 1), (17, 90), (5, 9), (40, 1000)]


@pytest.fixture(autouse=True)
def built() -> None:
    if not (kernel_available() and torch.ops.textgen.paged_prefill_attention_built(torch.bfloat16)):
        pytest.skip("the op is built for CPUs with AVX512-BF16 only (and needs a C++ compiler)")


def call(case: Case, window: int, out: torch.Tensor | None = None, q: torch.Tensor | None = None) -> torch.Tensor:
    """The op on `case`; rows it does not write keep `out`'s values (NaN by default)."""
    out = torch.full_like(case.q, float("nan")) if out is None else out
    torch.ops.textgen.paged_prefill_attention(
        out,
        case.q if q is None else q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens.long(),
        case.cu_seqlens_q.long(),
        0.125,
        window,
    )
    return out


def attend(case: Case, scale: float = 0.125, window: int | None = None, kernel: bool | None = None) -> torch.Tensor:
    """`paged_attention` on `case`: with the ops where they are in use (kernel None), or the torch path (False)."""
    return paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.cu_seqlens_q,
        case.seq_lens,
        case.block_tables,
        scale,
        window,
        kernel=kernel,
    )


def assert_agrees(got: torch.Tensor, expected: torch.Tensor, wanted: torch.Tensor, equal_share: float) -> None:
    """The op's `got` against the torch path's `expected` and the float64 reference's `wanted`. float32: within the
    reference's tolerance, as SDPA over the gathered keys. bf16: the same roundings as the eager attention (scaled
    query, scores, probabilities, output) and torch's softmax but for its exp, so only float32 sums in another order,
    which move a rare score or output to the neighbouring bfloat16 (a score's probability moves by 2^-8 of itself, an
    output by as much of a value: 2^-7 at most here); at least `equal_share` of the outputs the same bits."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-5)
        return
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)
    assert (got == expected).float().mean() > equal_share
    torch.testing.assert_close(got, wanted, rtol=1.6e-2, atol=2**-7)


def several(case: Case) -> torch.Tensor:
    """The tokens of rows of several queries (bool [T])."""
    counts = torch.diff(case.cu_seqlens_q)
    return torch.repeat_interleave(counts > 1, counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 50])
# (heads, KV heads, head size): one query head a KV head, 8 and 4 (two and one query per 64-row task at most), a
# head of 128 values and one of 96 (three 32-column blocks of the values' sums).
@pytest.mark.parametrize("heads", [(12, 12, 64), (32, 4, 64), (8, 1, 128), (12, 3, 96)], ids=str)
def test_rows_of_several_queries_agree_with_the_torch_path(
    dtype: torch.dtype, block_size: int, window: int | None, heads: tuple[int, int, int]
) -> None:
    case = make_case(ROWS, dtype, block_size, *heads, seed=3)
    got = call(case, window or 0)
    mask = several(case)
    assert bool(got[~mask].isnan().all())  # decode rows are the decode op's: left as they were
    expected = attend(case, window=window, kernel=False)[mask]
    wanted = reference(case, 0.125, window)[mask]
    if dtype == torch.float32:
        torch.testing.assert_close(expected, wanted, rtol=1e-4, atol=1e-5)  # the path replaced, as the reference
    assert_agrees(got[mask], expected, wanted, 0.999)


def test_paged_attention_takes_the_op_for_every_row_of_several_queries() -> None:
    case = make_case(ROWS, torch.bfloat16, 16, 12, 4, 64, seed=4)
    assert prefill_op(case.q, case.k_cache)
    mask = several(case)
    assert torch.equal(attend(case)[mask], call(case, 0)[mask])


def test_what_the_op_does_not_take_keeps_the_torch_path() -> None:
    q, pool = torch.zeros(4, 8, 64, dtype=torch.bfloat16), torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)
    assert prefill_op(q, pool) and prefill_op(q.float(), pool.float())
    assert not prefill_op(q.half(), pool.half())  # float16: the eager matmuls over the gathered keys
    assert not prefill_op(q[..., :48], pool[..., :48])  # a head that is not whole pairs of 32 values
    assert not prefill_op(torch.zeros(4, 65, 64, dtype=torch.bfloat16), pool[:, :, :1])  # 65 query heads a KV head


def test_float16_is_refused() -> None:
    case = make_case([(3, 20)], torch.float16, 16, 4, 2, 64, seed=8)
    with pytest.raises(RuntimeError, match="this build has no products for Half"):
        call(case, 0)


def test_queries_are_read_through_their_strides() -> None:
    case = make_case(ROWS, torch.bfloat16, 16, 8, 2, 64, seed=5)
    fused = torch.cat([case.q, torch.zeros_like(case.q)], dim=2)[:, :, :64]  # the token stride of a fused projection
    mask = several(case)
    assert torch.equal(call(case, 0, q=fused)[mask], call(case, 0)[mask])


def test_a_block_outside_the_pool_is_refused_before_any_write() -> None:
    case = make_case([(3, 20), (2, 40)], torch.bfloat16, 16, 4, 2, 64, seed=6)
    case.block_tables[1, 1] = case.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="a block table names a block outside the pool"):
        call(case, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c, "q", c.q.float()), "must have q's dtype"),
        (lambda c: setattr(c, "seq_lens", torch.tensor([2, 40])), "no more than its keys"),
        (lambda c: setattr(c, "cu_seqlens_q", torch.tensor([0, 3, 4])), "must span q's tokens"),
        (lambda c: setattr(c, "block_tables", c.block_tables.long()), "int32"),
    ],
    ids=["mixed dtypes", "more queries than keys", "tokens", "table dtype"],
)
def test_bad_inputs_are_refused(change: object, message: str) -> None:
    """Each refused with its message; out is bfloat16 as the pool is."""
    case = make_case([(3, 20), (2, 40)], torch.bfloat16, 16, 4, 2, 64, seed=7)
    change(case)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match=message):
        call(case, 0, out=torch.empty(case.q.shape, dtype=torch.bfloat16))


def shared_case(
    own: list[int],
    prefix: int,
    dtype: torch.dtype,
    block_size: int,
    heads: tuple[int, int, int],
    queries: list[int] | None = None,
) -> Case:
    """Rows whose first prefix // block_size blocks are the same ones (a prefix-cache hit), each with `own` more
    positions in blocks of its own and `queries` queries (default: decode rows, one each; then a row's last queries
    are its last positions); two more rows share nothing, one of them shorter than the shared part (with 3 and 2
    queries where `queries` is given)."""
    n_heads, kv_heads, dim = heads
    g = torch.Generator().manual_seed(9)
    shared = prefix // block_size
    lengths = [shared * block_size + n for n in own] + [prefix + 5, 30]
    needed = [-(-length // block_size) for length in lengths]
    num_blocks = shared + sum(n - shared for n in needed[: len(own)]) + sum(needed[len(own) :]) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    common = [order.pop() for _ in range(shared)]
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    tables = torch.full((len(lengths), max(needed)), num_blocks + 100, dtype=torch.int32)
    prefix_k = torch.randn(shared * block_size, kv_heads, dim, generator=g).to(dtype)
    prefix_v = torch.randn(shared * block_size, kv_heads, dim, generator=g).to(dtype)
    keys, values = [], []
    for b, length in enumerate(lengths):
        first = common if b < len(own) else []
        blocks = first + [order.pop() for _ in range(needed[b] - len(first))]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(length, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(length, kv_heads, dim, generator=g).to(dtype)
        if first:
            k[: len(prefix_k)], v[: len(prefix_v)] = prefix_k, prefix_v
        positions = torch.arange(length)
        slots = tables[b, positions // block_size].long() * block_size + positions % block_size
        k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots] = k, v
        keys.append(k)
        values.append(v)
    counts = [1] * len(lengths) if queries is None else [*queries, 3, 2]
    q = torch.randn(sum(counts), n_heads, dim, generator=g).to(dtype)
    cu = torch.tensor([0, *counts]).cumsum(0)
    return Case(q, keys, values, k_cache, v_cache, cu, torch.tensor(lengths), tables)


def over_shared_prefixes(test: Callable[..., None]) -> Callable[..., None]:
    """The shared-prefix tests' cases: both dtypes, blocks of 1 and 16, a KV head for 1, 8 and 8 query heads (the
    last of 128 values)."""
    test = pytest.mark.parametrize("heads", [(12, 12, 64), (32, 4, 64), (8, 1, 128)], ids=str)(test)
    test = pytest.mark.parametrize("block_size", [1, 16])(test)
    return pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])(test)


@over_shared_prefixes
def test_decode_rows_sharing_a_prefix_agree_with_the_torch_path(
    dtype: torch.dtype, block_size: int, heads: tuple[int, int, int]
) -> None:
    # 20 rows over one prefix (more than one task's 64 query rows with 4 query heads a KV head), one of them with no
    # position of its own, one with a partial block.
    own = [0, 1, 7, 16, 40, 3, 90, 25, 2, 5, 11, 64, 33, 8, 9, 10, 12, 13, 14, 15]
    case = shared_case(own, 300, dtype, block_size, heads)
    assert_agrees(attend(case), attend(case, kernel=False), reference(case, 0.125, None), 0.99)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_sharing_a_prefix_read_a_head_major_pool_to_the_same_bits(dtype: torch.dtype) -> None:
    # The shared-prefix groups of the decode op and the prefill op's shared tasks, over the CPU pool's order.
    for queries in (None, [2, 70, 20, 33, 1, 5, 17, 40]):
        own = [2, 70, 29, 33, 1, 12, 17, 60]
        case = shared_case(own, 300, dtype, 16, (32, 4, 64), queries)
        expected = attend(case)
        case.k_cache, case.v_cache = head_major(case.k_cache), head_major(case.v_cache)
        assert torch.equal(attend(case), expected)


def test_a_shared_prefix_block_outside_the_pool_is_refused() -> None:
    case = shared_case([4] * 6, 128, torch.bfloat16, 16, (4, 2, 64))
    case.block_tables[:6, 2] = case.k_cache.shape[0]  # inside the shared blocks of all six rows
    with pytest.raises(RuntimeError, match="a block table names a block outside the pool"):
        attend(case, scale=0.1)


@over_shared_prefixes
def test_prefill_rows_sharing_a_prefix_agree_with_the_torch_path(
    dtype: torch.dtype, block_size: int, heads: tuple[int, int, int]
) -> None:
    # Prefill rows over one prefix (a prefix-cache hit's questions), their queries a group's lanes: one row's 70 past
    # a task's 64 query rows, rows whose first query is the first position after the prefix, a row of two queries
    # after own positions computed earlier; and a decode row among them, left to the decode op.
    queries = [2, 70, 20, 33, 1, 5, 17, 40]
    own = [2, 70, 29, 33, 1, 12, 17, 60]
    case = shared_case(own, 300, dtype, block_size, heads, queries)
    got = call(case, 0)
    mask = several(case)
    assert bool(got[~mask].isnan().all())
    assert_agrees(got[mask], attend(case, kernel=False)[mask], reference(case, 0.125, None)[mask], 0.99)
