"""Decode ahead: the next step's forward of the batch a step just returned, computed on the model thread while the
step's reply travels to the router and the next Decode travels back.

At batch 1 on a small model that round trip is a sixth of a step (benchmark/README.md, "Decode ahead"). A batch
whose step left every row decoding one token (none stopped: the router would filter it; no guesses; one rank:
`Model.decodes_ahead`) is most often asked for again, unchanged, by the next Decode, so its forward starts as
soon as the reply is handed over. The next Decode of exactly that batch takes the logits and runs the rest of
its step (choice, stopping, detokenization) as it would have without them; every other RPC that touches the
batches interrupts the forward between two layers and drops it. What a client receives cannot change: the
forward reads the batch without changing it, and writes only its rows' next keys and values, in their own
blocks at positions nothing reads before the step that writes them again.

Threads: `start` (after a step), `run`, `take` and `drop` run on the model thread, in its order; `interrupt_unless`
runs on the event loop, before the RPC's call is queued, so that a forward no longer wanted stops early.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from textgen_pb import generate_pb2
from textgen_server.models.model import Batch, Interrupted, Model

logger = logging.getLogger(__name__)


class DecodeAhead:
    """At most one forward ahead: the batch it is for, and its logits once computed."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._batch: Batch | None = None
        self._interrupt = threading.Event()
        self._logits: torch.Tensor | None = None
        self._forward_ns = 0

    def start(self, batch: Batch | None, generations: list[generate_pb2.Generation]) -> bool:
        """After a step (model thread): whether `batch`, which the step left, has its next forward run ahead, by
        `run` queued next. Not when a row stopped, since the router then filters the batch."""
        self.drop()
        if batch is None or any(g.HasField("generated_text") for g in generations):
            return False
        if not self.model.decodes_ahead(batch):
            return False
        self._interrupt.clear()
        self._batch = batch
        return True

    def run(self) -> None:
        """The forward ahead (model thread), unless interrupted before or during it."""
        batch = self._batch
        if batch is None or self._interrupt.is_set():
            self._batch = None
            return
        start = time.perf_counter_ns()
        try:
            self._logits = self.model.decode_logits(batch, self._interrupt)
        except Interrupted:
            self._batch = None
        except Exception:
            # The Decode that asks for this batch runs its own forward and reports what fails there.
            logger.debug("decode ahead failed; the next step runs its own forward", exc_info=True)
            self._batch = None
        self._forward_ns = time.perf_counter_ns() - start

    def take(self, batch: Batch) -> tuple[torch.Tensor, int] | None:
        """For a Decode of `batch` alone (model thread): the logits computed ahead for it and the forward's ns, if
        any; whatever was ahead is dropped."""
        ahead, logits = self._batch, self._logits
        self.drop()
        if ahead is not batch or logits is None:
            return None
        return logits, self._forward_ns

    def drop(self) -> None:
        """Forget the forward ahead (model thread): before any call that changes the batches."""
        self._batch, self._logits = None, None

    def interrupt_unless(self, batch_id: int | None) -> None:
        """Before an RPC's call is queued (event loop): stop the forward ahead unless the RPC is a Decode of that
        batch alone (`batch_id`). A stop missed by a race only costs time: `take` checks the batch itself."""
        ahead = self._batch
        if ahead is not None and ahead.batch_id != batch_id:
            self._interrupt.set()
