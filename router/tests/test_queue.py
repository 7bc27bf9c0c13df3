"""Queue budget logic (pure, no processes): TGI v3's next_batch for padded and block-rounded shards."""

from __future__ import annotations

import pytest

from textgen_router import metrics
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
