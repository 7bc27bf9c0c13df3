"""Plain helpers of the inference-side tests (their fixtures, `shard`, `run` and `oracle`, are in conftest.py):
prompts of varied lengths, the ValidRequest the router would build for one, and a stream's token ids."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from textgen_router.config import RouterConfig
from textgen_router.infer import Infer
from textgen_router.types import ChooserParameters, EndEvent, IntermediateEvent, StoppingParameters, ValidRequest

T = TypeVar("T")
Run = Callable[[Coroutine[Any, Any, T]], T]
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing songs".split()


def router_config(**overrides: Any) -> RouterConfig:
    """The router limits of the inference-side tests (the launcher's scheduling defaults), with `overrides`."""
    config = RouterConfig(
        max_input_tokens=64,
        max_total_tokens=128,
        max_batch_prefill_tokens=256,
        max_batch_total_tokens=None,
        max_batch_size=None,
        waiting_served_ratio=0.3,
        max_waiting_tokens=20,
        max_concurrent_requests=128,
    )
    return dataclasses.replace(config, **overrides)


def prompt(i: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i * 5) % 7 : (i * 5) % 7 + 1 + i % 6])


def valid(oracle: Any, text: str, max_new_tokens: int) -> ValidRequest:
    return ValidRequest(
        inputs=text,
        input_ids=oracle.tokenizer(text).input_ids,
        truncate=64,
        add_special_tokens=True,
        decoder_input_details=False,
        top_n_tokens=0,
        parameters=ChooserParameters(),
        stopping_parameters=StoppingParameters(max_new_tokens=max_new_tokens),
    )


async def collect(infer: Infer, request: ValidRequest, progress: list[int] | None = None) -> list[int]:
    """Token ids of one stream; `progress` (if given) grows by one id per token as they arrive."""
    ids = progress if progress is not None else []
    async for event in infer.generate_stream(request):
        assert isinstance(event, (IntermediateEvent, EndEvent))
        ids.append(event.token.id)
        if isinstance(event, EndEvent):
            assert event.generated_text.generated_tokens == len(ids)
            assert event.queued <= event.start
    return ids
