"""A decoder layer's small ops on a CPU: the fused C++ ops of layers/fused_ops.cpp against the torch code they
replace (the fallback), and what float32 denormals cost a softmax.

For the small Llama's shapes (hidden 768, 12 heads of 64, MLP 2048) and each row count (1: a batch-1 decode
step; 64: a W1 decode step; 4096: a prefill), per dtype, it times in one process, alternately, the median ms of
one layer's worth of each op:

- `add + norm`: the residual add and the next RMSNorm (`RMSNorm.add`), twice per layer;
- `rotary`: RoPE of the query and key heads of the fused q/k/v output, in place;
- `silu * up`: the MLP's activation;
- `K/V write`: the step's keys and values into a paged pool of 16-token blocks.

With `--denormals` it times instead one layer's masked softmax of a bf16 prefill row (`--keys` queries over as
many keys): torch's softmax (the op's fallback) and `textgen::causal_softmax_bf16`, on scores spread like a
trained model's (standard normal) and spread wide (x `--wide`, as the random test models' scores are: many
exps land below 2^-126). The op flushes float32 denormals to zero while it runs; torch's softmax does only with
`--flush` (torch.set_flush_denormal before torch starts its threads, which inherit it).

    python benchmark/fused_ops.py [--rows 1 64 4096] [--threads 2] [--runs 21]
    python benchmark/fused_ops.py --denormals [--flush] [--keys 218] [--wide 45] [--threads 2] [--runs 21]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from textgen_benchmark.timing import alternate
from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.layers.norm import RMSNorm
from textgen_server.layers.paged_attention import write_kv
from textgen_server.layers.rotary import rotate_heads_

HIDDEN, HEADS, HEAD_DIM, MLP = 768, 12, 64, 2048
BLOCK = 16


def layer_ops(rows: int, dtype: torch.dtype, fused: bool) -> dict[str, Callable[[], object]]:
    """One layer's small ops on `rows` tokens, by the fused ops or by their torch code."""
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(rows, HIDDEN, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(torch.ones(HIDDEN, dtype=dtype), 1e-6)
    norm.fused = fused
    qkv = torch.randn(rows, 3 * HEADS * HEAD_DIM, generator=g).to(dtype)
    qk = qkv[:, : 2 * HEADS * HEAD_DIM].view(rows, -1, HEAD_DIM)
    k, v = (qkv[:, i * HEADS * HEAD_DIM : (i + 1) * HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM) for i in (1, 2))
    angles = torch.rand(rows, HEAD_DIM, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    gate_up = torch.randn(rows, 2 * MLP, generator=g).to(dtype)
    blocks = -(-rows // BLOCK) + 1
    pool = [torch.zeros(blocks, BLOCK, HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
    slots = torch.arange(BLOCK, BLOCK + rows)

    def silu_mul() -> torch.Tensor:
        if fused:
            return torch.ops.textgen.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    return {
        "add + norm": lambda: (norm.add(x, residual), norm.add(x, residual)),
        "rotary": lambda: rotate_heads_(qk, cos, sin, fused),
        "silu * up": silu_mul,
        "K/V write": lambda: write_kv(pool[0], pool[1], slots, k, v, fused),
    }


def compare_layer_ops(rows_list: list[int], runs: int) -> None:
    print("| dtype | rows | op | torch ms | fused ms | torch / fused |")
    print("|---|---:|---|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in rows_list:
            eager, fused = layer_ops(rows, dtype, False), layer_ops(rows, dtype, True)
            for name in eager:
                a, b = (t * 1e3 for t in alternate([eager[name], fused[name]], runs))
                print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {name} | {a:.3f} | {b:.3f} | {a / b:.1f} |")


def compare_softmax(keys: int, wide: float, runs: int) -> None:
    print("| scores | torch softmax ms | textgen::causal_softmax_bf16 ms |")
    print("|---|---:|---:|")
    mask = torch.ones(keys, keys, dtype=torch.bool).tril()
    for label, scale in (("standard normal", 1.0), (f"x {wide:g}", wide)):
        scores = (torch.randn(1, HEADS, keys, keys, generator=torch.Generator().manual_seed(1)) * scale).bfloat16()

        def by_torch(s: torch.Tensor = scores) -> torch.Tensor:
            return torch.softmax(s.float().masked_fill(~mask, float("-inf")), dim=-1).to(torch.bfloat16)

        def by_op(s: torch.Tensor = scores) -> torch.Tensor:
            return torch.ops.textgen.causal_softmax_bf16(s, 0, 0)

        a, b = (t * 1e3 for t in alternate([by_torch, by_op], runs))
        print(f"| {label} | {a:.3f} | {b:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--denormals", action="store_true")
    parser.add_argument("--keys", type=int, default=218)
    parser.add_argument("--wide", type=float, default=45.0)
    parser.add_argument("--flush", action="store_true")
    args = parser.parse_args(argv)
    if args.flush:
        torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    if not kernel_available():
        raise SystemExit("the C++ ops could not be built here (see the warning above)")
    with torch.inference_mode():
        if args.denormals:
            compare_softmax(args.keys, args.wide, args.runs)
        else:
            compare_layer_ops(args.rows, args.runs)


if __name__ == "__main__":
    main()
