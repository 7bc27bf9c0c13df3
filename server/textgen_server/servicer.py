"""The generate.v3 servicer (thin glue over Cache and Model) and the shard's grpc.aio server lifecycle."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import torch

from textgen_common.grpc_options import GRPC_OPTIONS
from textgen_pb import generate_pb2, generate_pb2_grpc
from textgen_server.cache import BatchNotFoundError, Cache
from textgen_server.config import ServeConfig
from textgen_server.decode_ahead import DecodeAhead
from textgen_server.interceptor import ErrorMapping, Tracing, Wrapper, wrap_rpcs
from textgen_server.models.model import Batch, InvalidRequestError, KVCacheFullError, Model

logger = logging.getLogger("textgen_server.servicer")

R = TypeVar("R", generate_pb2.PrefillResponse, generate_pb2.DecodeResponse)
T = TypeVar("T")


class TextGenerationService(generate_pb2_grpc.TextGenerationServiceServicer):
    """Every RPC of generate.v3. Errors are raised, and mapped to gRPC codes by interceptor.ErrorMapping.

    An RPC that runs the model or touches the batch cache runs as one call on the model thread (model_thread.py),
    so calls never overlap and the event loop stays free to send replies and read requests meanwhile (Info and
    ServiceDiscovery answer from fixed fields on the loop). With `ahead`,
    a step that leaves a batch every row of which decodes one more token queues that batch's next forward right
    behind itself (decode_ahead.py).
    """

    def __init__(
        self, model: Model, cache: Cache, server_urls: list[str], worker: ThreadPoolExecutor, ahead: DecodeAhead | None
    ) -> None:
        self.model = model
        self.cache = cache
        self.server_urls = server_urls
        self.worker = worker
        self.ahead = ahead

    async def _run(self, call: Callable[[], T], decode_of: int | None = None) -> T:
        """`call` on the model thread; first, a forward ahead is interrupted unless this is a Decode of that batch
        alone (`decode_of`)."""
        if self.ahead is not None:
            self.ahead.interrupt_unless(decode_of)
        return await asyncio.wrap_future(self.worker.submit(call))

    def _drop_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead.drop()

    async def Info(self, request: generate_pb2.InfoRequest, context: object) -> generate_pb2.InfoResponse:
        return self.model.info

    async def Health(self, request: generate_pb2.HealthRequest, context: object) -> generate_pb2.HealthResponse:
        # On the model thread, behind any step: a device that fails there fails here too.
        await asyncio.wrap_future(self.worker.submit(self.model.health))
        return generate_pb2.HealthResponse()

    async def ServiceDiscovery(
        self, request: generate_pb2.ServiceDiscoveryRequest, context: object
    ) -> generate_pb2.ServiceDiscoveryResponse:
        return generate_pb2.ServiceDiscoveryResponse(urls=self.server_urls)

    async def ClearCache(
        self, request: generate_pb2.ClearCacheRequest, context: object
    ) -> generate_pb2.ClearCacheResponse:
        def clear() -> None:
            self._drop_ahead()
            if request.HasField("id"):
                self.cache.delete(request.id)
            else:
                self.cache.clear()

        await self._run(clear)
        return generate_pb2.ClearCacheResponse()

    async def FilterBatch(
        self, request: generate_pb2.FilterBatchRequest, context: object
    ) -> generate_pb2.FilterBatchResponse:
        def filter_batch() -> generate_pb2.FilterBatchResponse:
            self._drop_ahead()
            batch = self.cache.pop(request.batch_id)
            try:
                filtered = batch.filter(list(request.request_ids))
            except ValueError:
                self.cache.set(batch)  # a bad id list leaves the cached batch as it was
                raise
            self.cache.set(filtered)
            return generate_pb2.FilterBatchResponse(batch=filtered.to_pb())

        return await self._run(filter_batch)

    async def Warmup(self, request: generate_pb2.WarmupRequest, context: object) -> generate_pb2.WarmupResponse:
        return await self._run(lambda: self._warmup(request))

    def _warmup(self, request: generate_pb2.WarmupRequest) -> generate_pb2.WarmupResponse:
        self._drop_ahead()
        try:
            batch = self.model.batch_type.from_pb(request.batch, self.model)
        except KVCacheFullError:
            # TGI's words for a warmup batch the KV cache cannot hold (its requests are truncated to `truncate`).
            tokens = sum(r.truncate for r in request.batch.requests)
            raise KVCacheFullError(
                f"Not enough memory to handle {tokens} prefill tokens. "
                "You need to decrease `--max-batch-prefill-tokens`"
            ) from None
        max_supported, max_input, max_total = self.model.warmup(
            batch,
            request.max_input_tokens if request.HasField("max_input_tokens") else None,
            request.max_total_tokens if request.HasField("max_total_tokens") else None,
            request.max_prefill_tokens,
        )
        del batch  # the warmup batch is never cached
        response = generate_pb2.WarmupResponse(max_input_tokens=max_input, max_total_tokens=max_total)
        if max_supported is not None:
            response.max_supported_total_tokens = max_supported
        return response

    async def Prefill(self, request: generate_pb2.PrefillRequest, context: object) -> generate_pb2.PrefillResponse:
        """A new batch; with chunking, the router's running batch (`cached_batch`) joins it in the same forward."""
        start = time.perf_counter_ns()
        return await self._run(lambda: self._prefill(request, start))

    def _prefill(self, request: generate_pb2.PrefillRequest, start: int) -> generate_pb2.PrefillResponse:
        self._drop_ahead()
        chunking = request.HasField("cached_batch")
        if chunking and not self.model.support_chunking:
            raise InvalidRequestError("this shard does not support prefill chunking (`cached_batch` must be unset)")
        if chunking and request.cached_batch.id not in self.cache:
            raise BatchNotFoundError(request.cached_batch.id)
        batch = self.model.batch_type.from_pb(request.batch, self.model)
        if not chunking:
            return self._step(generate_pb2.PrefillResponse, batch, start, concat_ns=None)
        concat_start = time.perf_counter_ns()
        batch = self.model.batch_type.concatenate([self.cache.pop(request.cached_batch.id), batch])
        return self._step(generate_pb2.PrefillResponse, batch, start, time.perf_counter_ns() - concat_start)

    async def Decode(self, request: generate_pb2.DecodeRequest, context: object) -> generate_pb2.DecodeResponse:
        start = time.perf_counter_ns()
        alone = request.batches[0].id if len(request.batches) == 1 else None
        return await self._run(lambda: self._decode(request, start), decode_of=alone)

    def _decode(self, request: generate_pb2.DecodeRequest, start: int) -> generate_pb2.DecodeResponse:
        if not request.batches:
            raise InvalidRequestError("Must provide at least one batch")
        ids = [b.id for b in request.batches]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"batch ids must be distinct, got {ids}")
        missing = [i for i in ids if i not in self.cache]
        if missing:
            # Checked before popping anything so that the other batches stay cached and usable.
            raise BatchNotFoundError(missing[0])
        batches = [self.cache.pop(i) for i in ids]
        if len(batches) == 1:
            ahead = self.ahead.take(batches[0]) if self.ahead is not None else None
            return self._step(generate_pb2.DecodeResponse, batches[0], start, None, ahead)
        self._drop_ahead()
        concat_start = time.perf_counter_ns()
        batch = self.model.batch_type.concatenate(batches)
        return self._step(generate_pb2.DecodeResponse, batch, start, time.perf_counter_ns() - concat_start)

    def _step(
        self,
        response_type: type[R],
        batch: Batch,
        start: int,
        concat_ns: int | None,
        ahead: tuple[torch.Tensor, int] | None = None,
    ) -> R:
        """Run one step (from the logits computed ahead, if any), cache the batch it leaves (if any request is left),
        queue its next forward ahead where it can be, and build the reply. forward_ns counts a forward run ahead."""
        logits, ahead_ns = ahead if ahead is not None else (None, 0)
        generations, next_batch, (forward_ns, decode_ns) = self.model.generate_token(batch, logits)
        self.cache.set(next_batch)
        if self.ahead is not None and self.ahead.start(next_batch, generations):
            self.worker.submit(self.ahead.run)
        return response_type(
            generations=generations,
            batch=next_batch.to_pb() if next_batch is not None else None,
            forward_ns=forward_ns + ahead_ns,
            decode_ns=decode_ns,
            total_ns=time.perf_counter_ns() - start,
            concat_ns=concat_ns,
        )


