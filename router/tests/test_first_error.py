"""generation.all_or_first_error: several sequences of one request joined as TGI's try_join_all joins them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from textgen_router.generation import all_or_first_error


class Runs:
    """Coroutines that record what happened to them: started, finished or cancelled, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.release = asyncio.Event()

    async def ok(self, name: str) -> str:
        self.log.append(f"start {name}")
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.log.append(f"cancel {name}")
            raise
        return name

    async def fails_at_once(self, name: str) -> str:
        self.log.append(f"start {name}")
        raise ValueError(name)

    async def fails_later(self, name: str, steps: int) -> str:
        self.log.append(f"start {name}")
        for _ in range(steps):
            await asyncio.sleep(0)
        raise ValueError(name)


def test_results_come_in_order() -> None:
    async def main() -> list[str]:
        runs = Runs()
        runs.release.set()
        return await all_or_first_error(runs.ok(name) for name in "abc")

    assert asyncio.run(main()) == ["a", "b", "c"]
    assert asyncio.run(all_or_first_error(iter([]))) == []


def test_an_error_before_any_wait_starts_no_other_run() -> None:
    runs = Runs()

    def sequences() -> Iterator[Coroutine[Any, Any, str]]:
        yield runs.ok("a")
        yield runs.fails_at_once("b")
        yield runs.ok("c")  # never created, so never started

    with pytest.raises(ValueError, match="b"):
        asyncio.run(all_or_first_error(sequences()))
    assert runs.log == ["start a", "start b", "cancel a"]


def test_a_later_error_cancels_the_runs_still_going() -> None:
    runs = Runs()

    def sequences() -> Iterator[Coroutine[Any, Any, str]]:
        yield runs.ok("a")
        yield runs.fails_later("b", steps=1)  # fails while c takes its first step
        yield runs.ok("c")
        yield runs.ok("d")  # never created: b had failed by then

    with pytest.raises(ValueError, match="b"):
        asyncio.run(all_or_first_error(sequences()))
    assert runs.log == ["start a", "start b", "start c", "cancel a", "cancel c"]


def test_cancelling_the_caller_cancels_every_run() -> None:
    runs = Runs()

    async def main() -> None:
        join = asyncio.ensure_future(all_or_first_error(runs.ok(name) for name in "ab"))
        while runs.log != ["start a", "start b"]:
            await asyncio.sleep(0)
        join.cancel()
        with pytest.raises(asyncio.CancelledError):
            await join

    asyncio.run(main())
    assert sorted(runs.log[2:]) == ["cancel a", "cancel b"]
