"""Decode on an NVIDIA GPU: one CUDA shard over gRPC, with CUDA graphs and without, against transformers on the
same GPU, with the fraction of the HBM bandwidth roofline; and W1's static-batching baseline.

For CUDA_GRAPHS=1,2,4,8,16,32 (TGI's default) and for none: a real shard on the 1b Llama (`build-test-model
--size 1b`), warmed up as the router warms it (which captures the graphs), then Prefill and DECODE_STEPS Decode
steps at batch 1, 8, 32 and 64, runs repeated. Per step: the wall time the client sees (what the router waits
for), the shard's own `total_ns`, and their difference (gRPC and the client's work per step). Then the same
decode in transformers in this process (a bare greedy loop over a DynamicCache), and the device's copy
bandwidth (1 GiB read and written, timed by CUDA events). Roofline fraction = bytes a step reads (weights but the
embedding table, plus the batch's keys and values) / the shard's step time / the copy bandwidth.

`--w1-static` instead times transformers `generate` on W1's 64 prompts as one static batch (left padded, every
row run to the longest max_new_tokens, only the tokens each request asked for counted), the baseline of
`benchmark/http_load.py --dtype bfloat16` on the same GPU.

Usage: python benchmark/gpu_decode.py [--model-dir DIR] [--batch 1 --batch 8 ...] [--runs 3] [--dtype bfloat16]
       python benchmark/gpu_decode.py --w1-static [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from textgen_benchmark.decode import bytes_per_step, progress
from textgen_benchmark.shard import cached_llama, start_shard, stop

PROMPT_LEN = 32
DECODE_STEPS = 64
GRAPHS = "1,2,4,8,16,32"  # TGI's default --cuda-graphs
MAX_TOTAL_TOKENS = 4096


@dataclass(frozen=True)
class Steps:
    """Median seconds per decode step: as the client saw it, and as the shard reported it (total_ns)."""

    wall: float
    shard: float


async def shard_steps(socket: str, model_dir: Path, batches: list[int], runs: int) -> dict[int, Steps]:
    from tokenizers import Tokenizer

    from textgen_benchmark.generation import Sampling, make_batch, prompt_of_length
    from textgen_router.backend import warmup_batch
    from textgen_router.shard_client import ShardedClient

    prompt = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    client = await ShardedClient.connect(socket)
    out: dict[int, Steps] = {}
    try:
        await client.clear_cache(None)
        batch = warmup_batch(MAX_TOTAL_TOKENS - 1, 4096, MAX_TOTAL_TOKENS, None)
        await client.warmup(batch, MAX_TOTAL_TOKENS - 1, 4096, MAX_TOTAL_TOKENS)
        for b in batches:
            batch = make_batch(prompt, b, PROMPT_LEN, DECODE_STEPS + 1, Sampling())
            walls: list[float] = []
            shard: list[float] = []
            for run in range(runs + 1):  # the first run warms up
                cached = (await client.prefill(batch)).batch
                while cached is not None:
                    start = time.perf_counter()
                    result = await client.decode([cached])
                    if run:
                        walls.append(time.perf_counter() - start)
                        shard.append(result.total_ns / 1e9)
                    cached = result.batch
                progress(f"shard batch size {b}: {f'run {run}/{runs}' if run else 'warmup'}")
            out[b] = Steps(statistics.median(walls), statistics.median(shard))
    finally:
        await client.close()
    return out


@torch.inference_mode()
def transformers_steps(model_dir: Path, batches: list[int], runs: int, dtype: torch.dtype) -> dict[int, float]:
    """Median seconds per decode step of a bare greedy loop over a DynamicCache on the GPU."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from textgen_benchmark.generation import prompt_of_length

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    text = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    prompt = AutoTokenizer.from_pretrained(model_dir)(text).input_ids[-PROMPT_LEN:]
    out: dict[int, float] = {}
    for b in batches:
        ids = torch.tensor([prompt] * b, device="cuda")
        times: list[float] = []
        for run in range(runs + 1):
            cache = DynamicCache()
            next_ids = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(DECODE_STEPS):
                logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
                next_ids = logits[:, -1].argmax(-1, keepdim=True)
                next_ids.tolist()  # a server reads each token back before the next step
            if run:
                times.append((time.perf_counter() - start) / DECODE_STEPS)
        out[b] = statistics.median(times)
        progress(f"transformers batch size {b}: done")
    del model
    torch.cuda.empty_cache()
    return out


