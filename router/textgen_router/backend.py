"""Router start-up against the shards (TGI v3 `connect_backend`): connect, warm up, settle the limits.

`await connect_backend(socket, config)` connects to the rank-0 socket and every discovered shard, clears
their caches (the router may have restarted), reads Info, warms the model up with TGI's warmup batch, settles
max_batch_total_tokens, checks the limits against each other and returns a `Backend` whose batching loop
runs. Any failure raises `StartupError` whose message is TGI's (e.g. "Unable to connect to the Python
model shards: ..." or "Argument validation error: ...").
"""

from __future__ import annotations

import base64
import logging
import struct
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from textgen_pb import generate_pb2

from . import metrics
from .batching import Batcher
from .config import RouterConfig
from .infer import Infer
from .queue import Queue
from .shard_client import ShardedClient, ShardError

logger = logging.getLogger("textgen_router.backend")
T = TypeVar("T")


class StartupError(Exception):
    """The router cannot serve: the message is what TGI prints before exiting."""


def _png(width: int = 20, height: int = 20) -> bytes:
    """A small white RGB PNG: the image chunk of the warmup request (vision models must see one)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\xff" * (3 * width) for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


WARMUP_IMAGE = _png()


def warmup_batch(
    max_input_tokens: int | None, max_prefill_tokens: int, max_total_tokens: int | None, max_batch_size: int | None
) -> generate_pb2.Batch:
    """TGI's warmup batch: "_test " prompts filling max_prefill_tokens, every logits processor exercised.

    Each request is truncated on the shard to min(max_input_tokens, tokens left); the first one also
    carries an image chunk, which text models drop.
    """
    image_markdown = f"![](data:image/jpeg;base64,{base64.b64encode(WARMUP_IMAGE).decode()})"
    requests: list[generate_pb2.Request] = []
    n_tokens = 0
    while n_tokens < max_prefill_tokens:
        truncate = max_prefill_tokens - n_tokens
        if max_input_tokens is not None:
            truncate = min(max_input_tokens, truncate)
        text = "_test " * truncate
        chunks = [generate_pb2.InputChunk(text=text)]
        inputs = text
        if n_tokens == 0:
            chunks.append(
                generate_pb2.InputChunk(image=generate_pb2.Image(data=WARMUP_IMAGE, mimetype="image/jpeg;base64"))
            )
            inputs += image_markdown
        requests.append(
            generate_pb2.Request(
                id=0,
                inputs=inputs,
                input_chunks=generate_pb2.Input(chunks=chunks),
                truncate=truncate,
                add_special_tokens=True,
                parameters=generate_pb2.NextTokenChooserParameters(
                    temperature=0.9,
                    top_k=10,
                    top_p=0.9,
                    typical_p=0.9,
                    do_sample=False,
                    seed=0,
                    repetition_penalty=1.2,
                    frequency_penalty=0.1,
                    watermark=True,
                ),
                stopping_parameters=generate_pb2.StoppingCriteriaParameters(
                    max_new_tokens=max(0, max_total_tokens - truncate) if max_total_tokens is not None else 1,
                    ignore_eos_token=True,
                ),
                prefill_logprobs=True,
                top_n_tokens=20,
            )
        )
        n_tokens += truncate
        if max_batch_size is not None and len(requests) == max_batch_size:
            break
    return generate_pb2.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_input_tokens or 0)


@dataclass
class Backend:
    """A warmed-up shard group, its settled limits and the running Infer."""

    client: ShardedClient
    info: generate_pb2.InfoResponse
    max_input_tokens: int
    max_total_tokens: int
    max_batch_total_tokens: int
    infer: Infer

    async def close(self) -> None:
        """Stop the batching loop (failing pending requests) and close the shard channels."""
        await self.infer.stop()
        await self.client.close()


def _invalid(message: str) -> StartupError:
    return StartupError(f"Argument validation error: {message}")


async def connect_backend(master_shard_uds_path: str, config: RouterConfig) -> Backend:
    """TGI's router start-up (see the module docstring); the returned Backend's loop is started."""
    if config.max_batch_size is not None and config.max_batch_size <= 0:
        raise _invalid("`max_batch_size` must be > 0")
    if (
        config.max_input_tokens is not None
        and config.max_total_tokens is not None
        and config.max_input_tokens >= config.max_total_tokens
    ):
        raise _invalid("`max_input_tokens` must be < `max_total_tokens`")

    try:
        client = await ShardedClient.connect(master_shard_uds_path)
    except ShardError as err:
        # TGI tells a transport failure ("Could not connect ...") from a shard that answered with an error.
        kind = (
            "Could not connect to Text Generation server" if err.code == grpc.StatusCode.UNAVAILABLE else "Server error"
        )
        raise StartupError(f"Unable to connect to the Python model shards: {kind}: {err.message}") from None
    try:
        return await warm_up(client, config)
    except BaseException:
        await client.close()
        raise


async def _shard_call(call: Awaitable[T], failure: str) -> T:
    """`await call`, a shard's error becoming the StartupError "<failure>: Server error: <details>"."""
    try:
        return await call
    except ShardError as err:
        raise StartupError(f"{failure}: Server error: {err.message}") from None


