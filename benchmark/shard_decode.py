"""Shard decode throughput against in-process transformers on the ~110M "small" Llama (`make bench`).

One real `textgen-server serve` process (fp32, 2 threads) on a unix socket is driven over gRPC: Prefill, then
Decode until done, at batch 1, 8 and 32. The shard is then stopped and the same model runs in this process
(same threads, batch, prompt length and new tokens: a bare greedy loop over a DynamicCache, the fastest a
transformers caller can go), so the ratio isolates what the serving path costs per decode step. Decode is
memory-bound at small batch, so each row also shows the fraction of a bandwidth roofline: bytes read per step
(weights except the embedding table, plus the batch's KV cache) over a measured copy bandwidth.

With --grammar the shard is measured against itself instead: the same decode with every row under its own JSON
schema vs no grammar (runs alternate between the two), plus the time to compile a schema for one request.

With `--lora-adapters N` it measures multi-LoRA serving instead: the shard loads N seeded random adapters
(rank 8, every q/k/v/o and gate/up/down projection) and the same decode runs once with every row on the base
model and once with the rows spread over the N adapters in turn (neighbouring rows on different adapters).

With `--quantize gptq | gptq-8 | awq | eetq` it measures quantized weights: the model quantized by
`textgen_server.quant_builder` (round-to-nearest, `--group-size`, 128 by default; eetq: the float model with
`--quantize eetq`; `--lm-head`: gptq with the LM head quantized too, as GPTQModel's `lm_head` option writes it)
in a bfloat16 shard, against the float model's float32 and bfloat16 shards, runs alternating, with the quantized
step's fraction of the bandwidth roofline.

With `--speculate N` it measures n-gram speculation: one shard with `--speculate N` against one without, runs
alternating, tokens/s per row and the tokens a step emits. On the random model guesses are nearly always refused
(the cost of guessing); with `--cycling` the model is first made to loop (builder.build_cycling_model), so every
guess after the first period is confirmed (the gain at best).

With `--peer GGUF` it measures batch 1 against llama.cpp (issue 42's peer): llama.cpp's `llama-bench` (`--llama-bench`;
by default where ../shared/tools/llama-cpp-peer.sh builds it) on GGUF, the same model converted by that script,
with the issue's command (`-p 0 -n 64 -r 3`, the same threads), runs alternating with the shard's: llama.cpp,
textgen, llama.cpp, ... Each textgen run is divided by the mean of the llama.cpp runs either side of it, so a
drift of the host's speed within minutes (20-40% on the 2-core VMs) moves both sides of a ratio.

With `--decode-ahead` it measures the shard's decode ahead (server/textgen_server/decode_ahead.py): two shards
started side by side, one as served (decode ahead on) and one with TEXTGEN_DECODE_AHEAD=0, runs alternating
between them, and the ratio of step times per pair of runs.

Usage: python benchmark/shard_decode.py [--batch 1 --batch 8 ...] [--runs 3] [--threads 2] [--model-dir DIR]
       [--grammar | --lora-adapters N | --speculate N [--cycling] | --quantize gptq|gptq-8|awq|eetq [--lm-head]
       | --decode-ahead | --peer GGUF [--llama-bench PATH]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import time
from pathlib import Path

import torch

from textgen_benchmark.decode import (
    NEW_TOKENS,
    PROMPT_LEN,
    Step,
    bytes_per_step,
    copy_bandwidth_gbs,
    kv_bytes_per_step,
    progress,
    shard_steps,
)
from textgen_benchmark.peer import LLAMA_BENCH, bracketed_ratios, llama_bench_tokens_per_second
from textgen_benchmark.shard import DTYPES, small_model, start_shard, stop
from textgen_server.config import DECODE_AHEAD_ENV as AHEAD_ENV
from textgen_server.models.cache_names import cache_keyword

# The shard's runs in each of its turns against llama.cpp: the median step of three, as `make bench --runs 3`.
PEER_SHARD_RUNS = 3
# The modes --peer does not combine with: flag -> its argparse attribute.
OTHER_MODES = {
    "--grammar": "grammar",
    "--lora-adapters": "lora_adapters",
    "--speculate": "speculate",
    "--quantize": "quantize",
    "--decode-ahead": "decode_ahead",
}


@torch.inference_mode()
def inprocess_steps(
    model_dir: Path, batches: list[int], runs: int, threads: int, dtype: torch.dtype = torch.float32
) -> dict[int, Step]:
    """The same decode in transformers in this process: a bare greedy loop over a DynamicCache."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from textgen_benchmark.generation import prompt_of_length

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    keyword = cache_keyword(model)
    text = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    # The shard tokenizes with special tokens and keeps the last `truncate` ids: do exactly the same.
    prompt = AutoTokenizer.from_pretrained(model_dir)(text).input_ids[-PROMPT_LEN:]
    out: dict[int, Step] = {}
    for b in batches:
        ids = torch.tensor([prompt] * b)
        walls: list[float] = []
        cpus: list[float] = []
        for run in range(runs + 1):  # the first run warms up
            cache = DynamicCache()
            logits = model(input_ids=ids, use_cache=True, **{keyword: cache}).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
            cpu, start = time.process_time(), time.perf_counter()
            for _ in range(NEW_TOKENS - 1):
                logits = model(input_ids=next_ids, use_cache=True, **{keyword: cache}).logits
                next_ids = logits[:, -1].argmax(-1, keepdim=True)
            if run:
                walls.append((time.perf_counter() - start) / (NEW_TOKENS - 1))
                cpus.append((time.process_time() - cpu) / (NEW_TOKENS - 1))
            progress(f"in-process batch size {b}: {f'run {run}/{runs}' if run else 'warmup'}")
        out[b] = Step(statistics.median(walls), statistics.median(cpus))
    return out


