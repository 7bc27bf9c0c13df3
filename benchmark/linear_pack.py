"""The shard's CPU linear paths (plain `F.linear`, MKL-packed, oneDNN-reordered weight) side by side.

For each of the small model's projection shapes (fused q/k/v, o, fused gate/up, down, LM head) and each row
count (1 = one decode row; 8-64 = decode batches; 256-2048 = prefills) every path this torch and CPU have for
the dtype (layers/linear_choice.py) runs in turn, `--runs` times each, on the same input. Printed per case: the
median ms of each path, the fastest path and its GFLOP/s, and at 1 row, where a product reads the whole weight
for little arithmetic, the achieved GB/s of each path against a measured copy bandwidth (the memory roofline).

    python benchmark/linear_pack.py [--rows 1 8 32 64 256 2048] [--runs 30] [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools

import torch

from textgen_benchmark.decode import copy_bandwidth_gbs
from textgen_benchmark.shard import DTYPES
from textgen_benchmark.timing import alternate
from textgen_server.layers.linear_choice import KERNELS, available_paths

# (name, out_features, in_features) of the small Llama (hidden 768, intermediate 2048, vocab 16000).
SHAPES = [("qkv", 2304, 768), ("o", 768, 768), ("gate_up", 4096, 768), ("down", 768, 2048), ("lm_head", 16000, 768)]


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
    paths = available_paths(dtype, torch.device("cpu"))
    print(f"{args.dtype}, threads {args.threads}; copy bandwidth {bandwidth:.1f} GB/s (read + write)")
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
                times = alternate([functools.partial(kernel, x) for kernel in kernels], args.runs)
                best = min(range(len(paths)), key=times.__getitem__)
                flops = 2 * rows * in_f * out_f
                line = f"{name:<9}{rows:>6}" + "".join(f"{t * 1e3:>12.3f}" for t in times)
                line += f"{paths[best]:>9}{flops / times[best] / 1e9:>8.1f}"
                if rows == 1:
                    gbs = [weight.numel() * weight.element_size() / t / 1e9 for t in times]
                    line += "  " + " / ".join(f"{v:.1f} GB/s = {v / bandwidth:.0%}" for v in gbs)
                print(line, flush=True)


if __name__ == "__main__":
    main()
