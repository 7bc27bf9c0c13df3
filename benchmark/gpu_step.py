"""Where a decode step's time goes on an NVIDIA GPU: the paged engine in this process, no gRPC.

For each batch size: the median wall time of `generate_token` (what the shard's `total_ns` counts but the
response's serialisation), of its parts timed alone (the step's inputs put on the device, the CUDA graph's replay,
the token choice), and torch.profiler's busiest operators over PROFILED_STEPS steps, by host time and by device
time. The graph's replay reads the weights once: its time against the copy bandwidth is the step's floor.

Usage: python benchmark/gpu_step.py [--model-dir DIR] [--batch 1 --batch 32 ...] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from textgen_benchmark.shard import cached_llama

if TYPE_CHECKING:
    from textgen_server.models.paged_lm import PagedCausalLM

GRAPHS = "1,2,4,8,16,32"  # TGI's default --cuda-graphs
MAX_TOTAL_TOKENS = 4096
PROMPT_LEN = 32
STEPS = 50
PROFILED_STEPS = 10


def median_ms(run: Callable[[], object], times: int = STEPS) -> float:
    """Median wall milliseconds of `run()` followed by a device sync."""
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a built model (default: build/cached 1b Llama)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1 and 32)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    from tokenizers import Tokenizer

    from textgen_benchmark.generation import prompt_of_length
    from textgen_router.backend import warmup_batch
    from textgen_server.config import ServeConfig
    from textgen_server.loader import get_model
    from textgen_server.models.paged_lm import PagedCausalLM

    model_dir = args.model_dir or cached_llama("1b")
    model = get_model(ServeConfig(str(model_dir), dtype=args.dtype, attention="flashinfer", cuda_graphs=GRAPHS))
    warm = model.batch_type.from_pb(warmup_batch(MAX_TOTAL_TOKENS - 1, 4096, MAX_TOTAL_TOKENS, None), model)
    model.warmup(warm, MAX_TOTAL_TOKENS - 1, MAX_TOTAL_TOKENS, 4096)
    assert isinstance(model, PagedCausalLM) and model.graphs is not None, "CUDA graphs on the paged engine"
    prompt = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    print(f"{torch.cuda.get_device_name()}, {model_dir.name}, {args.dtype}, CUDA_GRAPHS={GRAPHS}")
    for size in args.batch or [1, 32]:
        measure(model, prompt, size)


def measure(model: PagedCausalLM, prompt: str, size: int) -> None:
    """Print the step's parts at batch `size` and the profiler's tables."""
    from torch.profiler import ProfilerActivity, profile

    from textgen_benchmark.generation import Sampling, make_batch
    from textgen_server.models.paged_lm import _choose_rows

    assert model.graphs is not None
    pb = make_batch(prompt, size, PROMPT_LEN, 3 * STEPS + 4 * PROFILED_STEPS, Sampling())
    batch = model.batch_type.from_pb(pb, model)

    def step() -> None:
        nonlocal batch
        cached = model.generate_token(batch)[1]
        assert cached is not None, "max_new_tokens outlasts every step here"
        batch = cached

    step()  # the prefill

    step_ms = median_ms(step)
    inputs_ms = median_ms(lambda: model._step(batch))
    key = model.graphs.key(size, max(batch.cache_lengths) + 1)
    assert key is not None, f"no graph holds {size} rows"
    replay = model.graphs._graphs[key]
    replay_ms = median_ms(replay)
    logits = replay()[:size]
    rows = list(range(size))
    last = [ids[-1] for ids in batch.all_input_ids]
    choose_ms = median_ms(lambda: _choose_rows(batch, rows, last, logits, rows))
    print(
        f"\nbatch {size}: generate_token {step_ms:.2f} ms; alone: inputs {inputs_ms:.2f}, graph replay "
        f"{replay_ms:.2f} (graph {key}), token choice {choose_ms:.2f} ms"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
    print(table.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=48))


if __name__ == "__main__":
    main()
