"""The v3 engine end to end: the router's block allocator and prefix cache driving real paged shards.

Oracle: every request's greedy tokens equal transformers `generate` on its prompt alone, with the prefix cache
on and off, on one shard and two, with prompts prefilled whole or in chunks, and when the cache must evict.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inference_harness import Run, collect, router_config
from inference_harness import valid as short_valid

from testing.shards import ShardProcess
from textgen_router.backend import Backend, connect_backend
from textgen_router.block_allocator import RadixAllocator
from textgen_router.config import RouterConfig
from textgen_router.types import EndEvent, PrefillEvent, StoppingParameters, ValidRequest

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You are a helpful assistant. Answer the question in one short sentence, then stop. " * 3
QUESTIONS = ["What is a cat?", "Name a red fruit.", "Why is the sky blue?", "Count to three.", "Say hi."]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One shard group and router configuration the tests run against."""

    name: str
    prefix_caching: bool = True
    num_shard: int = 1
    prefill_tokens: int = 1024  # the router's --max-batch-prefill-tokens (small: prompts go in chunks)
    pool_tokens: int | None = None  # TEXTGEN_KV_CACHE_TOKENS (small: the prefix cache must evict)
    attention: str = "paged"

    def config(self) -> RouterConfig:
        return router_config(max_input_tokens=400, max_total_tokens=512, max_batch_prefill_tokens=self.prefill_tokens)

    def env(self) -> dict[str, str]:
        # REQUEST_LOGPROBS: the shards compute the prompt logprobs test_prompt_logprobs_skip_the_prefix_cache asks.
        env = {"PREFIX_CACHING": "1" if self.prefix_caching else "0", "ATTENTION": self.attention}
        env["REQUEST_LOGPROBS"] = "1"
        if self.pool_tokens is not None:
            env["TEXTGEN_KV_CACHE_TOKENS"] = str(self.pool_tokens)
        return env


SETUPS = [
    Setup("cache"),
    Setup("no-cache", prefix_caching=False),
    Setup("cache-2-shards", num_shard=2),
    Setup("cache-chunked-blocks-of-1", prefill_tokens=32, attention="flashinfer"),
    Setup("cache-small-pool", pool_tokens=768, prefill_tokens=256),
]


def valid(oracle: Any, text: str, max_new_tokens: int) -> ValidRequest:
    """The request the router builds for `text`, untruncated (the prompts here exceed the harness's 64 tokens)."""
    return dataclasses.replace(short_valid(oracle, text, max_new_tokens), truncate=400)


@pytest.fixture(scope="module", params=SETUPS, ids=[s.name for s in SETUPS])
def setup(request: pytest.FixtureRequest) -> Setup:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def backend(setup: Setup, tiny_llama: Path, run: Run) -> Iterator[Backend]:
    with ShardProcess(tiny_llama, num_shard=setup.num_shard, env=setup.env()) as shards:
        backend = run(connect_backend(shards.socket, setup.config()))
        try:
            yield backend
        finally:
            run(backend.close())


def test_shards_report_the_engine(backend: Backend, setup: Setup) -> None:
    info = backend.info
    assert not info.requires_padding and info.support_chunking
    assert info.use_prefix_caching == setup.prefix_caching
    assert isinstance(backend.infer.queue.allocator, RadixAllocator) == setup.prefix_caching
    if setup.pool_tokens is not None:
        assert backend.max_batch_total_tokens == setup.pool_tokens


def test_a_burst_sharing_a_system_prompt(backend: Backend, setup: Setup, oracle: Any, run: Run) -> None:
    """One request caches the system prompt, then a burst shares it (each with its own question)."""
    first = valid(oracle, SYSTEM + "Hello?", 6)
    burst = [valid(oracle, SYSTEM + q + f" ({i})", 4 + i % 5) for i, q in enumerate(QUESTIONS * 3)]

    async def scenario() -> tuple[list[int], list[list[int]]]:
        alone = await collect(backend.infer, first)
        return alone, await asyncio.gather(*(collect(backend.infer, r) for r in burst))

    alone, results = run(scenario())
    assert alone == oracle(first.inputs, 6)
    for request, got in zip(burst, results, strict=True):
        assert got == oracle(request.inputs, request.stopping_parameters.max_new_tokens), request.inputs
    allocator = backend.infer.queue.allocator
    if isinstance(allocator, RadixAllocator) and setup.pool_tokens is None:
        # The system prompt's blocks are cached: a new request sharing it starts from them.
        probe = allocator.allocate(len(first.input_ids) + 8, first.input_ids)
        assert probe is not None and probe.prefix_len >= len(oracle.tokenizer(SYSTEM).input_ids) // 2
        probe.release(cache_prompt=False)


def test_a_request_stopped_by_a_stop_sequence_then_one_sharing_its_prompt(
    backend: Backend, oracle: Any, run: Run
) -> None:
    """vLLM #5543: a request that stopped early must leave correct KV for the prompt it shares."""
    text = SYSTEM + "Tell a story."
    full = oracle(text, 12)
    stop = oracle.tokenizer.decode(full[:3])[-3:]
    stopped = dataclasses.replace(
        valid(oracle, text, 12), stopping_parameters=StoppingParameters(max_new_tokens=12, stop_sequences=[stop])
    )
    got = run(collect(backend.infer, stopped))
    assert len(got) < 12 and got == full[: len(got)]
    follower = valid(oracle, text + " And another one.", 8)
    assert run(collect(backend.infer, follower)) == oracle(follower.inputs, 8)


def test_prompt_logprobs_skip_the_prefix_cache(backend: Backend, oracle: Any, run: Run) -> None:
    """A request asking for its prompt's logprobs computes every prompt token, even with its prefix cached."""
    text = SYSTEM + "What is a cat?"
    run(collect(backend.infer, valid(oracle, text, 2)))  # cached now (with the cache on)
    request = dataclasses.replace(valid(oracle, text, 3), decoder_input_details=True)

    async def prefill_tokens() -> tuple[list[int], list[float]]:
        ids: list[int] = []
        logprobs: list[float] = []
        async for event in backend.infer.generate_stream(request):
            if isinstance(event, PrefillEvent):
                ids, logprobs = [t.id for t in event.tokens], [t.logprob for t in event.tokens]
            if isinstance(event, EndEvent):
                break
        return ids, logprobs

    ids, logprobs = run(prefill_tokens())
    assert ids == request.input_ids
    assert all(lp <= 0 for lp in logprobs[1:])  # a real logprob for every prompt token after the first


def test_many_distinct_prompts_then_the_first_again(backend: Backend, oracle: Any, run: Run) -> None:
    """More distinct prompts than a small pool caches: the trie evicts, and every answer stays right."""
    prompts = [
        f"Document {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][i % 4 :]) * (4 + i % 3) for i in range(12)
    ]
    requests = [valid(oracle, p, 5) for p in prompts]

    async def scenario() -> list[list[int]]:
        results = []
        for group in (requests[:4], requests[4:8], requests[8:], requests[:2]):
            results += await asyncio.gather(*(collect(backend.infer, r) for r in group))
        return results

    results = run(scenario())
    for request, got in zip(requests + requests[:2], results, strict=True):
        assert got == oracle(request.inputs, 5), request.inputs
