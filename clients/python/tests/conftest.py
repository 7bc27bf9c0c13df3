"""The client tests run against the tiny llama served by a real `textgen-launcher`.

The launcher helper lives with the integration tests; sharing it (rather than a second copy) means one
launcher process serves both directories when they run in one pytest session.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "integration-tests"))
from launcher_process import Launcher, shared_launcher  # noqa: E402


@pytest.fixture(scope="session")
def server(tiny_llama: Path) -> Iterator[Launcher]:
    with shared_launcher(tiny_llama) as handle:
        yield handle
