"""Decode attention on a CPU: which kernel and which view of the KV buffers a half-precision shard should use.

One decode step of the small Llama's 12 layers at batch 64 (12 heads of 64), over per-layer KV buffers
[B, H, capacity, D] of which a window of `--window` columns is live (the rest: dead columns left of it and the
spare reserve right of it), as `PaddedKVCache` holds them. Rows attend to the last 100% down to `--shortest`
(default 35%) of the window, longest first, as W1's left-padded prompts of 32-256 tokens do at their first
decode step. Per dtype it times, in one process and alternately:

- `sdpa window`: torch's SDPA on the window views (the float32 shard's path);
- `matmul window`: the shard's `matmul_attention` on the same views (strided: the half-precision matmul copies
  the K operand whole before every product);
- `matmul whole`: `matmul_attention` on the whole buffers with the outside columns masked (the half-precision
  shard's decode path where the decode op cannot be built, `PaddedKVCache.whole`);
- `decode op` (bfloat16): the op of layers/decode_attention.py on the whole buffers, reading each row's live
  columns only (the bf16 shard's decode path).

It prints the median ms per step and GB/s of KV bytes the kernel reads (the window's for the window rows, the
whole buffer's for `matmul whole`, the rows' live columns for the op) against a measured copy bandwidth.

    python benchmark/attention.py [--batch 64] [--window 300] [--capacity 413] [--shortest 0.35] [--threads 2]
                                  [--runs 7]

With `--paged` it compares instead the paged KV pool of layers/paged_attention.py with today's padded decode
paths, on W1-like rows: prompts from `--longest` (300) down to `--prompt` (20) tokens, longest first, each with
`--decoded` (50, halfway through W1's 100) tokens decoded since. Per dtype: the padded path (float32: SDPA on the
window views; bfloat16: the decode op over whole buffers; the buffers hold the longest prompt plus 100 spare
columns, as `PaddedKVCache` after a W1 prefill) and `paged_attention` over a pool of `--block-sizes` (1 and 16),
each row's blocks scattered over the pool in random order (a pool after churn, the worst case for block size 1),
through the op and through its torch fallback (TEXTGEN_CPU_DECODE_KERNEL=0).

    python benchmark/attention.py --paged [--batch 64] [--longest 300] [--prompt 20] [--decoded 50]
                                  [--block-sizes 1 16] [--threads 2] [--runs 7]

With `--prefill` it times one layer's bf16 attention of a prefill chunk (`--chunk` queries over each of `--keys`
positions, bottom-right causal, as paged attention's prefill rows): the masked softmax by torch
(TEXTGEN_CPU_DECODE_KERNEL=0) against `textgen::causal_softmax_bf16`. Median ms per layer.

    python benchmark/attention.py --prefill [--chunk 224] [--keys 2800 500] [--threads 2] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from unittest import mock

import torch

from textgen_benchmark.decode import copy_bandwidth_gbs
from textgen_benchmark.timing import alternate
from textgen_server.layers.attention_kernels import causal_attention, matmul_attention, sdpa
from textgen_server.layers.cpu_ops import ENV_SWITCH, kernel_available
from textgen_server.layers.decode_attention import decode_attention, first_visible
from textgen_server.layers.paged_attention import paged_attention

LAYERS, HEADS, HEAD_DIM = 12, 12, 64


def step(
    attend: Callable,
    q: torch.Tensor,
    buffers: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
    columns: slice | None,
) -> Callable[[], None]:
    """One decode step's attention over every layer, on the `columns` views (None: whole buffers)."""

    def run() -> None:
        for k, v in buffers:
            if columns is None:
                attend(q, k, v, mask, HEAD_DIM**-0.5)
            else:
                attend(q, k[:, :, columns], v[:, :, columns], mask[..., columns], HEAD_DIM**-0.5)

    return run


def report(dtype: torch.dtype, cases: dict[str, tuple[Callable[[], None], float]], batch: int, runs: int) -> None:
    """One table line per case: median ms per step and GB/s of the K/V bytes it reads (mean columns per row)."""
    medians = alternate([run for run, _ in cases.values()], runs)
    for name, median in zip(cases, medians, strict=True):
        read = 2 * LAYERS * batch * HEADS * cases[name][1] * HEAD_DIM * dtype.itemsize
        print(f"| {str(dtype).removeprefix('torch.')} | {name} | {median * 1e3:.1f} | {read / median / 1e9:.1f} |")


