"""The router's token and batch limits: as started (`RouterConfig`), and as the batching loop applies them
once warm-up has settled the batch's token capacity (`BatchingLimits`)."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchingLimits:
    """What the batching loop schedules under (TGI's flags of the same names).

    `max_batch_total_tokens` is the settled capacity of a running batch (prefill plus decode tokens);
    `max_batch_size` None means no cap on rows.
    """

    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None
    waiting_served_ratio: float
    max_waiting_tokens: int


@dataclass(frozen=True)
class RouterConfig:
    """The limits `textgen-router` is started with; None leaves a limit for warm-up to settle."""

    max_input_tokens: int | None
    max_total_tokens: int | None
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int | None
    max_batch_size: int | None
    waiting_served_ratio: float
    max_waiting_tokens: int
    max_concurrent_requests: int

    @classmethod
    def from_args(cls, args: Namespace) -> RouterConfig:
        """The limits among the parsed `textgen-router` arguments (textgen_router.args)."""
        return cls(
            max_input_tokens=args.max_input_tokens,
            max_total_tokens=args.max_total_tokens,
            max_batch_prefill_tokens=args.max_batch_prefill_tokens,
            max_batch_total_tokens=args.max_batch_total_tokens,
            max_batch_size=args.max_batch_size,
            waiting_served_ratio=args.waiting_served_ratio,
            max_waiting_tokens=args.max_waiting_tokens,
            max_concurrent_requests=args.max_concurrent_requests,
        )

    def batching(self, max_batch_total_tokens: int) -> BatchingLimits:
        """The batching loop's limits once warm-up settled `max_batch_total_tokens`."""
        return BatchingLimits(
            max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_total_tokens=max_batch_total_tokens,
            max_batch_size=self.max_batch_size,
            waiting_served_ratio=self.waiting_served_ratio,
            max_waiting_tokens=self.max_waiting_tokens,
        )