def json_schemas(n: int) -> list[str]:
    """n distinct schemas (so every request compiles its own), shaped like a tool call's arguments."""
    return [
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24 + i},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"enum": ["Paris", "Lima", "Oslo", "Kyoto"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                },
                "required": ["name", "age", "city", "tags"],
            }
        )
        for i in range(n)
    ]


def grammar_costs(model_dir: Path, schemas: list[str]) -> tuple[float, float, float, float]:
    """In this process, on the model's tokenizer, in seconds: wrapping the tokenizer (once per shard), compiling a
    new schema, starting a request whose schema was compiled before, and one step's grammar work for a batch of
    one request per schema (mask, applied to the logits, then every matcher advanced)."""
    from transformers import AutoTokenizer

    from textgen_pb import generate_pb2
    from textgen_server.sampling.grammar import GrammarCompiler, RowGrammars

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, {tokenizer.eos_token_id})
    wrap = time.perf_counter() - start
    params = [
        generate_pb2.NextTokenChooserParameters(grammar=s, grammar_type=generate_pb2.GRAMMAR_TYPE_JSON) for s in schemas
    ]
    start = time.perf_counter()
    for p in params:
        compiler.compile(p)
    new = (time.perf_counter() - start) / len(params)
    start = time.perf_counter()
    matchers = [compiler.compile(p) for p in params]
    cached = (time.perf_counter() - start) / len(params)
    grammars = RowGrammars.of(list(matchers), compiler, torch.device("cpu"))
    assert grammars is not None
    scores = torch.randn(len(params), len(tokenizer))
    start = time.perf_counter()
    for _ in range(NEW_TOKENS):
        grammars.advance(grammars.mask(scores).argmax(-1))
    return wrap, new, cached, (time.perf_counter() - start) / NEW_TOKENS