def copy_bandwidth_gbs(gib: int = 1) -> float:
    """Best of 5 device-to-device copies of `gib` GiB, bytes read + written."""
    src = torch.ones(gib * 2**30 // 4, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / best / 1e9


def decode_table(model_dir: Path, batches: list[int], runs: int, dtype: str) -> None:
    uds = f"/tmp/textgen-gpu-bench-{os.getpid()}"
    shard: dict[str, dict[int, Steps]] = {}
    for name, graphs in (("graphs", GRAPHS), ("eager", None)):
        # TGI's attention on an H100 (flashinfer: blocks of one token)
        env = {"ATTENTION": "flashinfer", **({"CUDA_GRAPHS": graphs} if graphs else {})}
        proc = start_shard(model_dir, uds, threads=4, dtype=dtype, extra_env=env, timeout=600)
        try:
            shard[name] = asyncio.run(shard_steps(f"{uds}-0", model_dir, batches, runs))
        finally:
            stop(proc)
    local = transformers_steps(model_dir, batches, runs, getattr(torch, dtype))
    bandwidth = copy_bandwidth_gbs()
    itemsize = getattr(torch, dtype).itemsize
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s; {model_dir.name}, {dtype}")
    print(f"prompt {PROMPT_LEN}, {DECODE_STEPS} decode steps, runs {runs}; CUDA_GRAPHS={GRAPHS} vs none\n")
    print(
        "| batch | graphs tok/s | eager tok/s | transformers tok/s | graphs / transformers | shard step ms "
        "(graphs / eager) | client step ms (graphs) | roofline fraction (graphs) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        g, e = shard["graphs"][b], shard["eager"][b]
        fraction = bytes_per_step(model_dir, b, itemsize, PROMPT_LEN + DECODE_STEPS / 2) / g.shard / 1e9 / bandwidth
        print(
            f"| {b} | {b / g.wall:.0f} | {b / e.wall:.0f} | {b / local[b]:.0f} | {local[b] / g.wall:.2f} | "
            f"{g.shard * 1e3:.2f} / {e.shard * 1e3:.2f} | {g.wall * 1e3:.2f} | {fraction:.2f} |"
        )


@torch.inference_mode()
def w1_static(model_dir: Path, dtype: str, requests: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from textgen_benchmark.w1 import make_workload

    jobs = make_workload(str(model_dir), requests, 0, "burst", 4.0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda().eval()
    inputs = tokenizer([job.prompt for job in jobs], return_tensors="pt", padding=True).to("cuda")
    longest = max(job.max_new_tokens for job in jobs)
    for _ in range(2):  # the first warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    wanted = sum(job.max_new_tokens for job in jobs)
    print(
        f"transformers static batch of W1's {requests} prompts on {torch.cuda.get_device_name()} ({dtype}): "
        f"{seconds:.2f} s, {wanted / seconds:.1f} tok/s counting the {wanted} tokens asked for "
        f"({requests * longest / seconds:.1f} counting all {longest} per row)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a built model (default: build/cached 1b Llama)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 8, 32, 64)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--w1-static", action="store_true", help="transformers' static batch of W1's prompts")
    parser.add_argument("-n", "--requests", type=int, default=64, help="with --w1-static: W1's request count")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    model_dir = args.model_dir or cached_llama("1b")
    if args.w1_static:
        w1_static(model_dir, args.dtype, args.requests)
    else:
        decode_table(model_dir, args.batch or [1, 8, 32, 64], args.runs, args.dtype)


if __name__ == "__main__":
    main()
