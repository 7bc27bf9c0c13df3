"""Fixtures shared by the inference-side tests: a real shard process and an event loop that outlives tests.

The backend's grpc.aio channels and batching task live on one loop, so module-scoped fixtures drive a loop
of their own (`run(coro)`, bounded by a timeout) instead of a fresh loop per test.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def root_conftest(config: pytest.Config) -> Any:
    # Every conftest.py is module "conftest"; fetch the repo root's by its registration path.
    return config.pluginmanager.get_plugin(str(Path(config.rootpath) / "conftest.py"))


@pytest.fixture(scope="module")
def shard(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[Any]:
    """Real `textgen-server serve` processes of the tiny llama on unique unix sockets, stopped after the
    module; a module sets `NUM_SHARD = 2` to get a tensor-parallel group."""
    num_shard = getattr(request.module, "NUM_SHARD", 1)
    with root_conftest(request.config).ShardProcess(tiny_llama, num_shard=num_shard) as handle:
        yield handle


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    """Run a coroutine to completion (90 s at most) on the module's event loop."""
    loop = asyncio.new_event_loop()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return loop.run_until_complete(asyncio.wait_for(coro, 90))

    yield run
    loop.close()


@pytest.fixture(scope="module")
def oracle(tiny_llama: Path) -> Any:
    """`oracle(prompt, n)`: the n greedy token ids of transformers `generate` on the prompt alone."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    cache: dict[tuple[str, int], list[int]] = {}

    def greedy(prompt: str, max_new_tokens: int) -> list[int]:
        key = (prompt, max_new_tokens)
        if key not in cache:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            cache[key] = out[0, ids.shape[1] :].tolist()
        return cache[key]

    greedy.tokenizer = tokenizer  # type: ignore[attr-defined]
    return greedy


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
