"""Queue budget logic (pure, no processes): TGI v3's next_batch for padded, block-rounded and paged shards."""

from __future__ import annotations

import pytest

from textgen_pb import generate_pb2
from textgen_router import metrics
from textgen_router.block_allocator import RadixAllocator, SimpleAllocator
from textgen_router.images import cache_key
from textgen_router.queue import Entry, Queue
from textgen_router.types import ChooserParameters, StoppingParameters, ValidRequest


def entry(input_length: int, max_new_tokens: int, text: str = "x", details: bool = False) -> Entry:
    return Entry(
        ValidRequest(
            inputs=text,
            input_ids=list(range(input_length)),
            truncate=input_length,
            add_special_tokens=True,
            decoder_input_details=details,
            top_n_tokens=0,
            parameters=ChooserParameters(temperature=0.5, top_k=3, seed=7),
            stopping_parameters=StoppingParameters(max_new_tokens=max_new_tokens, stop_sequences=["a"]),
        )
    )


def filled(queue: Queue, *shapes: tuple[int, int]) -> list[Entry]:
    entries = [entry(i, n) for i, n in shapes]
    for e in entries:
        queue.append(e)
    return entries


def test_ids_increase_and_request_is_mirrored_onto_grpc() -> None:
    q = Queue(requires_padding=True)
    filled(q, (3, 5), (4, 6))
    entries, batch = q.next_batch(None, None, 100, 100)
    assert [r.id for r in batch.requests] == [0, 1] and sorted(entries) == [0, 1]
    r = batch.requests[0]
    assert r.inputs == "x" and r.input_chunks.chunks[0].text == "x" and r.truncate == 3
    assert r.parameters.top_k == 3 and r.parameters.seed == 7 and abs(r.parameters.temperature - 0.5) < 1e-6
    assert r.stopping_parameters.max_new_tokens == 5 and list(r.stopping_parameters.stop_sequences) == ["a"]
    assert batch.id == 0 and batch.size == 2
    filled(q, (1, 1))
    _, batch2 = q.next_batch(None, None, 100, 100)
    assert batch2.id == 1 and batch2.requests[0].id == 2
    assert entries[0].batch_time is not None


def test_padded_prefill_budget_counts_padding_to_longest_prompt() -> None:
    q = Queue(requires_padding=True)
    filled(q, (2, 1), (10, 1), (2, 1))
    # 1 row of 2 fits; 2 rows padded to 10 = 20 > 19 stops the batch, strict FIFO keeps the third waiting.
    _, batch = q.next_batch(None, None, 19, 1000)
    assert batch.size == 1 and len(q) == 2
    _, batch = q.next_batch(None, None, 30, 1000)
    assert batch.size == 2 and batch.max_tokens == 2 * 10 + 2  # prefill (n * longest) + decode tokens


def test_padded_token_budget_includes_decode_tokens_and_speculation() -> None:
    q = Queue(requires_padding=True, speculate=2)
    filled(q, (4, 10), (4, 10))
    # first: 4 + 10 + 2 = 16; second: 8 + 20 + 2 = 30
    assert q.next_batch(None, None, 100, 15) is None
    _, batch = q.next_batch(None, None, 100, 29)
    assert batch.size == 1 and batch.max_tokens == 14
    _, batch = q.next_batch(None, None, 100, 30)
    assert batch.size == 1


def test_block_rounded_budgets_and_window() -> None:
    q = Queue(requires_padding=False, block_size=16, window_size=20)
    filled(q, (5, 100), (17, 3))
    # prompts round to 16 and 32; max_new_tokens capped to window - input (15 -> 16) and 3 -> 16
    _, batch = q.next_batch(None, None, 48, 1000)
    assert batch.size == 2 and batch.max_tokens == 16 + 32 + 16 + 16
    filled(q, (17, 3))
    # the prefill budget is rounded up to a block multiple: 20 -> 32 fits a 32-token prompt
    _, batch = q.next_batch(None, None, 20, 1000)
    assert batch.size == 1


def test_min_and_max_size() -> None:
    q = Queue(requires_padding=True)
    filled(q, (2, 2), (2, 2), (2, 2))
    assert q.next_batch(4, None, 100, 100) is None and len(q) == 3  # fewer queued than min_size
    assert q.next_batch(3, None, 4, 100) is None and len(q) == 3  # only 2 fit: all go back, in order
    assert [e.id for e in q.entries] == [0, 1, 2]
    assert q.next_batch(None, 0, 100, 100) is None
    entries, batch = q.next_batch(None, 2, 100, 100)
    assert sorted(entries) == [0, 1] and [e.id for e in q.entries] == [2]


