"""The next decode step's forward, computed while the router handles this step's answer.

A `Decode` round trip costs the shard's step plus gRPC's own floor: about 1.1 ms on the 2-core Zen 3 (a `Health`
call with nothing to do; benchmark/README.md, "The next decode step's forward, ahead"), a quarter of a small
model's batch-1 step. After a step whose rows all decode on, the next step's forward is already decided: each row
feeds the token it just chose, at the next slot of its block table. So the model keeps that forward (`start`), the
servicer runs it once its answer is sent (`run`, from the RPC's done callback), and the next step of the same
batch, unchanged, takes its logits (`take`). The choice of tokens (sampling, grammars, stops) still runs in that
step, on the logits it would have computed itself, so a client receives the same tokens.

Anything else the router does in between (FilterBatch after a cancellation, a Prefill, a Decode of other or
concatenated batches) leaves the logits unused. The forward wrote the keys and values of each row's last token
at that row's next slot, which the step that computes that token for real writes again.

Everything runs on the servicer's one thread: torch's CPU ops on a second thread start a second OpenMP team, and
the two teams' spinning threads slowed every step 2.3x on two cores (benchmark/README.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch


class DecodeAhead:
    """At most one forward kept: not run yet, run, or failed."""

    def __init__(self) -> None:
        self._owner: object = None
        self._state: Hashable = None
        self._forward: Callable[[], torch.Tensor] | None = None
        self._result: torch.Tensor | BaseException | None = None
        self._ns = 0  # how long the forward ran

    def start(self, owner: object, state: Hashable, forward: Callable[[], torch.Tensor]) -> None:
        """Keep `forward`, the next step of batch `owner` in `state` (what the forward is computed from), in place
        of any forward kept before."""
        self._owner, self._state, self._forward, self._result = owner, state, forward, None

    def run(self) -> None:
        """Run the kept forward if it has not run; an error is kept for `take`."""
        if self._forward is None:
            return
        forward, self._forward = self._forward, None
        start = time.perf_counter_ns()
        try:
            self._result = forward()
        except Exception as err:  # raised where the logits are wanted, never in the servicer's callback
            self._result = err
        self._ns = time.perf_counter_ns() - start

    def take(self, owner: object, state: Hashable) -> tuple[torch.Tensor, int] | None:
        """The kept forward's logits if it is the next step of `owner` in `state`, and how long it ran before this
        call (ns; 0 where it runs now, not having run); else None. Nothing is kept after."""
        wanted = self._owner is owner and self._state == state
        ran_before = self._ns if self._forward is None else 0
        if wanted:
            self.run()
        result = self._result
        self._owner, self._state, self._forward, self._result = None, None, None, None
        if not wanted or result is None:
            return None
        if isinstance(result, BaseException):
            raise result
        return result, ran_before
