"""Decode ahead (decode_ahead.py) and the model thread (model_thread.py), in process over the paged engine.

A step from logits computed ahead must be the step computed when asked, bit for bit (tokens, logprobs, top tokens,
seeded draws), and a forward interrupted between layers must leave nothing the following steps can see. The
servicer's calls are recorded to show which step used a forward ahead; its RPCs are awaited without gRPC (the
real shard process runs them over gRPC in test_server.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from shard_helpers import chooser, make_batch, make_request
from test_paged_lm import paged_model

from textgen_pb import generate_pb2 as pb
from textgen_server.builder import CYCLE_PERIOD as PERIOD
from textgen_server.cache import Cache
from textgen_server.decode_ahead import DecodeAhead
from textgen_server.model_thread import model_thread
from textgen_server.models.model import Interrupted
from textgen_server.models.paged_batch import PagedBatch
from textgen_server.models.paged_lm import PagedCausalLM
from textgen_server.servicer import TextGenerationService


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> PagedCausalLM:
    return paged_model(tiny_llama)


def requests() -> list[pb.Request]:
    """Rows that finish at different steps: greedy with top tokens, seeded draws, a repetition penalty."""
    return [
        make_request(0, "def foo(x):", 9, top_n_tokens=3),
        make_request(1, "import os\nimport sys\n", 6, params=chooser(do_sample=True, temperature=0.7, seed=11)),
        make_request(2, "class", 12, params=chooser(repetition_penalty=1.3)),
    ]


def view(generations: list[pb.Generation]) -> list[Any]:
    """Everything a step's generations say, in comparable form."""
    return [
        (
            g.request_id,
            list(g.tokens.ids),
            list(g.tokens.logprobs),
            [list(t.ids) for t in g.top_tokens],
            g.generated_text,
        )
        for g in generations
    ]


def live_ids(batch: PagedBatch, generations: list[pb.Generation]) -> list[int]:
    done = {g.request_id for g in generations if g.HasField("generated_text")}
    return [r.id for r in batch.requests if r.id not in done]