def grammar_steps(model_dir: Path, batches: list[int], runs: int, threads: int, dtype: str) -> None:
    """Decode steps with every row under a JSON schema vs no grammar, on one shard, runs alternating."""
    schemas = json_schemas(max(batches))
    uds = f"/tmp/textgen-bench-{os.getpid()}"
    proc = start_shard(model_dir, uds, threads, dtype=dtype)
    free: list[dict[int, Step]] = []
    constrained: list[dict[int, Step]] = []
    try:
        for _ in range(runs):
            free.append(asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, 1)))
            constrained.append(asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, 1, schemas=schemas)))
    finally:
        stop(proc)
    torch.set_num_threads(threads)
    wrap, new, cached, step = grammar_costs(model_dir, schemas[: max(batches)])
    print(
        f"tokenizer wrapped once per shard: {wrap * 1e3:.1f} ms; a new schema compiles in {new * 1e3:.2f} ms per "
        f"request; a request whose schema is cached starts in {cached * 1e6:.0f} us; grammar work of a "
        f"batch-{max(batches)} step in this process: {step * 1e3:.2f} ms\n"
    )
    print("| batch | free ms/step | JSON ms/step | ratio | ratio (CPU) |")
    print("|------:|-------------:|-------------:|------:|------------:|")
    for b in batches:
        f_wall, f_cpu = (statistics.median(getattr(r[b], k) for r in free) for k in ("wall", "cpu"))
        c_wall, c_cpu = (statistics.median(getattr(r[b], k) for r in constrained) for k in ("wall", "cpu"))
        print(f"| {b} | {f_wall * 1e3:.1f} | {c_wall * 1e3:.1f} | {c_wall / f_wall:.3f} | {c_cpu / f_cpu:.3f} |")


def speculation_steps(model_dir: Path, batches: list[int], runs: int, threads: int, dtype: str, n: int) -> None:
    """Decode tokens/s of a shard guessing `n` tokens against one that does not, one shard at a time, runs
    alternating."""
    uds = f"/tmp/textgen-bench-{os.getpid()}"
    plain: list[dict[int, Step]] = []
    guessing: list[dict[int, Step]] = []
    for _ in range(runs):
        for extra, results in (((), plain), (("--speculate", str(n)), guessing)):
            proc = start_shard(model_dir, uds, threads, dtype=dtype, extra_args=extra)
            try:
                results.append(asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, 1)))
            finally:
                stop(proc)
    print(f"| batch | plain tok/s | --speculate {n} tok/s | ratio | ratio (CPU) | tokens fed / emitted per step |")
    print("|------:|------------:|------------------:|------:|------------:|------------------------------:|")
    for b in batches:
        p_wall, p_cpu = (statistics.median(getattr(r[b], k) for r in plain) for k in ("wall", "cpu"))
        g_wall, g_cpu = (statistics.median(getattr(r[b], k) for r in guessing) for k in ("wall", "cpu"))
        tokens, fed = (statistics.median(getattr(r[b], k) for r in guessing) for k in ("tokens", "fed"))
        # CPU time is counted in ticks: a tiny model's few steps may take none.
        cpu_ratio = p_cpu / g_cpu if g_cpu else float("nan")
        print(
            f"| {b} | {b / p_wall:.1f} | {b / g_wall:.1f} | {p_wall / g_wall:.2f} | {cpu_ratio:.2f} | "
            f"{fed:.2f} / {tokens:.2f} |"
        )


def ahead_steps(model_dir: Path, batches: list[int], runs: int, threads: int, dtype: str) -> None:
    """Decode step times of a shard that decodes ahead against one that does not, both up at once (the host's
    speed drifts within minutes), runs alternating; the median and spread of the per-pair ratios."""
    shards = {}
    try:
        for name, flag in (("off", "0"), ("on", "1")):
            uds = f"/tmp/textgen-bench-{name}-{os.getpid()}"
            shards[name] = (uds, start_shard(model_dir, uds, threads, dtype=dtype, extra_env={AHEAD_ENV: flag}))
        results: dict[str, list[dict[int, Step]]] = {"off": [], "on": []}
        for _ in range(runs):
            for name, (uds, proc) in shards.items():
                results[name].append(asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, 1)))
    finally:
        for _, proc in shards.values():
            stop(proc)
    print("| batch | off ms/step | on ms/step | on/off per pair: median (least-most) |")
    print("|------:|------------:|-----------:|-------------------------------------:|")
    for b in batches:
        off, on = ([r[b].wall for r in results[name]] for name in ("off", "on"))
        ratios = sorted(y / x for x, y in zip(off, on, strict=True))
        print(
            f"| {b} | {statistics.median(off) * 1e3:.2f} | {statistics.median(on) * 1e3:.2f} | "
            f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) |"
        )


