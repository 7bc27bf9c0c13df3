"""Issue 24, defect 1, through a real shard: a Prefill whose batch holds invalid requests fails only those.

The invalid requests are built as ValidRequests directly, skipping the router's validation (which refuses
them), so their values reach the shard as a client's would if validation let them through: temperature 1e-300
is 0.0 once in the float32 protobuf field, NaN stays NaN.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
from inference_harness import prompt, router_config, valid

from textgen_router import metrics
from textgen_router.backend import Backend, connect_backend
from textgen_router.infer import Infer
from textgen_router.types import ChooserParameters, EndEvent, GenerationError, IntermediateEvent, ValidRequest

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def infer(shard: Any, run: Any) -> Iterator[Infer]:
    backend: Backend = run(connect_backend(shard.socket, router_config(max_batch_prefill_tokens=2048)))
    yield backend.infer
    run(backend.close())


async def text_of(infer: Infer, request: ValidRequest) -> tuple[list[int], str]:
    """The token ids of one stream and its final generated text."""
    ids: list[int] = []
    async for event in infer.generate_stream(request):
        assert isinstance(event, (IntermediateEvent, EndEvent))
        ids.append(event.token.id)
        if isinstance(event, EndEvent):
            return ids, event.generated_text.text
    raise AssertionError("the stream ended without an EndEvent")


def with_temperature(request: ValidRequest, temperature: float) -> ValidRequest:
    return dataclasses.replace(request, parameters=ChooserParameters(temperature=temperature, do_sample=True))


def test_invalid_rows_fail_alone_and_their_batch_mates_complete(infer: Infer, oracle: Any, run: Any) -> None:
    metrics.reset()
    normal = [valid(oracle, prompt(i), 4 + i) for i in range(6)]
    tiny = with_temperature(valid(oracle, prompt(6), 4), 1e-300)
    nan = with_temperature(valid(oracle, prompt(7), 4), math.nan)
    # Queued together before the batching loop wakes, so all eight go to the shard in one Prefill.
    requests = [normal[0], tiny, *normal[1:4], nan, *normal[4:]]

    async def scenario() -> list[Any]:
        return await asyncio.gather(*(text_of(infer, r) for r in requests), return_exceptions=True)

    results = dict(zip([id(r) for r in requests], run(scenario()), strict=True))
    for request, reason in ((tiny, "got 0.0"), (nan, "got nan")):
        error = results[id(request)]
        assert isinstance(error, GenerationError)
        assert str(error) == (
            f"Request failed during generation: Server error: `temperature` must be strictly positive, {reason}"
        )
    for request in normal:
        expected = oracle(request.inputs, request.stopping_parameters.max_new_tokens)
        assert results[id(request)] == (expected, oracle.tokenizer.decode(expected, skip_special_tokens=True))
    # The refused Prefill, then the six normal requests prefilled again on their own.
    assert metrics.BATCH_INFERENCE_COUNT.value("prefill") == 2
    assert metrics.BATCH_INFERENCE_FAILURE.value("prefill") == 1
    assert metrics.REQUEST_FAILURE.value("generation") == 2
    assert not infer.batcher.running and not len(infer.queue)
