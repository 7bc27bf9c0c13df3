"""The decoder layer's fused C++ ops (fused_ops.cpp) against the torch code they replace, which stays as the
fallback: the same bits, except the float32 norm's sum (another order, within a unit in the last place)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.layers.norm import RMSNorm
from textgen_server.layers.paged_attention import write_kv
from textgen_server.layers.rotary import apply_rotary, rotate_heads_

ops = torch.ops.textgen
DTYPES = [torch.float32, torch.bfloat16]
# A decode step's few rows run on the calling thread; a prefill's many are split over threads.
ROWS = [1, 5, 67]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not kernel_available():
        pytest.skip("no C++ compiler: the model keeps its torch code")


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    norm.fused = False
    try:
        return norm(x)
    finally:
        norm.fused = True


# Widths the ops take 16 lanes at a time, and ones with a tail of fewer (its masked loads and stores).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [768, 776])
def test_rms_norm_and_residual_add_match_torch(dtype: torch.dtype, rows: int, hidden: int) -> None:
    norm = RMSNorm(randn(hidden, dtype=dtype, scale=0.2, seed=1) + 1, 1e-6)
    assert norm.fused
    x, residual = randn(rows, hidden, dtype=dtype, scale=3), randn(rows, hidden, dtype=dtype, seed=2)
    total, normed = norm.add(x, residual)
    assert torch.equal(total, x + residual)
    for fused, reference in ((normed, torch_norm(norm, x + residual)), (norm(x), torch_norm(norm, x))):
        if dtype == torch.bfloat16:
            assert torch.equal(fused, reference)
        else:
            torch.testing.assert_close(fused, reference, rtol=2e-7, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [64, 80])
def test_rotary_in_place_matches_torch_bit_for_bit(dtype: torch.dtype, rows: int, dim: int) -> None:
    """Query and key heads of a fused q/k/v output (a strided view), rotated at scattered positions; a head of 80
    (Phi's) rotates halves of 40, 16 lanes twice and a tail of 8, the last key head's right beside the values."""
    heads, kv_heads = 12, 4
    qkv = randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype, scale=2)
    positions = torch.randint(0, 4000, (rows,), generator=torch.Generator().manual_seed(3)).float()
    freqs = positions[:, None] / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim)
    expected = apply_rotary(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    rotate_heads_(qk, cos, sin, fused=True)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # the value heads are left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_torch_bit_for_bit(dtype: torch.dtype, rows: int) -> None:
    gate_up = randn(rows, 2 * 2048, dtype=dtype, scale=4)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_over_every_bfloat16_gate(dtype: torch.dtype) -> None:
    """Every bfloat16 bit pattern as a gate (infinities and NaNs too), so every input of the exp in bfloat16, through
    cpu_ops.h's inline copy of torch's vector exp. The op flushes subnormals (FlushDenormals): a gate, silu or result
    that is one is left out; a NaN only has to be one."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dtype)
    gate, up = gate.reshape(32, 2048), randn(32, 2048, dtype=dtype, scale=4)
    out, expected = ops.silu_mul(torch.cat([gate, up], dim=1)), F.silu(gate) * up
    tiny = torch.finfo(torch.float32).tiny

    def not_subnormal(x: torch.Tensor) -> torch.Tensor:
        return (x == 0) | ~(x.float().abs() < tiny)

    kept = not_subnormal(gate) & not_subnormal(F.silu(gate.float())) & not_subnormal(expected)
    assert int(kept.sum()) > 60_000
    assert torch.equal(out.isnan(), expected.isnan())
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    numbers = kept & ~expected.isnan()
    assert torch.equal(out.view(bits)[numbers], expected.view(bits)[numbers])


def test_silu_mul_on_a_width_with_a_tail() -> None:
    """A width torch's vector loop does not divide: the rest goes through the scalar exp, as torch's does."""
    gate_up = randn(3, 2 * 1001, dtype=torch.bfloat16, scale=4)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_index_copy(dtype: torch.dtype) -> None:
    blocks, block_size, kv_heads, dim, tokens = 9, 4, 2, 16, 7
    kv = randn(tokens, 3 * kv_heads * dim, dtype=dtype)  # k and v as strided views of one projection output
    k = kv[:, kv_heads * dim : 2 * kv_heads * dim].view(tokens, kv_heads, dim)
    v = kv[:, 2 * kv_heads * dim :].view(tokens, kv_heads, dim)
    slots = torch.tensor([5, 6, 7, 8, 30, 31, 1])
    caches = [torch.zeros(blocks, block_size, kv_heads, dim, dtype=dtype) for _ in range(4)]
    write_kv(caches[0], caches[1], slots, k, v, fused=True)
    write_kv(caches[2], caches[3], slots, k, v, fused=False)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 300])  # one thread; split over threads
def test_gather_kv_is_torch_s_gather_head_by_head(dtype: torch.dtype, tokens: int) -> None:
    k_cache, v_cache = randn(40, 16, 3, 8, dtype=dtype), randn(40, 16, 3, 8, dtype=dtype, seed=1)
    slots = torch.randperm(40 * 16, generator=torch.Generator().manual_seed(tokens))[:tokens]
    k, v = ops.gather_kv(k_cache, v_cache, slots)
    for got, cache in ((k, k_cache), (v, v_cache)):
        assert got.shape == (3, tokens, 8) and got.is_contiguous()
        assert torch.equal(got, cache.view(-1, 3, 8)[slots].transpose(0, 1))


def test_bad_inputs_raise_instead_of_reading_out_of_bounds() -> None:
    cache = torch.zeros(2, 4, 1, 8)
    kv = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(cache, cache.clone(), torch.tensor([8]), kv, kv)
    for slots in (torch.tensor([3, 8]), torch.tensor([-1])):
        with pytest.raises(RuntimeError, match="slot out of range"):
            ops.gather_kv(cache, cache.clone(), slots)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.gather_kv(cache, cache.bfloat16(), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(torch.ones(2, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary_(torch.ones(2, 3, 8), torch.ones(3, 8), torch.ones(3, 8))