async def warm_up(client: ShardedClient, config: RouterConfig) -> Backend:
    """The start-up after connecting (clear caches, Info, Warmup, settle and check the limits) on `client`;
    the returned Backend owns `client` and its batching loop runs. Raises StartupError as connect_backend."""
    await _shard_call(client.clear_cache(None), "Unable to clear the Python model shards cache")
    info = await _shard_call(client.info(), "Unable to get the Python model shards info")
    if info.support_chunking:
        logger.warning(
            "Model supports prefill chunking. `waiting_served_ratio` and `max_waiting_tokens` will be ignored."
        )
    logger.info("Warming up model")
    batch = warmup_batch(
        config.max_input_tokens, config.max_batch_prefill_tokens, config.max_total_tokens, config.max_batch_size
    )
    supported, shard_input, shard_total = await _shard_call(
        client.warmup(batch, config.max_input_tokens, config.max_batch_prefill_tokens, config.max_total_tokens),
        "Unable to warmup the Python model shards",
    )
    # The shards apply the limits they are given; an answer that differs means they could not.
    if config.max_input_tokens is not None and shard_input != config.max_input_tokens:
        raise _invalid(f"`max_input_tokens` is {config.max_input_tokens} but the shards answered {shard_input}")
    if config.max_total_tokens is not None and shard_total != config.max_total_tokens:
        raise _invalid(f"`max_total_tokens` is {config.max_total_tokens} but the shards answered {shard_total}")
    batch_total = _settle_batch_total_tokens(config, supported, shard_total)
    logger.info("Setting max batch total tokens to %d", batch_total)
    metrics.BATCH_MAX_TOTAL_TOKENS.set(batch_total)
    _check_limits(shard_input, shard_total, config.max_batch_prefill_tokens, batch_total, info.support_chunking)
    metrics.configure_length_buckets(shard_input, shard_total)

    queue = Queue.for_shards(info, batch_total)
    batcher = Batcher(client, queue, config.batching(batch_total))
    infer = Infer(client, queue, batcher, config.max_concurrent_requests)
    infer.start()
    return Backend(client, info, shard_input, shard_total, batch_total, infer)


def _settle_batch_total_tokens(config: RouterConfig, supported: int | None, shard_total: int) -> int:
    """TGI's max_batch_total_tokens: what the shards support when they tell, else the flag or a default."""
    if supported is None:
        logger.warning("Model does not support automatic max batch total tokens")
        if config.max_batch_total_tokens is not None:
            return config.max_batch_total_tokens
        return max(16000, shard_total, config.max_batch_prefill_tokens)
    if config.max_batch_total_tokens is not None:
        logger.warning("`--max-batch-total-tokens` is deprecated for Flash Attention models.")
        logger.warning("Inferred max batch total tokens: %d", supported)
    if shard_total > supported:
        raise StartupError(f"Not enough memory to handle `max_total_tokens={shard_total}`")
    return supported


def _check_limits(
    max_input_tokens: int, max_total_tokens: int, max_prefill_tokens: int, batch_total: int, chunking: bool
) -> None:
    """TGI's checks of the settled limits against each other.

    Shards that chunk prefills may take prompts longer than a prefill step (`chunking`).
    """
    if max_input_tokens >= max_total_tokens:
        raise _invalid("`max_input_tokens` must be < `max_total_tokens`")
    if not chunking and max_input_tokens > max_prefill_tokens:
        raise _invalid(
            "`max_batch_prefill_tokens` must be >= `max_input_tokens`. "
            f"Given: {max_prefill_tokens} and {max_input_tokens}"
        )
    if max_prefill_tokens > batch_total:
        raise _invalid(
            "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. "
            f"Given: {max_prefill_tokens} and {batch_total}"
        )
    if max_total_tokens > batch_total:
        raise _invalid(
            f"`max_total_tokens` must be <= `max_batch_total_tokens`. Given: {max_total_tokens} and {batch_total}"
        )
