"""The shard's CPU linear (weight reordered once into oneDNN's layout) against plain `F.linear`, side by side.

For each of the small model's projection shapes (fused q/k/v, o, fused gate/up, down, LM head) and each row
count (1 = one decode row; 8-64 = decode batches; 256-2048 = prefills) both products run alternately,
`--runs` times each, on the same input. Printed per case: median ms of both, GFLOP/s, the ratio
(F.linear / packed: > 1 means the packed weight is faster), and at 1 row, where a product reads the whole
weight for little arithmetic, the achieved GB/s of both against a measured copy bandwidth (the memory
roofline).

    python benchmark/linear_pack.py [--rows 1 8 32 64 256 2048] [--runs 30] [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from textgen_benchmark.decode import copy_bandwidth_gbs
from textgen_benchmark.shard import DTYPES
from textgen_server.layers.tensor_parallel import Linear

# (name, out_features, in_features) of the small Llama (hidden 768, intermediate 2048, vocab 16000).
SHAPES = [("qkv", 2304, 768), ("o", 768, 768), ("gate_up", 4096, 768), ("down", 768, 2048), ("lm_head", 16000, 768)]


def alternate(fns: list[Callable[[], object]], runs: int) -> list[float]:
    """Median seconds of each fn, calling them in turn so both see the same machine state."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up: first-touch allocations, thread pool start
    for _ in range(runs):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs(args.threads)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, threads {args.threads}; copy bandwidth {bandwidth:.1f} GB/s (read + write)")
    print(
        f"{'shape':<9}{'rows':>6}{'F.linear ms':>13}{'packed ms':>11}{'F.linear GF/s':>15}{'packed GF/s':>13}"
        f"{'ratio':>7}  roofline (1 row)"
    )
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, out_f, in_f in SHAPES:
            weight = torch.randn(out_f, in_f, generator=g).to(dtype)
            layer = Linear(weight.clone(), None)
            for rows in args.rows:
                x = torch.randn(rows, in_f, generator=g).to(dtype)
                plain, packed = alternate(
                    [functools.partial(F.linear, x, weight), functools.partial(layer, x)], args.runs
                )
                flops = 2 * rows * in_f * out_f
                line = (
                    f"{name:<9}{rows:>6}{plain * 1e3:>13.3f}{packed * 1e3:>11.3f}{flops / plain / 1e9:>15.1f}"
                    f"{flops / packed / 1e9:>13.1f}{plain / packed:>7.2f}"
                )
                if rows == 1:
                    gbs = [weight.numel() * weight.element_size() / t / 1e9 for t in (plain, packed)]
                    line += f"  {gbs[0]:.1f} / {gbs[1]:.1f} GB/s = {gbs[0] / bandwidth:.0%} / {gbs[1] / bandwidth:.0%}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
