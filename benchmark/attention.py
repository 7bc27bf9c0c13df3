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
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from textgen_benchmark.decode import copy_bandwidth_gbs
from textgen_server.layers.attention_kernels import matmul_attention, sdpa
from textgen_server.layers.decode_attention import decode_attention, first_visible, kernel_available

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--window", type=int, default=300)
    p.add_argument("--capacity", type=int, default=413)
    p.add_argument("--shortest", type=float, default=0.35, help="live share of the window for the last row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
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
        times: dict[str, list[float]] = {name: [] for name in cases}
        for run, _ in cases.values():
            run()  # warm-up
        for _ in range(args.runs):  # alternate, so drift on a shared machine hits every kernel alike
            for name, (run, _) in cases.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        for name, (_, columns) in cases.items():
            median = statistics.median(times[name])
            read = 2 * LAYERS * args.batch * HEADS * columns * HEAD_DIM * dtype.itemsize
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | {median * 1e3:.1f} | {read / median / 1e9:.1f} |")


if __name__ == "__main__":
    main()
