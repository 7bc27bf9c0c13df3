"""Sharded generate.v3 client: every call goes to every shard at once, as TGI's ShardedClient does.

All shards of a tensor-parallel group run the same step on the same batch, so each call is sent to all of
them concurrently and awaited together. Answers are merged per TGI:
- info / health / filter_batch: the last shard's answer (all shards hold identical batch state);
- clear_cache: every shard must succeed;
- warmup: the minimum (max_supported_total_tokens, max_input_tokens, max_total_tokens) triple, where a
  shard answering no max_supported_total_tokens (None) wins, as in Rust's ordering of Option;
- prefill / decode: the generations of all shards concatenated (each shard answers only for its rows),
  the next cached batch of the last shard and the timings of the slowest shard (by total_ns).
Every call carries the current OpenTelemetry context as gRPC metadata (`traceparent`) so shard spans join
the router's trace. Any gRPC failure surfaces as `ShardError(details)`.

A shard refusing some requests of a new batch (and only them) answers INVALID_ARGUMENT with details made of
one line `request {id}: {reason}` per refused request (textgen_server's InvalidRequestsError);
`ShardError.refused` holds those reasons by request id. Any other failure leaves it empty.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import propagate, trace

from textgen_common.grpc_options import GRPC_OPTIONS
from textgen_pb import generate_pb2, generate_pb2_grpc

tracer = trace.get_tracer("textgen_router")


REFUSED_REQUEST = re.compile(r"request (\d+): (.+)")


class ShardError(Exception):
    """A shard call failed; `message` is the gRPC status details (what TGI shows after `Server error: `).

    `refused`: reason by request id when the shard refused only those requests (see the module docstring).
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.refused: dict[int, str] = {}
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            lines = [REFUSED_REQUEST.fullmatch(line) for line in message.split("\n")]
            if all(lines):
                self.refused = {int(m[1]): m[2] for m in lines if m is not None}

    @property
    def public_message(self) -> str:
        """`message` as a client may read it (in a 424): a lost connection's gRPC details name the shard's socket
        path, so it becomes tonic's wording for a broken channel ("transport error"), as TGI's clients read it."""
        return "transport error" if self.code == grpc.StatusCode.UNAVAILABLE else self.message


def _shard_error(err: grpc.aio.AioRpcError) -> ShardError:
    return ShardError(err.details() or str(err.code()), err.code())


@dataclass
class StepResult:
    """A Prefill/Decode answer merged over shards; `batch` is None when every request finished."""

    generations: Sequence[generate_pb2.Generation]
    batch: generate_pb2.CachedBatch | None
    forward_ns: int
    decode_ns: int
    total_ns: int
    concat_ns: int | None


WarmupAnswer = tuple[int | None, int, int]


def _url(path_or_url: str) -> str:
    return path_or_url if path_or_url.startswith("unix:") else f"unix://{path_or_url}"


def _metadata() -> tuple[tuple[str, str], ...] | None:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


_Client = TypeVar("_Client", bound="ShardedClient")


