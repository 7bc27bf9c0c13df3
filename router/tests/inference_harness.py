"""Fixtures shared by the inference-side tests: a real shard process and an event loop that outlives tests.

The backend's grpc.aio channels and batching task live on one loop, so module-scoped fixtures drive a loop
of their own (`run(coro)`, bounded by a timeout) instead of a fresh loop per test.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
Run = Callable[[Coroutine[Any, Any, T]], T]


def root_conftest(config: pytest.Config) -> Any:
    # Every conftest.py is module "conftest"; fetch the repo root's by its registration path.
    return config.pluginmanager.get_plugin(str(Path(config.rootpath) / "conftest.py"))


@pytest.fixture(scope="module")
def shard(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[Any]:
    """A real `textgen-server serve` of the tiny llama on a unique unix socket, stopped after the module."""
    with root_conftest(request.config).ShardProcess(tiny_llama) as handle:
        yield handle


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    """Run a coroutine to completion (90 s at most) on the module's event loop."""
    loop = asyncio.new_event_loop()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return loop.run_until_complete(asyncio.wait_for(coro, 90))

    yield run
    loop.close()
