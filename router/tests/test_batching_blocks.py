"""The batching loop's pure pieces for paged shards (no shard process): what may join a running batch, and
when entries release their KV blocks and whether their prompt gets cached."""

from __future__ import annotations

import pytest
from test_queue import filled, free_blocks, paged

from textgen_pb import generate_pb2
from textgen_router import metrics
from textgen_router.batching import Batcher, JoinLimits, join_limits
from textgen_router.config import BatchingLimits
from textgen_router.queue import Entry, Queue
from textgen_router.shard_client import ShardedClient
from textgen_router.types import EndEvent, GenerationError

LIMITS = BatchingLimits(
    max_batch_prefill_tokens=100,
    max_batch_total_tokens=1000,
    max_batch_size=8,
    waiting_served_ratio=1.5,
    max_waiting_tokens=20,
)


def cached(size: int, max_tokens: int, current_tokens: int) -> generate_pb2.CachedBatch:
    return generate_pb2.CachedBatch(id=1, size=size, max_tokens=max_tokens, current_tokens=current_tokens)


def test_join_limits_without_chunking() -> None:
    assert join_limits(cached(4, 300, 4), LIMITS, False, False) == JoinLimits(6, 4, 100, 700)
    assert join_limits(cached(4, 300, 4), LIMITS, False, True) == JoinLimits(None, 4, 100, 700)
    assert join_limits(cached(9, 1200, 9), LIMITS, False, True) == JoinLimits(None, 0, 100, 0)


def test_join_limits_with_chunking_leave_the_prefill_budget_of_the_next_forward() -> None:
    # 30 tokens in the running batch's next forward (decoding rows and a prompt's next chunk): 70 are left.
    assert join_limits(cached(4, 300, 30), LIMITS, True, False) == JoinLimits(None, None, 70, 700)
    assert join_limits(cached(4, 300, 130), LIMITS, True, False) == JoinLimits(None, None, 0, 700)


def batcher(queue: Queue) -> Batcher:
    # No shard is ever called: the pieces under test only route results and end requests.
    return Batcher(ShardedClient([]), queue, LIMITS)


def generation(request_id: int, done: bool) -> generate_pb2.Generation:
    g = generate_pb2.Generation(
        request_id=request_id, tokens=generate_pb2.Tokens(ids=[5], logprobs=[-0.5], texts=["a"], is_special=[False])
    )
    if done:
        g.generated_text.CopyFrom(
            generate_pb2.GeneratedText(text="a", generated_tokens=1, finish_reason=generate_pb2.FINISH_REASON_LENGTH)
        )
    return g


def started(q: Queue, *shapes: tuple[int, int]) -> dict[int, Entry]:
    filled(q, *shapes)
    nxt = q.next_batch(None, None, 100, 100)
    assert nxt is not None
    return nxt[0]


def cache_len_of_next(q: Queue, input_length: int) -> int:
    filled(q, (input_length, 1))
    nxt = q.next_batch(None, None, 100, 100)
    assert nxt is not None
    for e in nxt[0].values():
        e.release()
    return nxt[1].requests[0].cache_len


def test_a_finished_entry_releases_its_blocks_and_caches_its_prompt() -> None:
    q = paged()
    b = batcher(q)
    before = free_blocks(q)
    entries = started(q, (8, 4))
    b._send([generation(0, done=False)], entries)
    assert entries[0].prefilled and entries[0].allocation is not None
    b._send([generation(0, done=True)], entries)
    assert not entries and free_blocks(q) == before - 2  # prompt cached
    assert isinstance(b._undelivered[-1][1], EndEvent)
    assert cache_len_of_next(q, 8) == 7


def test_a_dropped_entry_releases_its_blocks_at_its_next_generation() -> None:
    metrics.reset()
    q = paged()
    b = batcher(q)
    entries = started(q, (8, 4))
    entries[0].dropped = True
    b._send([generation(0, done=False)], entries)
    assert not entries and metrics.REQUEST_FAILURE.value("dropped") == 1
    assert cache_len_of_next(q, 8) == 7  # its first generation proves its prompt was computed


@pytest.mark.parametrize("queued", [True, False])
def test_failed_entries_release_their_blocks_and_cache_only_prefilled_prompts(queued: bool) -> None:
    q = paged()
    b = batcher(q)
    before = free_blocks(q)
    b.running = started(q, (4, 1), (8, 1))  # a prefilled row and one still prefilling (no generation yet)
    b._send([generation(0, done=False)], b.running)
    waiting = filled(q, (1, 1))[0]
    b.fail_all("boom", queued=queued)
    assert not b.running and free_blocks(q) == before - 1  # [4] cached
    assert (len(waiting.events) == 1) == queued
    q.entries.clear()
    # Prompts are 0, 1, 2...: the prefilled row cached the block [0 1 2 3]; the other row, which never
    # finished its prefill, cached nothing of its [4 5 6 7].
    assert cache_len_of_next(q, 8) == 4


def test_refused_rows_release_their_blocks_without_caching() -> None:
    q = paged()
    b = batcher(q)
    before = free_blocks(q)
    filled(q, (8, 1), (8, 1))
    nxt = q.next_batch(None, None, 100, 100)
    assert nxt is not None
    entries, batch = nxt
    refused = entries[0]
    rest = b._refuse(batch, entries, {0: "bad"})
    assert rest is not None and [r.id for r in rest.requests] == [1] and rest.max_blocks == 2
    assert list(entries) == [1] and free_blocks(q) == before - 2
    assert isinstance(refused.events._items[0], GenerationError) and refused.allocation is None
    for e in entries.values():
        e.release()
    assert cache_len_of_next(q, 8) == 0


def test_refusals_of_running_rows_are_not_a_refusal_of_the_new_batch() -> None:
    q = paged()
    b = batcher(q)
    running = started(q, (4, 1))
    filled(q, (4, 1))
    nxt = q.next_batch(None, None, 100, 100)
    assert nxt is not None
    running.update(nxt[0])
    assert b._refuse(nxt[1], running, {0: "not in this batch"}) is None
    assert not running[0].events and not running[1].events and running[0].allocation is not None
