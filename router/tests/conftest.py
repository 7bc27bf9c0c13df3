"""Router test fixtures.

HTTP tests:
- `router` (session): one real shard + one real `textgen-router` process (router_fixtures.ROUTER_FLAGS),
  shared by the HTTP test modules.
- `client` (session): an httpx client on it that sends the API key.

Inference-side tests (backend, batching; plain helpers in inference_harness.py):
- `shard` (module): real `textgen-server serve` processes of the tiny llama on unique unix sockets; a module
  sets `NUM_SHARD = 2` to get a tensor-parallel group, `SHARD_ENV` to add to their environment.
- `run` (module): runs a coroutine (90 s at most) on the module's own event loop. The backend's grpc.aio
  channels and batching task live on one loop, so module-scoped fixtures drive a loop that outlives tests.
- `oracle` (module): `oracle(prompt, n)`, the n greedy token ids of transformers `generate` on the prompt alone
  (`oracle.tokenizer` is its tokenizer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from inference_harness import Run
from router_fixtures import API_KEY, ROUTER_FLAGS, RouterProcess

from testing.shards import ShardHandle, ShardProcess

T = TypeVar("T")


@pytest.fixture(scope="session")
def router(tiny_llama: Path) -> Iterator[RouterProcess]:
    """One shard + one router (ROUTER_FLAGS) shared by the router's HTTP test modules."""
    with ShardProcess(tiny_llama) as shard:
        with RouterProcess(shard.socket, tiny_llama, ROUTER_FLAGS) as proc:
            yield proc


@pytest.fixture(scope="session")
def client(router: RouterProcess) -> Iterator[httpx.Client]:
    """An httpx client on the shared router that sends the API key."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=router.base_url, headers=headers, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def shard(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[ShardHandle]:
    """The module's shard processes (NUM_SHARD of them, default 1; SHARD_ENV added to their environment),
    stopped after the module."""
    num_shard = getattr(request.module, "NUM_SHARD", 1)
    with ShardProcess(tiny_llama, num_shard=num_shard, env=getattr(request.module, "SHARD_ENV", None)) as handle:
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
    import torch  # here, not at the top: the HTTP test modules never load a model in the test process
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