class SetAfter(threading.Event):
    """An interrupt that reads as set from its `checks`-th look on: a forward stops after `checks` layers."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks = checks

    def is_set(self) -> bool:
        self.checks -= 1
        return self.checks < 0


def test_steps_from_logits_computed_ahead_are_the_steps_computed_when_asked(model: PagedCausalLM) -> None:
    plain = PagedBatch.from_pb(make_batch(1, requests()), model)
    ahead_batch = PagedBatch.from_pb(make_batch(2, requests()), model)
    ahead = DecodeAhead(model)
    steps_ahead = 0
    try:
        while plain is not None:
            expected, plain_next, _ = model.generate_token(plain)
            taken = ahead.take(ahead_batch)
            logits = taken[0] if taken is not None else None
            steps_ahead += logits is not None
            got, ahead_next, _ = model.generate_token(ahead_batch, logits)
            assert view(got) == view(expected)
            if plain_next is None:
                assert ahead_next is None
                break
            assert ahead_next is not None
            live = live_ids(plain_next, expected)
            if len(live) < len(plain_next):  # a row stopped: no forward ahead, the batch is filtered
                assert not ahead.start(ahead_next, got)
                plain, ahead_batch = plain_next.filter(live), ahead_next.filter(live)
                continue
            plain, ahead_batch = plain_next, ahead_next
            assert ahead.start(ahead_batch, got)
            ahead.run()
    finally:
        for batch in (plain, ahead_batch):
            if batch is not None:
                batch.release()
    assert steps_ahead >= 8  # 12 tokens for the longest row: all but the first and the steps after a stop


def test_a_forward_interrupted_between_layers_leaves_the_next_steps_unchanged(model: PagedCausalLM) -> None:
    plain = PagedBatch.from_pb(make_batch(1, requests()), model)
    cut = PagedBatch.from_pb(make_batch(2, requests()), model)
    try:
        for _ in range(4):
            expected, plain, _ = model.generate_token(plain)
            got, cut, _ = model.generate_token(cut)
            assert plain is not None and cut is not None and view(got) == view(expected)
            with pytest.raises(Interrupted):
                model.decode_logits(cut, SetAfter(1))  # the first layer's keys and values written
        # The full forward ahead, dropped: the steps that follow write what it wrote again.
        model.decode_logits(cut, threading.Event())
        for _ in range(2):
            expected, plain, _ = model.generate_token(plain)
            got, cut, _ = model.generate_token(cut)
            assert plain is not None and cut is not None and view(got) == view(expected)
    finally:
        for batch in (plain, cut):
            if batch is not None:
                batch.release()


def test_an_interrupt_set_before_the_forward_runs_skips_it(model: PagedCausalLM) -> None:
    batch = PagedBatch.from_pb(make_batch(1, requests()), model)
    ahead = DecodeAhead(model)
    try:
        generations, batch, _ = model.generate_token(batch)
        assert batch is not None and ahead.start(batch, generations)
        ahead.interrupt_unless(batch.batch_id)  # a Decode of this batch alone: kept
        ahead.interrupt_unless(None)  # anything else: interrupted
        ahead.run()
        assert ahead.take(batch) is None
        # A Decode of another batch never takes it, and a take forgets it.
        assert ahead.start(batch, generations)
        ahead.run()
        assert ahead.take(PagedBatch.from_pb(make_batch(9, requests()[:1]), model)) is None
        assert ahead.take(batch) is None
    finally:
        if batch is not None:
            batch.release()


def test_no_forward_ahead_while_a_row_prefills_or_guesses(cycling_llama: Path, model: PagedCausalLM) -> None:
    ahead = DecodeAhead(model)
    long_prompt = make_request(5, "x " * 40, 4)
    chunked = pb.Request()
    chunked.CopyFrom(long_prompt)
    chunked.chunk_len = 8  # the prompt's first chunk: the next step prefills again
    batch = PagedBatch.from_pb(make_batch(1, [chunked]), model)
    try:
        generations, batch, _ = model.generate_token(batch)
        assert batch is not None and not generations
        assert not model.decodes_ahead(batch) and not ahead.start(batch, generations)
    finally:
        if batch is not None:
            batch.release()
    guessing = paged_model(cycling_llama, speculate=2)
    batch = PagedBatch.from_pb(make_batch(1, [make_request(0, "a b c d a b c d a b", 16)]), guessing)
    try:
        for _ in range(2 * PERIOD):  # the looping model's tokens repeat: guesses come within two periods
            generations, batch, _ = guessing.generate_token(batch)
            assert batch is not None
            if any(batch.speculative_ids):
                break
        assert any(batch.speculative_ids) and not guessing.decodes_ahead(batch)
    finally:
        if batch is not None:
            batch.release()


def test_the_model_thread_runs_calls_in_order_on_one_thread() -> None:
    worker = model_thread()
    seen: list[tuple[int, int]] = []

    def call(i: int) -> Callable[[], int]:
        def record() -> int:
            seen.append((i, threading.get_ident()))
            if i == 2:
                raise ValueError("two")
            return i * 10

        return record

    futures = [worker.submit(call(i)) for i in range(4)]
    assert futures[0].result() == 0 and futures[3].result() == 30
    with pytest.raises(ValueError, match="two"):
        futures[2].result()
    assert worker.submit(lambda: threading.current_thread().name).result().startswith("textgen-model")
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    assert len({thread for _, thread in seen}) == 1 and seen[0][1] != threading.get_ident()

    async def awaited() -> int:
        return await asyncio.wrap_future(worker.submit(call(5)))

    assert asyncio.run(awaited()) == 50
    gate = threading.Event()
    worker.submit(gate.wait)
    skipped = worker.submit(call(6))
    assert skipped.cancel()  # cancelled before it started: never run
    gate.set()
    worker.shutdown()
    assert [i for i, _ in seen] == [0, 1, 2, 3, 5]


def test_the_servicer_decodes_ahead_only_what_the_next_decode_asks_for(
    model: PagedCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which steps used a forward ahead, through Prefill, Decode, FilterBatch and a concatenating Decode."""
    calls: list[tuple[str, int, bool]] = []
    step, ahead_forward = model.generate_token, model.decode_logits

    def recorded_step(batch: Any, logits: torch.Tensor | None = None) -> Any:
        calls.append(("step", batch.batch_id, logits is not None))
        return step(batch, logits)

    def recorded_forward(batch: Any, interrupt: threading.Event) -> torch.Tensor:
        calls.append(("ahead", batch.batch_id, True))
        return ahead_forward(batch, interrupt)

    monkeypatch.setattr(model, "generate_token", recorded_step)
    monkeypatch.setattr(model, "decode_logits", recorded_forward)
    worker = model_thread()
    service = TextGenerationService(model, Cache(), [], worker, DecodeAhead(model))

    async def scenario() -> None:
        async def settled() -> None:
            # every call queued so far, the forward ahead included, has run
            await asyncio.wrap_future(worker.submit(lambda: None))

        first = make_batch(1, [make_request(0, "def foo(x):", 8), make_request(1, "class", 8)])
        cached = (await service.Prefill(pb.PrefillRequest(batch=first), None)).batch
        await settled()
        cached = (await service.Decode(pb.DecodeRequest(batches=[cached]), None)).batch
        await settled()
        cached = (await service.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[0]), None)).batch
        await settled()
        cached = (await service.Decode(pb.DecodeRequest(batches=[cached]), None)).batch
        await settled()
        second = make_batch(2, [make_request(2, "x = 1", 8)])
        new = (await service.Prefill(pb.PrefillRequest(batch=second), None)).batch
        await settled()
        merged = await service.Decode(pb.DecodeRequest(batches=[cached, new]), None)
        await settled()
        await service.ClearCache(pb.ClearCacheRequest(id=merged.batch.id), None)

    try:
        asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert calls == [
        ("step", 1, False),  # Prefill
        ("ahead", 1, True),
        ("step", 1, True),  # Decode of the same batch: its forward was ahead
        ("ahead", 1, True),
        ("step", 1, False),  # after FilterBatch: the batch changed, its forward runs when asked
        ("ahead", 1, True),
        ("step", 2, False),  # Prefill of a new batch
        ("ahead", 2, True),
        ("step", 1, False),  # the concatenated batch
        ("ahead", 1, True),
    ]
