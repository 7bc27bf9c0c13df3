"""A shard process driven over gRPC the way TGI v3's router drives it: blocks and slots from an allocator, a
prefix-cache hit (`cache_len`), a prompt split in chunks (`chunk_len`, then Prefill with `cached_batch`).

The generate.v3 messages are the contract: a TGI router must be able to run our shard and get the same
tokens as transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shard_helpers import HFOracle, make_batch, make_request, record

from testing.shards import ShardProcess
from textgen_pb import generate_pb2 as pb

BLOCK_SIZE = 16  # ATTENTION=paged
BUDGET = 32  # the router's --max-batch-prefill-tokens, given to the shard in Warmup
SHARED = "You are a careful assistant who answers in one short sentence. " * 3


@pytest.fixture(scope="module")
def shard(tiny_llama: Path) -> Iterator[Any]:
    env = {"ATTENTION": "paged", "PREFIX_CACHING": "1", "PREFILL_CHUNKING": "1", "TEXTGEN_KV_CACHE_TOKENS": "4096"}
    with ShardProcess(tiny_llama, env=env) as handle:
        yield handle


class Allocator:
    """TGI's allocation for these requests: consecutive blocks, and every slot of them up to the token count."""

    def __init__(self) -> None:
        self.next = 1

    def request(self, request: pb.Request, prompt_tokens: int, reuse: list[int] | None = None) -> list[int]:
        tokens = prompt_tokens + request.stopping_parameters.max_new_tokens - 1
        blocks = list(reuse or [])
        fresh = -(-tokens // BLOCK_SIZE) - len(blocks)
        blocks += range(self.next, self.next + fresh)
        self.next += fresh
        request.blocks.extend(blocks)
        request.slots.extend(b * BLOCK_SIZE + i for b in blocks for i in range(BLOCK_SIZE))
        del request.slots[tokens:]
        return blocks


def batch_pb(batch_id: int, requests: list[pb.Request]) -> pb.Batch:
    batch = make_batch(batch_id, requests)
    batch.max_blocks = max(len(r.blocks) for r in requests)
    return batch


def run_to_end(stub: Any, step: Any, tokens: dict[int, list[int]]) -> None:
    """Record `step`'s generations, then Decode (filtering finished requests out) until nothing is left."""
    while True:
        record(tokens, step.generations)
        done = {g.request_id for g in step.generations if g.HasField("generated_text")}
        if not step.HasField("batch"):
            return
        batch = step.batch
        live = [i for i in batch.request_ids if i not in done]
        if not live:
            stub.ClearCache(pb.ClearCacheRequest(id=batch.id))
            return
        if len(live) < len(batch.request_ids):
            batch = stub.FilterBatch(pb.FilterBatchRequest(batch_id=batch.id, request_ids=live)).batch
        step = stub.Decode(pb.DecodeRequest(batches=[batch]))


def test_a_tgi_router_gets_transformers_tokens(shard: Any, llama_oracle: HFOracle) -> None:
    stub = shard.stub()
    info = stub.Info(pb.InfoRequest())
    assert (info.block_size, info.use_prefix_caching, info.support_chunking) == (BLOCK_SIZE, True, True)
    warmup = stub.Warmup(
        pb.WarmupRequest(batch=make_batch(0, [make_request(0, "_test " * 20, 2)]), max_prefill_tokens=BUDGET)
    )
    assert warmup.max_supported_total_tokens == 4096
    allocator = Allocator()
    ids = lambda text: llama_oracle.tokenizer(text)["input_ids"]  # noqa: E731
    tokens: dict[int, list[int]] = {}

    # 1. A request whose prompt fills some blocks runs whole; its blocks stay written.
    first_text = SHARED + "What is a cat?"
    first = make_request(1, first_text, 6)
    first_blocks = allocator.request(first, len(ids(first_text)))
    run_to_end(stub, stub.Prefill(pb.PrefillRequest(batch=batch_pb(1, [first]))), tokens)
    assert tokens[1] == llama_oracle.greedy(first_text, 6)

    # 2. A decoding batch, then a request that hits the cached prefix and is prefilled in chunks beside it.
    running = [make_request(2, "def foo(x):", 10), make_request(3, "x = 1", 10)]
    for r in running:
        allocator.request(r, len(ids(r.inputs)))
    step = stub.Prefill(pb.PrefillRequest(batch=batch_pb(2, running)))
    record(tokens, step.generations)
    cached = step.batch
    assert cached.current_tokens == 2

    second_text = SHARED + "Name a red fruit, then a green one, then a yellow one."
    second_ids = ids(second_text)
    common = next(i for i, (a, b) in enumerate(zip(ids(first_text), second_ids, strict=False)) if a != b)
    cache_len = common // BLOCK_SIZE * BLOCK_SIZE
    assert cache_len >= BLOCK_SIZE and len(second_ids) - cache_len > BUDGET  # a hit, and still several chunks
    second = make_request(4, second_text, 5)
    allocator.request(second, len(second_ids), reuse=first_blocks[: cache_len // BLOCK_SIZE])
    second.cache_len = cache_len
    second.chunk_len = BUDGET - cached.current_tokens
    step = stub.Prefill(pb.PrefillRequest(batch=batch_pb(3, [second]), cached_batch=cached))
    assert step.HasField("concat_ns") and step.batch.id == cached.id
    assert 4 not in {g.request_id for g in step.generations}  # still prefilling: no token yet
    run_to_end(stub, step, tokens)

    assert tokens[2] == llama_oracle.greedy("def foo(x):", 10)
    assert tokens[3] == llama_oracle.greedy("x = 1", 10)
    assert tokens[4] == llama_oracle.greedy(second_text, 5)