def shard_urls(uds_path: str, sharded: bool) -> tuple[str, list[str]]:
    """(this shard's url, every shard's url): `unix://{uds_path}-{rank}`, rank 0 only when unsharded."""
    rank, world_size = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if sharded else (0, 1)
    urls = [f"unix://{uds_path}-{r}" for r in range(world_size)]
    return urls[rank], urls


async def serve(model: Model, config: ServeConfig, worker: ThreadPoolExecutor) -> bool:
    """Serve on `config.uds_path` until SIGTERM/SIGINT or a fatal RuntimeError in an RPC, then remove the
    socket file. RPCs are traced when `config.otlp_endpoint` is set. `worker`: the thread the model was loaded on,
    which runs every call into it.

    Returns True when the shard stopped because of a fatal error (the CLI then exits non-zero)."""
    local_url, urls = shard_urls(config.uds_path, config.sharded)
    socket_path = Path(local_url[len("unix://") :])
    socket_path.unlink(missing_ok=True)  # a stale socket from a crashed run would make the bind fail

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    fatal = False

    def shutdown_after_fatal_error() -> None:
        nonlocal fatal
        fatal = True
        stop.set()

    wrappers: list[Wrapper] = [ErrorMapping(shutdown_after_fatal_error)]
    if config.otlp_endpoint:
        wrappers.append(Tracing())
    ahead = DecodeAhead(model) if config.decode_ahead else None
    servicer = TextGenerationService(model, Cache(), urls, worker, ahead)
    wrap_rpcs(servicer, *wrappers)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    server.add_insecure_port(local_url)
    await server.start()
    logger.info("Server started at %s", local_url)
    try:
        await stop.wait()
    finally:
        logger.info("Shutting down" if fatal else "Signal received. Shutting down")
        # A short grace lets the RPC that triggered a fatal shutdown deliver its error first.
        await server.stop(grace=1.0)
        socket_path.unlink(missing_ok=True)
        if ahead is not None:
            ahead.interrupt_unless(None)  # so that the model thread, stopped next (cli.py), is not left mid-forward
    return fatal