def peer_steps(model_dir: Path, runs: int, threads: int, dtype: str, gguf: Path, binary: Path) -> None:
    """Batch-1 decode rate of a shard against llama-bench's on `gguf`, runs alternating (llama.cpp first and
    last); the per-run ratios over the llama.cpp runs either side, their median and spread."""
    uds = f"/tmp/textgen-bench-peer-{os.getpid()}"
    proc = start_shard(model_dir, uds, threads, dtype=dtype)
    ours: list[float] = []
    peers = [llama_bench_tokens_per_second(binary, gguf, threads)]
    try:
        for _ in range(runs):
            steps = asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, [1], PEER_SHARD_RUNS))
            ours.append(1 / steps[1].wall)
            peers.append(llama_bench_tokens_per_second(binary, gguf, threads))
    finally:
        stop(proc)
    ratios = bracketed_ratios(ours, peers)
    print(f"peer: {binary} on {gguf}\n")
    print("| run | textgen tok/s | llama.cpp tok/s before / after | textgen / llama.cpp |")
    print("|----:|--------------:|-------------------------------:|--------------------:|")
    for i, (x, r) in enumerate(zip(ours, ratios, strict=True)):
        print(f"| {i + 1} | {x:.1f} | {peers[i]:.1f} / {peers[i + 1]:.1f} | {r:.3f} |")
    print(
        f"\nbatch 1: textgen {statistics.median(ours):.1f} tok/s, llama.cpp {statistics.median(peers):.1f} tok/s "
        f"(medians); textgen / llama.cpp per run {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )


# The decoder projections, which eetq quantizes at load.
PROJECTION = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def quantized_bytes_per_step(model_dir: Path, batch: int, float_itemsize: int, at_load: bool) -> float:
    """Bytes one decode step reads of quantized weights: the projections as stored (packed integers, float16
    scales; the int4 kernel reads the same 4 bits a weight in its own layout) or, quantized at load (`at_load`,
    eetq), one byte a projection weight; the float tensors at `float_itemsize`, the embedding table only gathered,
    plus the batch's K and V."""
    from safetensors import safe_open

    weights = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "embed_tokens" in name or name.endswith(".g_idx"):
                continue
            part = f.get_slice(name)
            itemsize = {"I32": 4, "F16": 2}.get(part.get_dtype(), float_itemsize)
            if at_load and PROJECTION.search(name):  # eetq keeps the LM head and the embeddings float, as TGI
                itemsize = 1
            weights += math.prod(part.get_shape()) * itemsize
    return weights + kv_bytes_per_step(model_dir, batch, float_itemsize)


def quantized_steps(
    model_dir: Path,
    batches: list[int],
    runs: int,
    threads: int,
    method: str,
    group_size: int = 128,
    lm_head: bool = False,
) -> None:
    """Decode tokens/s of the model quantized with `method` (a bfloat16 shard, the CPU default for quantized
    weights; `lm_head`: its LM head too) against the same float model in float32 and in bfloat16, one shard at a
    time, runs alternating."""
    from textgen_server.quant_builder import QUANT_BUILDER_VERSION, quantize_model_dir

    method, _, bits = method.partition("-")
    at_load = method == "eetq"
    qdir = (
        model_dir
        if at_load
        else quantize_model_dir(
            model_dir,
            model_dir.with_name(
                f"{model_dir.name}-{method}{bits or 4}-g{group_size}{'-head' if lm_head else ''}"
                f"-q{QUANT_BUILDER_VERSION}"
            ),
            method,
            bits=int(bits or 4),
            group_size=group_size,
            lm_head=lm_head,
        )
    )
    flags = ("--quantize", "eetq") if at_load else ()
    uds = f"/tmp/textgen-bench-{os.getpid()}"
    setups = {
        "float32": (model_dir, "float32", ()),
        "bfloat16": (model_dir, "bfloat16", ()),
        method: (qdir, "bfloat16", flags),
    }
    results: dict[str, list[dict[int, Step]]] = {name: [] for name in setups}
    for _ in range(runs):
        for name, (directory, dtype, extra) in setups.items():
            proc = start_shard(directory, uds, threads, dtype=dtype, extra_args=extra)
            try:
                results[name].append(asyncio.run(shard_steps(f"{uds}-0", proc.pid, directory, batches, 1)))
            finally:
                stop(proc)
    bandwidth = copy_bandwidth_gbs(threads)
    print(f"quantized: {qdir} {' '.join(flags)}\ncopy bandwidth ({threads} threads): {bandwidth:.1f} GB/s\n")
    print(f"| batch | float32 tok/s | bfloat16 tok/s | {method} tok/s | vs float32 | vs bfloat16 | {method} roofline |")
    print("|------:|------:|------:|------:|------:|------:|------:|")
    for b in batches:
        wall = {name: statistics.median(r[b].wall for r in results[name]) for name in setups}
        roofline = quantized_bytes_per_step(qdir, b, 2, at_load) / wall[method] / 1e9 / bandwidth
        print(
            f"| {b} | {b / wall['float32']:.1f} | {b / wall['bfloat16']:.1f} | {b / wall[method]:.1f} | "
            f"{wall['float32'] / wall[method]:.2f} | {wall['bfloat16'] / wall[method]:.2f} | {roofline:.2f} |"
        )


def check_peer(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--peer's inputs: llama-bench and the GGUF file there, batch 1 only (llama-bench decodes one sequence), the
    float model alone; --llama-bench only with it."""
    if args.peer is None:
        if args.llama_bench is not None:
            parser.error("--llama-bench goes with --peer")
        return
    others = [flag for flag, on in OTHER_MODES.items() if getattr(args, on)]
    if others:
        parser.error(f"--peer measures the model as it is, not with {', '.join(others)}")
    args.llama_bench = args.llama_bench or LLAMA_BENCH
    if not args.llama_bench.is_file():
        parser.error(f"no llama-bench at {args.llama_bench}: build it with ../shared/tools/llama-cpp-peer.sh")
    if not args.peer.is_file():
        parser.error(f"no GGUF file at {args.peer}: ../shared/tools/llama-cpp-peer.sh writes one per model")
    if args.batch not in (None, [1]):
        parser.error("--peer measures batch 1 (llama-bench decodes one sequence)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 8, 32)")
    parser.add_argument("--runs", type=int, default=3)
    # 2 threads on the 2-core target; on a shared, oversubscribed machine OpenMP threads that wait for a
    # descheduled sibling spin, so --threads 1 gives the more stable figures there.
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, help="a built model (default: build/cached small Llama)")
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="the shard's --dtype, and the in-process model's"
    )
    parser.add_argument(
        "--grammar", action="store_true", help="every row under a JSON schema vs no grammar (default batch 32)"
    )
    parser.add_argument("--lora-adapters", type=int, default=0, metavar="N", help="base vs N adapters mixed")
    parser.add_argument("--speculate", type=int, default=0, metavar="N", help="a shard guessing N tokens vs none")
    parser.add_argument("--cycling", action="store_true", help="with --speculate: the model made to loop")
    parser.add_argument("--decode-ahead", action="store_true", help="a shard decoding ahead vs one that does not")
    parser.add_argument(
        "--quantize",
        choices=("gptq", "gptq-8", "awq", "eetq"),
        help="the model quantized (round-to-nearest; eetq: at load) against its float shards",
    )
    parser.add_argument("--group-size", type=int, default=128, help="with --quantize: the quantization groups")
    parser.add_argument("--lm-head", action="store_true", help="with --quantize gptq: the LM head quantized too")
    parser.add_argument(
        "--peer", type=Path, metavar="GGUF", help="batch 1 against llama.cpp's llama-bench on GGUF, runs alternating"
    )
    parser.add_argument("--llama-bench", type=Path, help=f"with --peer: the llama-bench binary ({LLAMA_BENCH})")
    args = parser.parse_args(argv)
    check_peer(parser, args)
    if args.lm_head and (args.quantize or "").partition("-")[0] != "gptq":
        parser.error("--lm-head goes with --quantize gptq or gptq-8")
    dtype = getattr(torch, args.dtype)
    model_dir = args.model_dir or small_model()
    if args.cycling:
        from textgen_server.builder import build_cycling_model

        model_dir = build_cycling_model(model_dir, model_dir.with_name(model_dir.name + "-cycling"))
    batches = args.batch or ([32] if args.grammar else [1, 8, 32])
    uds = f"/tmp/textgen-bench-{os.getpid()}"
    if args.lora_adapters:
        lora_comparison(model_dir, uds, batches, args)
        return
    print(
        f"model {model_dir}, {args.dtype}, {args.threads} threads, prompt {PROMPT_LEN}, new tokens {NEW_TOKENS}, "
        f"runs {args.runs}",
        flush=True,
    )
    if args.grammar:
        grammar_steps(model_dir, batches, args.runs, args.threads, args.dtype)
        return
    if args.quantize:
        quantized_steps(model_dir, batches, args.runs, args.threads, args.quantize, args.group_size, args.lm_head)
        return
    if args.speculate:
        speculation_steps(model_dir, batches, args.runs, args.threads, args.dtype, args.speculate)
        return
    if args.decode_ahead:
        ahead_steps(model_dir, batches, args.runs, args.threads, args.dtype)
        return
    if args.peer is not None:
        peer_steps(model_dir, args.runs, args.threads, args.dtype, args.peer, args.llama_bench)
        return
    proc = start_shard(model_dir, uds, args.threads, dtype=args.dtype)
    try:
        shard = asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, args.runs))
    finally:
        stop(proc)
    local = inprocess_steps(model_dir, batches, args.runs, args.threads, dtype)
    bandwidth = copy_bandwidth_gbs(args.threads)
    print(f"copy bandwidth ({args.threads} threads): {bandwidth:.1f} GB/s\n")
    # ratio = shard tokens/s over in-process tokens/s (target >= 0.9); "CPU" columns use CPU seconds per step,
    # which other processes on the machine disturb far less than wall time.
    print("| batch | shard tok/s | in-process tok/s | ratio | ratio (CPU) | shard GB/s | roofline fraction |")
    print("|------:|------------:|-----------------:|------:|------------:|-----------:|------------------:|")
    for b in batches:
        gbs = bytes_per_step(model_dir, b, dtype.itemsize) / shard[b].wall / 1e9
        print(
            f"| {b} | {b / shard[b].wall:.1f} | {b / local[b].wall:.1f} | {local[b].wall / shard[b].wall:.2f} | "
            f"{local[b].cpu / shard[b].cpu:.2f} | {gbs:.1f} | {gbs / bandwidth:.2f} |"
        )


def lora_comparison(model_dir: Path, uds: str, batches: list[int], args: argparse.Namespace) -> None:
    """Decode tokens/s with every row on the base model, then with the rows spread over N adapters."""
    from textgen_server.builder import build_test_adapter

    names = [f"lora{i}" for i in range(args.lora_adapters)]
    dirs = [
        build_test_adapter(model_dir.parent / f"{model_dir.name}-{name}", model_dir, seed=i)
        for i, name in enumerate(names)
    ]
    spec = ",".join(f"{name}={path}" for name, path in zip(names, dirs, strict=True))
    print(
        f"model {model_dir}, {args.dtype}, {args.threads} threads, prompt {PROMPT_LEN}, new tokens {NEW_TOKENS}, "
        f"runs {args.runs}, {len(names)} LoRA adapters of rank 8",
        flush=True,
    )
    proc = start_shard(model_dir, uds, args.threads, dtype=args.dtype, extra_env={"LORA_ADAPTERS": spec})
    try:
        base = asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, args.runs))
        mixed = asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, args.runs, adapters=names))
    finally:
        stop(proc)
    print(f"| batch | base model tok/s | {len(names)} adapters mixed tok/s | ratio | ratio (CPU) |")
    print("|------:|-----------------:|------------------------:|------:|------------:|")
    for b in batches:
        print(
            f"| {b} | {b / base[b].wall:.1f} | {b / mixed[b].wall:.1f} | {base[b].wall / mixed[b].wall:.2f} | "
            f"{base[b].cpu / mixed[b].cpu:.2f} |"
        )


if __name__ == "__main__":
    main()