def without_op(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with the decode ops switched off: paged_attention takes its torch path."""

    def fallback() -> None:
        with mock.patch.dict(os.environ, {ENV_SWITCH: "0"}):
            run()

    return fallback


def paged_step(
    q: torch.Tensor,
    pools: list[tuple[torch.Tensor, torch.Tensor]],
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
) -> Callable[[], None]:
    """One decode step's paged attention over every layer's pool."""

    def run() -> None:
        for k_cache, v_cache in pools:
            paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, tables, HEAD_DIM**-0.5)

    return run


def paged(args: argparse.Namespace) -> None:
    """W1-like decode step: the padded cache's decode paths against the paged pool's."""
    bandwidth = copy_bandwidth_gbs(args.threads)  # also sets the thread count
    batch, longest = args.batch, args.longest
    prompts = [round(longest - (longest - args.prompt) * b / max(batch - 1, 1)) for b in range(batch)]
    lengths = [n + args.decoded for n in prompts]
    window, capacity = longest + args.decoded, longest + 100  # PaddedKVCache: left padded, 100 spare columns
    mask = torch.zeros(batch, 1, 1, capacity, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, ..., window - n : window] = True
    first = first_visible(mask[..., :window], batch, torch.device("cpu"))
    assert first is not None
    live = sum(lengths) / batch
    print(
        f"batch {batch}, prompts {longest}..{args.prompt} + {args.decoded} decoded ({live:.0f} keys a row on "
        f"average), {LAYERS} layers, {HEADS} heads of {HEAD_DIM}, {args.threads} threads; copy bandwidth "
        f"{bandwidth:.1f} GB/s"
    )
    print("| dtype | path | ms/step | GB/s read |")
    print("|---|---|---|---|")
    seq_lens = torch.tensor(lengths)
    cu_seqlens_q = torch.arange(batch + 1)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype)
        shape = (batch, HEADS, capacity, HEAD_DIM)
        buffers = [(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)) for _ in range(LAYERS)]
        padded_q = q.unsqueeze(2)
        if dtype == torch.float32:
            padded = step(sdpa, padded_q, buffers, mask, slice(0, window))
            cases = {"padded: sdpa window": (padded, float(window))}
        else:
            op = lambda q, k, v, mask, scale: decode_attention(q, k, v, first, 0, window, scale)  # noqa: E731
            cases = {"padded: decode op": (step(op, padded_q, buffers, mask, None), live)}
        del buffers
        for block_size in args.block_sizes:
            needed = [-(-n // block_size) for n in lengths]
            order = torch.randperm(sum(needed), generator=g)
            tables = torch.zeros(batch, max(needed), dtype=torch.int32)
            for b, blocks in enumerate(order.split(needed)):
                tables[b, : len(blocks)] = blocks
            pool = (sum(needed), block_size, HEADS, HEAD_DIM)
            pools = [(torch.randn(pool, dtype=dtype), torch.randn(pool, dtype=dtype)) for _ in range(LAYERS)]
            run = paged_step(q, pools, cu_seqlens_q, seq_lens, tables)
            if kernel_available():
                cases[f"paged {block_size}: op"] = (run, live)
            cases[f"paged {block_size}: torch"] = (without_op(run), live)
        report(dtype, cases, batch, args.runs)
        del cases


def prefill(args: argparse.Namespace) -> None:
    """One layer's bf16 attention of a prefill chunk (`--chunk` queries over `--keys` positions, as paged
    attention's `_row` computes it): the masked softmax by torch against the op (causal_softmax_bf16)."""
    if not kernel_available():
        raise SystemExit("the C++ ops could not be built here (see the warning above): nothing to compare")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for keys in args.keys:
        q = torch.randn(1, HEADS, args.chunk, HEAD_DIM, generator=g).bfloat16()
        k, v = (torch.randn(1, HEADS, keys, HEAD_DIM, generator=g).bfloat16() for _ in range(2))

        def run(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            causal_attention(q, k, v, HEAD_DIM**-0.5, None, matmul_attention)

        by_torch, by_op = alternate([without_op(run), run], args.runs)
        print(f"| {args.chunk} x {keys} | {by_torch * 1e3:.2f} | {by_op * 1e3:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--window", type=int, default=300)
    p.add_argument("--capacity", type=int, default=413)
    p.add_argument("--shortest", type=float, default=0.35, help="live share of the window for the last row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--paged", action="store_true", help="paged pool against the padded paths")
    p.add_argument("--longest", type=int, default=300, help="--paged: the longest prompt")
    p.add_argument("--prompt", type=int, default=20, help="--paged: the shortest prompt")
    p.add_argument("--decoded", type=int, default=50, help="--paged: tokens decoded since the prefill")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 16], help="--paged: pool block sizes")
    p.add_argument("--prefill", action="store_true", help="one layer's bf16 prefill-chunk attention, torch vs op")
    p.add_argument("--chunk", type=int, default=224, help="--prefill: queries of the chunk")
    p.add_argument("--keys", type=int, nargs="+", default=[2800, 500], help="--prefill: positions attended")
    args = p.parse_args()
    if args.prefill:
        prefill(args)
        return
    if args.paged:
        paged(args)
        return
    bandwidth = copy_bandwidth_gbs(args.threads)  # also sets the thread count
    start = (args.capacity - args.window) // 2
    window = slice(start, start + args.window)
    lengths = [round(args.window * (1 - (1 - args.shortest) * b / max(args.batch - 1, 1))) for b in range(args.batch)]
    mask = torch.zeros(args.batch, 1, 1, args.capacity, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, ..., window.stop - n : window.stop] = True
    first = first_visible(mask[..., window], args.batch, torch.device("cpu"))
    assert first is not None  # each row's visible columns are one run ending at the window's last column
    print(
        f"batch {args.batch}, window {args.window} of {args.capacity} columns, {LAYERS} layers, "
        f"{args.threads} threads; copy bandwidth {bandwidth:.1f} GB/s"
    )
    print("| dtype | kernel | ms/step | GB/s read |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        shape = (args.batch, HEADS, args.capacity, HEAD_DIM)
        buffers = [(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)) for _ in range(LAYERS)]
        q = torch.randn(args.batch, 1, HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2)
        cases = {
            "sdpa window": (step(sdpa, q, buffers, mask, window), args.window),
            "matmul window": (step(matmul_attention, q, buffers, mask, window), args.window),
            "matmul whole": (step(matmul_attention, q, buffers, mask, None), args.capacity),
        }
        if dtype == torch.bfloat16 and kernel_available():
            op = lambda q, k, v, mask, scale: decode_attention(q, k, v, first, start, args.window, scale)  # noqa: E731
            cases["decode op"] = (step(op, q, buffers, mask, None), sum(lengths) / args.batch)
        report(dtype, cases, args.batch, args.runs)


if __name__ == "__main__":
    main()
