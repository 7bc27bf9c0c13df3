"""The shard's model thread: every call that runs the model (load, warmup, steps, health) or touches the batch cache
runs on one thread of its own, in the order it was submitted, while the gRPC event loop runs on the main thread.

Why a thread of its own: while a step ran on the event loop's thread, the loop could neither send the last reply
nor read the next request, so the gRPC round trip added to every step, and a step computed ahead
(decode_ahead.py) could not be interrupted by the RPC that makes it useless. Why always the same one: torch's
CPU kernels run on an OpenMP team that belongs to the thread calling them, and with a second team in the process
(more of the runtime's threads than cores) every team stops spinning between parallel regions: the small model's
batch-1 step took 1.3-1.6x as long (benchmark/README.md, "Decode ahead"). So the model is loaded on this thread
too, and the main thread runs no torch kernel.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    """Runs submitted calls one at a time on a daemon thread; a call's exception is raised to its caller."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="textgen-model", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        """Queue `call` after every call submitted before it."""
        future: Future[T] = Future()
        self._jobs.put((call, future))
        return future

    def call(self, call: Callable[[], T]) -> T:
        """Run `call` and wait for it (from a thread that is not the event loop's: the CLI's load)."""
        return self.submit(call).result()

    async def run(self, call: Callable[[], T]) -> T:
        """Run `call` and await it (from the event loop). A call cancelled before it starts is skipped."""
        return await asyncio.wrap_future(self.submit(call))

    def stop(self) -> None:
        """Finish the calls queued so far, then end the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as error:  # the caller's to handle, whatever it is: this thread goes on
                future.set_exception(error)
            else:
                future.set_result(result)
