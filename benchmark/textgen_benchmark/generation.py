"""The measured loop: Prefill then Decode-until-done of b identical requests, straight over gRPC to the shards.

Like TGI's benchmark it bypasses the router (no queue, no HTTP) and does not call Warmup: the shards are
expected to be warm already (started by a launcher, or warmed by the `--warmups` runs here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from textgen_benchmark.stats import BatchResult, RunSamples
from textgen_pb import generate_pb2
from textgen_router.shard_client import ShardedClient

LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et "
    "dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut aliquip ex "
    "ea commodo consequat. Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu "
    "fugiat nulla pariatur. Excepteur sint occaecat cupidatat non proident, sunt in culpa qui officia deserunt "
    "mollit anim id est laborum. "
)


@dataclass(frozen=True)
class Sampling:
    """Per-request generation parameters; the defaults are greedy, as in TGI's benchmark."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    do_sample: bool = False
    top_n_tokens: int = 0


def prompt_of_length(tokenizer: Tokenizer, sequence_length: int) -> str:
    """Lorem ipsum repeated, cut to its last `sequence_length` tokens and decoded back to text."""
    ids: list[int] = []
    text = LOREM
    while len(ids) < sequence_length:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        text += LOREM
    return tokenizer.decode(ids[-sequence_length:], skip_special_tokens=False)


def make_batch(
    prompt: str, batch_size: int, sequence_length: int, decode_length: int, sampling: Sampling
) -> generate_pb2.Batch:
    parameters = generate_pb2.NextTokenChooserParameters(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        typical_p=sampling.typical_p,
        do_sample=sampling.do_sample,
        seed=0,
        repetition_penalty=sampling.repetition_penalty,
        frequency_penalty=sampling.frequency_penalty,
        watermark=sampling.watermark,
    )
    stopping = generate_pb2.StoppingCriteriaParameters(max_new_tokens=decode_length, ignore_eos_token=True)
    requests = [
        generate_pb2.Request(
            id=i,
            inputs=prompt,
            input_chunks=generate_pb2.Input(chunks=[generate_pb2.InputChunk(text=prompt)]),
            truncate=sequence_length,
            parameters=parameters,
            stopping_parameters=stopping,
            prefill_logprobs=False,
            top_n_tokens=sampling.top_n_tokens,
            add_special_tokens=True,
        )
        for i in range(batch_size)
    ]
    return generate_pb2.Batch(
        id=0,
        requests=requests,
        size=batch_size,
        max_tokens=batch_size * (sequence_length + decode_length),
        max_blocks=0,
    )


async def run_once(
    client: ShardedClient, batch: generate_pb2.Batch, samples: RunSamples | None, sequence_length: int
) -> None:
    """One Prefill plus Decode calls until the shards return no batch; recorded into `samples` if given."""
    start = time.perf_counter()
    step = await client.prefill(batch)
    prefill_s = time.perf_counter() - start
    cached = step.batch
    calls = 0
    start = time.perf_counter()
    while cached is not None:
        cached = (await client.decode([cached])).batch
        calls += 1
    decode_s = time.perf_counter() - start
    if samples is None:
        return
    samples.prefill_s.append(prefill_s)
    samples.prefill_tps.append(batch.size * sequence_length / prefill_s)
    if calls:
        samples.decode_total_s.append(decode_s)
        samples.decode_token_s.append(decode_s / calls)
        samples.decode_tps.append(batch.size * calls / decode_s)


async def run_benchmark(
    client: ShardedClient,
    tokenizer: Tokenizer,
    batch_sizes: list[int],
    sequence_length: int,
    decode_length: int,
    runs: int,
    warmups: int,
    sampling: Sampling,
    progress: Callable[[str], None] = lambda _: None,
) -> list[BatchResult]:
    """Clear the shards' caches, then per batch size: `warmups` unmeasured runs and `runs` measured ones."""
    await client.clear_cache(None)
    prompt = prompt_of_length(tokenizer, sequence_length)
    results: list[BatchResult] = []
    for b in batch_sizes:
        batch = make_batch(prompt, b, sequence_length, decode_length, sampling)
        for i in range(warmups):
            progress(f"batch size {b}: warmup {i + 1}/{warmups}")
            await run_once(client, batch, None, sequence_length)
        samples = RunSamples(b)
        for i in range(runs):
            progress(f"batch size {b}: run {i + 1}/{runs}")
            await run_once(client, batch, samples, sequence_length)
        results.append(BatchResult.of(samples))
    return results