@pytest.mark.parametrize("budgets", [(0, 100), (100, 0)])
def test_zero_budget_yields_nothing(budgets: tuple[int, int]) -> None:
    q = Queue(requires_padding=True)
    filled(q, (1, 1))
    assert q.next_batch(None, None, *budgets) is None and len(q) == 1


def test_dropped_entries_are_skipped_and_counted() -> None:
    metrics.reset()
    q = Queue(requires_padding=True)
    a, b, c = filled(q, (1, 1), (1, 1), (1, 1))
    a.dropped = c.dropped = True
    entries, batch = q.next_batch(None, None, 100, 100)
    assert list(entries) == [b.id] and batch.size == 1 and len(q) == 0
    assert metrics.REQUEST_FAILURE.value("dropped") == 2
    assert q.next_batch(None, None, 100, 100) is None


def test_queue_metrics() -> None:
    metrics.reset()
    q = Queue(requires_padding=True)
    filled(q, (1, 1), (1, 1), (1, 1))
    assert metrics.QUEUE_SIZE.value() == 3
    q.next_batch(None, 2, 100, 100)
    assert metrics.QUEUE_SIZE.value() == 1 and metrics.BATCH_NEXT_SIZE.count() == 1
    text = metrics.render()[0].decode()
    assert 'tgi_batch_next_size_bucket{le="2"} 1' in text and 'tgi_batch_next_size_bucket{le="1"} 0' in text


# -- paged shards: the queue hands out KV blocks (TGI v3) ------------------------------------------------------


def paged(
    block_size: int = 4, prefix_caching: bool = True, chunking: bool = False, total_tokens: int = 64, speculate: int = 0
) -> Queue:
    info = generate_pb2.InfoResponse(
        requires_padding=False,
        block_size=block_size,
        use_prefix_caching=prefix_caching,
        support_chunking=chunking,
        speculate=speculate,
    )
    return Queue.for_shards(info, total_tokens)


def free_blocks(q: Queue) -> int:
    assert q.allocator is not None
    return len(q.allocator.free_blocks)


def test_for_shards_gives_paged_shards_an_allocator() -> None:
    padded = Queue.for_shards(generate_pb2.InfoResponse(requires_padding=True, block_size=16), 1000)
    assert padded.allocator is None
    simple = paged(prefix_caching=False)
    assert isinstance(simple.allocator, SimpleAllocator) and not simple.support_chunking
    radix = paged(chunking=True)
    assert isinstance(radix.allocator, RadixAllocator) and radix.support_chunking
    assert free_blocks(radix) == 64 // 4 - 1


def test_paged_requests_carry_their_blocks_and_slots() -> None:
    q = paged(speculate=1)
    filled(q, (5, 3), (2, 1))
    entries, batch = q.next_batch(None, None, 100, 100)
    a, b = batch.requests
    # 5 + 3 + 1 - 1 = 8 tokens: 2 blocks; 2 + 1 + 1 - 1 = 3 tokens: 1 block
    assert list(a.blocks) == [14, 15] and list(a.slots) == list(range(56, 64)) and a.cache_len == 0
    assert list(b.blocks) == [13] and list(b.slots) == [52, 53, 54]
    assert not a.HasField("chunk_len") and not b.HasField("chunk_len")
    assert batch.max_blocks == 2 and batch.max_tokens == 5 + 2  # the prompts; the blocks cover the decode
    assert entries[0].allocation is not None and entries[0].allocation.blocks == [14, 15]


def test_paged_admission_stops_at_the_first_request_without_blocks() -> None:
    q = paged(total_tokens=32)  # 7 usable blocks of 4
    filled(q, (8, 9), (8, 9), (1, 1))
    entries, batch = q.next_batch(None, None, 100, 100)
    assert batch.size == 1 and [e.id for e in q.entries] == [1, 2]  # 16 tokens = 4 blocks; 3 left: no skipping
    assert free_blocks(q) == 3
    for e in entries.values():
        e.release()
    _, batch = q.next_batch(None, None, 100, 100)
    assert batch.size == 2


def prefilled_and_released(q: Queue, entries: dict[int, Entry]) -> None:
    for e in entries.values():
        e.prefilled = True
        e.release()