class ShardedClient:
    """One grpc.aio channel per shard of the group; build with `await ShardedClient.connect(path)`."""

    def __init__(self, channels: list[grpc.aio.Channel]) -> None:
        self._channels = channels
        self._stubs = [generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels]

    @classmethod
    async def connect(cls: type[_Client], master_uds_path: str) -> _Client:
        """Connect to the rank-0 socket (a path or a `unix://` url), discover every shard, connect to each.

        Raises ShardError when the master socket cannot be reached or does not answer ServiceDiscovery.
        """
        master_url = _url(master_uds_path)
        master = grpc.aio.insecure_channel(master_url, options=GRPC_OPTIONS)
        try:
            stub = generate_pb2_grpc.TextGenerationServiceStub(master)
            with tracer.start_as_current_span("service_discovery"):
                answer = await stub.ServiceDiscovery(generate_pb2.ServiceDiscoveryRequest(), metadata=_metadata())
        except grpc.aio.AioRpcError as err:
            await master.close()
            raise _shard_error(err) from None
        urls = [_url(u) for u in answer.urls] or [master_url]
        channels = [master if u == master_url else grpc.aio.insecure_channel(u, options=GRPC_OPTIONS) for u in urls]
        if master not in channels:
            await master.close()
        return cls(channels)

    @property
    def num_shards(self) -> int:
        return len(self._stubs)

    async def _all(self, method: str, request: Any, sent: Callable[[], None] | None = None) -> list[Any]:
        """Send `request` to every shard concurrently; the first failure becomes ShardError.

        `sent` runs once every call is started and before any of them is awaited: grpc.aio schedules each
        call's send as a task when the stub is called, so ready callbacks queued by `sent` run after it.
        """
        metadata = _metadata()
        calls = [getattr(stub, method)(request, metadata=metadata) for stub in self._stubs]
        if sent is not None:
            sent()
        try:
            if len(calls) == 1:
                return [await calls[0]]
            return list(await asyncio.gather(*calls))
        except grpc.aio.AioRpcError as err:
            for call in calls:
                call.cancel()
            raise _shard_error(err) from None

    async def info(self) -> generate_pb2.InfoResponse:
        with tracer.start_as_current_span("info"):
            return (await self._all("Info", generate_pb2.InfoRequest()))[-1]

    async def health(self) -> None:
        """Device health of every shard; raises ShardError when one fails."""
        with tracer.start_as_current_span("health"):
            await self._all("Health", generate_pb2.HealthRequest())

    async def clear_cache(self, batch_id: int | None) -> None:
        """Drop one cached batch on every shard, or all of them when `batch_id` is None."""
        request = generate_pb2.ClearCacheRequest() if batch_id is None else generate_pb2.ClearCacheRequest(id=batch_id)
        with tracer.start_as_current_span("clear_cache", attributes={"batch_id": -1 if batch_id is None else batch_id}):
            await self._all("ClearCache", request)

    async def filter_batch(self, batch_id: int, request_ids: Sequence[int]) -> generate_pb2.CachedBatch:
        """Keep only `request_ids` in cached batch `batch_id`; returns the filtered batch."""
        request = generate_pb2.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        with tracer.start_as_current_span("filter_batch", attributes={"batch_id": batch_id, "size": len(request_ids)}):
            return (await self._all("FilterBatch", request))[-1].batch

    async def warmup(
        self,
        batch: generate_pb2.Batch,
        max_input_tokens: int | None,
        max_prefill_tokens: int,
        max_total_tokens: int | None,
    ) -> WarmupAnswer:
        """Run the warmup batch on every shard; the minimum answer, None max_supported winning."""
        request = generate_pb2.WarmupRequest(
            batch=batch,
            max_input_tokens=max_input_tokens,
            max_prefill_tokens=max_prefill_tokens,
            max_total_tokens=max_total_tokens,
        )
        with tracer.start_as_current_span("warmup"):
            answers = await self._all("Warmup", request)
        triples = [
            (
                a.max_supported_total_tokens if a.HasField("max_supported_total_tokens") else None,
                a.max_input_tokens,
                a.max_total_tokens,
            )
            for a in answers
        ]
        return min(triples, key=lambda t: (t[0] is not None, t[0] or 0, t[1], t[2]))

    async def prefill(
        self,
        batch: generate_pb2.Batch,
        cached_batch: generate_pb2.CachedBatch | None = None,
        sent: Callable[[], None] | None = None,
    ) -> StepResult:
        """First forward of `batch` (with `cached_batch` appended on the shard when chunking).

        `sent` (optional) is called once the request is on its way to every shard (see `_all`).
        """
        request = generate_pb2.PrefillRequest(batch=batch, cached_batch=cached_batch)
        with tracer.start_as_current_span("prefill", attributes={"id": batch.id, "size": batch.size}):
            return _merge(await self._all("Prefill", request, sent))

    async def decode(
        self, batches: Sequence[generate_pb2.CachedBatch], sent: Callable[[], None] | None = None
    ) -> StepResult:
        """One step of the cached `batches`, which the shards concatenate first when there are several.

        `sent` (optional) is called once the request is on its way to every shard (see `_all`).
        """
        request = generate_pb2.DecodeRequest(batches=batches)
        with tracer.start_as_current_span("decode"):
            return _merge(await self._all("Decode", request, sent))

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _merge(answers: list[Any]) -> StepResult:
    last = answers[-1]
    generations: Sequence[generate_pb2.Generation] = last.generations
    slowest = last
    if len(answers) > 1:
        generations = [g for a in answers for g in a.generations]
        slowest = max(answers, key=lambda a: a.total_ns)
    return StepResult(
        generations=generations,
        batch=last.batch if last.HasField("batch") else None,
        forward_ns=slowest.forward_ns,
        decode_ns=slowest.decode_ns,
        total_ns=slowest.total_ns,
        concat_ns=slowest.concat_ns if slowest.HasField("concat_ns") else None,
    )
