"""The shard's CPU linear paths (plain `F.linear`, MKL-packed, oneDNN-reordered weight, textgen's one-row `gemv`)
side by side.

For each of the small model's projection shapes (fused q/k/v, o, fused gate/up, down, LM head) and each row
count (1 = one decode row; 8-64 = decode batches; 256-2048 = prefills) every path this torch and CPU have for
the dtype (layers/linear_choice.py) runs in turn, `--runs` times each, on the same input (`-` where a path does
not serve that row count). Printed per case: the median ms of each path, the fastest path and its GFLOP/s, and
at 1 row, where a product reads the whole weight for little arithmetic, the achieved GB/s of each path against a
measured copy bandwidth (the memory roofline). With `--cold` each call first finds its weight out of the caches,
as the shard's load-time measurement and a decode step do (without it the weight stays in the caches between
calls).

    python benchmark/linear_pack.py [--rows 1 8 32 64 256 2048] [--runs 30] [--threads 2] [--dtype bfloat16] [--cold]
"""

from __future__ import annotations

import argparse
import functools

import torch

from textgen_benchmark.decode import copy_bandwidth_gbs
from textgen_benchmark.shard import DTYPES
from textgen_benchmark.timing import alternate
from textgen_server.layers.linear_choice import (
    EVICT_MAX,
    KERNELS,
    available_paths,
    bucket,
    last_level_cache_bytes,
)

# (name, out_features, in_features) of the small Llama (hidden 768, intermediate 2048, vocab 16000).
SHAPES = [("qkv", 2304, 768), ("o", 768, 768), ("gate_up", 4096, 768), ("down", 768, 2048), ("lm_head", 16000, 768)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--cold", action="store_true", help="evict the weight from the caches before each call")
    args = parser.parse_args()
    before = torch.ones(min(2 * last_level_cache_bytes(), EVICT_MAX) // 4).sum if args.cold else None
    bandwidth = copy_bandwidth_gbs(args.threads)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    paths = available_paths(dtype, torch.device("cpu"))
    print(
        f"{args.dtype}, threads {args.threads}, {'cold' if args.cold else 'hot'} weights;"
        f" copy bandwidth {bandwidth:.1f} GB/s (read + write)"
    )
    print(
        f"{'shape':<9}{'rows':>6}"
        + "".join(f"{p + ' ms':>12}" for p in paths)
        + f"{'fastest':>9}{'GF/s':>8}  roofline (1 row)"
    )
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, out_f, in_f in SHAPES:
            weight = torch.randn(out_f, in_f, generator=g).to(dtype)
            kernels = [KERNELS[path](weight, None) for path in paths]
            for rows in args.rows:
                x = torch.randn(rows, in_f, generator=g).to(dtype)
                serving = [k for k in kernels if k.serves(bucket(rows))]
                timed = alternate([functools.partial(kernel, x) for kernel in serving], args.runs, before)
                times = dict(zip((k.path for k in serving), timed, strict=True))
                best = min(times, key=times.__getitem__)
                flops = 2 * rows * in_f * out_f
                line = f"{name:<9}{rows:>6}" + "".join(
                    f"{times[p] * 1e3:>12.3f}" if p in times else f"{'-':>12}" for p in paths
                )
                line += f"{best:>9}{flops / times[best] / 1e9:>8.1f}"
                if rows == 1:
                    gbs = {p: weight.numel() * weight.element_size() / t / 1e9 for p, t in times.items()}
                    line += "  " + " / ".join(f"{p} {v:.1f} GB/s = {v / bandwidth:.0%}" for p, v in gbs.items())
                print(line, flush=True)


if __name__ == "__main__":
    main()