def test_a_cached_prefix_is_not_computed_again_and_counts_nothing_in_the_prefill() -> None:
    q = paged()
    q.append(entry(10, 2))
    prefilled_and_released(q, q.next_batch(None, None, 100, 100)[0])  # caches 2 whole blocks: 8 tokens
    q.append(entry(10, 2))
    q.append(entry(3, 1))
    entries, batch = q.next_batch(None, None, 5, 100)  # 10 - 8 + 3 = 5 prompt tokens to compute
    assert batch.requests[0].cache_len == 8 and batch.size == 2 and batch.max_tokens == 5
    r = batch.requests[0]
    assert list(r.slots[:8]) == [b * 4 + i for b in r.blocks[:2] for i in range(4)]  # the slots cover the prefix


def test_a_prompt_with_images_shares_cached_blocks_only_with_the_same_images() -> None:
    image_token, cat, dog = 9, b"cat pixels", b"dog pixels"  # two images of one size: the same placeholder ids
    ids = [1, 2, 3, image_token, image_token, image_token, image_token, image_token, 4, 5]

    def with_image(image: bytes) -> Entry:
        e = entry(len(ids), 2)
        e.request.input_ids = ids
        e.request.cache_key = cache_key(ids, image_token, [image])
        return e

    assert cache_key(ids, image_token, [cat])[:3] == ids[:3] and min(cache_key(ids, image_token, [cat])) < 0
    q = paged()
    q.append(with_image(cat))
    prefilled_and_released(q, q.next_batch(None, None, 100, 100)[0])  # caches 2 whole blocks: 8 tokens
    q.append(with_image(dog))
    assert q.next_batch(None, None, 100, 100)[1].requests[0].cache_len == 0  # the image's block differs
    q.append(with_image(cat))
    assert q.next_batch(None, None, 100, 100)[1].requests[0].cache_len == 8  # through the same image


def test_a_whole_cached_prompt_still_computes_its_last_token() -> None:
    q = paged()
    q.append(entry(8, 2))
    prefilled_and_released(q, q.next_batch(None, None, 100, 100)[0])
    q.append(entry(8, 2))
    _, batch = q.next_batch(None, None, 100, 100)
    assert batch.requests[0].cache_len == 7 and batch.max_tokens == 1


def test_prefill_logprobs_skip_the_prefix_cache() -> None:
    q = paged()
    q.append(entry(8, 2))
    prefilled_and_released(q, q.next_batch(None, None, 100, 100)[0])
    q.append(entry(8, 2, details=True))
    _, batch = q.next_batch(None, None, 100, 100)
    assert batch.requests[0].cache_len == 0 and batch.requests[0].prefill_logprobs


def test_an_entry_not_prefilled_caches_nothing() -> None:
    q = paged()
    q.append(entry(8, 2))
    for e in q.next_batch(None, None, 100, 100)[0].values():
        e.release()  # e.g. failed or dropped before its first token
    q.append(entry(8, 2))
    _, batch = q.next_batch(None, None, 100, 100)
    assert batch.requests[0].cache_len == 0


def test_without_chunking_a_prompt_over_the_prefill_budget_waits_with_no_blocks() -> None:
    q = paged()
    filled(q, (4, 1), (6, 1))
    before = free_blocks(q)
    entries, batch = q.next_batch(None, None, 8, 100)
    assert batch.size == 1 and len(q) == 1 and free_blocks(q) == before - 1  # the second's 2 blocks came back


def test_with_chunking_the_overflowing_prompt_takes_the_rest_of_the_budget() -> None:
    q = paged(chunking=True)
    filled(q, (4, 1), (10, 1), (1, 1))
    entries, batch = q.next_batch(None, None, 8, 100)
    a, b = batch.requests
    assert not a.HasField("chunk_len") and b.chunk_len == 4 and batch.size == 2 and len(q) == 1
    assert batch.max_tokens == 4  # as TGI: the chunk is not counted
    assert len(b.blocks) == 3  # blocks for the whole request all the same


def test_with_chunking_a_spent_budget_puts_the_request_back() -> None:
    q = paged(chunking=True)
    filled(q, (8, 1), (4, 1))
    before = free_blocks(q)
    entries, batch = q.next_batch(None, None, 8, 100)
    assert batch.size == 1 and len(q) == 1 and free_blocks(q) == before - 2  # the second's block came back


def test_paged_min_size_put_back_frees_the_blocks() -> None:
    q = paged()
    filled(q, (4, 1), (4, 1), (4, 1))
    before = free_blocks(q)
    assert q.next_batch(3, None, 8, 100) is None
    assert free_blocks(q) == before and [e.id for e in q.entries] == [0, 1, 2]
    assert all(e.allocation is None for e in q.entries)
    assert q.next_batch(None, None, 100, 100) is not None
