"""Router HTTP test fixtures.

- `router` (session): one real shard + one real `textgen-router` process (router_fixtures.ROUTER_FLAGS),
  shared by the HTTP test modules.
- `client` (session): an httpx client on it that sends the API key.
- `shard`, `run`, `oracle` (module): the inference-side tests' shard process, event loop and greedy oracle
  (inference_harness).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from inference_harness import oracle, run, shard  # noqa: F401  (fixtures for the test modules)
from router_fixtures import API_KEY, ROUTER_FLAGS, RouterProcess, root_conftest


@pytest.fixture(scope="session")
def router(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[RouterProcess]:
    """One shard + one router (ROUTER_FLAGS) shared by the router's HTTP test modules."""
    with root_conftest(request.config).ShardProcess(tiny_llama) as shard_process:
        with RouterProcess(request.config, shard_process.socket, tiny_llama, ROUTER_FLAGS) as proc:
            yield proc


@pytest.fixture(scope="session")
def client(router: RouterProcess) -> Iterator[httpx.Client]:
    """An httpx client on the shared router that sends the API key."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=router.base_url, headers=headers, timeout=60.0) as c:
        yield c
