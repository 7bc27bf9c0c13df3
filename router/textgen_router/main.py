"""`textgen-router`: connect to the shards, load the tokenizer, serve TGI's HTTP API with uvicorn.

Start-up, as TGI's router: argument checks, then `connect_backend` (service discovery, clear cache,
info, warmup; settles max_input_tokens / max_total_tokens when not given), then the tokenizer (loaded
meanwhile, its failure reported only once the backend is up), then the
HTTP listener on hostname:port (a non-IP hostname binds 0.0.0.0 with a warning) plus the Prometheus
listener on --prometheus-port; logs `Connected`. SIGTERM / SIGINT: stop accepting, let in-flight
requests (streams included) finish, then stop the batching loop. Failures exit 1 with `Error: <msg>`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
from argparse import Namespace
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
import uvloop
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from textgen_common import router_gate
from textgen_common.addresses import listen_address
from textgen_common.logs import setup_logging
from textgen_common.lora_adapters import parse_lora_adapters
from textgen_router import metrics
from textgen_router.app import create_app
from textgen_router.args import parse_args
from textgen_router.backend import Backend, StartupError, connect_backend
from textgen_router.chat_template import ChatTemplate
from textgen_router.config import RouterConfig
from textgen_router.image_fetch import FetchPolicy
from textgen_router.images import ImagePrompts, is_multimodal
from textgen_router.read_timeouts import ReadTimeoutProtocol
from textgen_router.state import RouterState
from textgen_router.tokenizer import Tokenizer, load_tokenizer
from textgen_router.tracing import setup_tracing
from textgen_router.validation import Limits, ServedAdapters, Validator, bare_main

logger = logging.getLogger("textgen_router")
T = TypeVar("T")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: main() stops every listener on one signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# Set inside the Prometheus listener's task only (each asyncio task runs in its own copy of the context).
_SECOND_LISTENER: contextvars.ContextVar[bool] = contextvars.ContextVar("second_listener", default=False)


class _OneLifecycleLog(logging.Filter):
    """Both listeners are uvicorn servers in one process: keep uvicorn's lifecycle lines ("Started server
    process", "Shutting down", ...) from the main listener only, instead of each line twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not _SECOND_LISTENER.get()


async def _as_second_listener(serving: Coroutine[Any, Any, None]) -> None:
    _SECOND_LISTENER.set(True)
    await serving


def _metrics_app() -> Starlette:
    async def scrape(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return Starlette(routes=[Route("/metrics", scrape), Route("/", scrape)])


def _bind(host: str, port: int) -> socket.socket | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        # The extra metrics listener is optional (/metrics is also on the main port): several routers
        # on one machine would otherwise fight over TGI's fixed default 9000.
        logger.warning("Prometheus listener on %s:%d unavailable: %s", host, port, err)
        return None
    sock.set_inheritable(True)
    return sock


@dataclass
class Router:
    """A connected router: the app to serve and what must be closed after serving it."""

    app: FastAPI
    backend: Backend
    validator: Validator

    async def close(self) -> None:
        """Stop the batching loop (failing what is pending), close the shard channels and the workers."""
        await self.backend.close()
        self.validator.close()


class StartFailed(Exception):
    """Start-up failed with this message; `textgen-router` prints `Error: <message>` and exits 1."""


def _load_text(args: Namespace) -> tuple[Tokenizer, ChatTemplate, ImagePrompts | None]:
    """The tokenizer, the chat template and a vision-language model's processor workers, started (all from files
    of the model: no shard involved)."""
    try:
        tokenizer = load_tokenizer(args.tokenizer_name, args.revision, args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise StartFailed(f"Unable to load the tokenizer of {args.tokenizer_name}: {err}") from None
    template = ChatTemplate.load(tokenizer, args.tokenizer_name, args.tokenizer_config_path, args.revision)
    return tokenizer, template, _start_images(args)


def _in_daemon_thread(fn: Callable[[Namespace], T], args: Namespace) -> asyncio.Future[T]:
    """`fn(args)` in a daemon thread: unlike the default executor's, exiting never waits for it (a failed
    start must not wait for a hub download that nobody needs any more)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn(args))
            except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
                done.set_exception(err)

    threading.Thread(target=run, name="load-tokenizer", daemon=True).start()
    return asyncio.wrap_future(done)


def _start_images(args: Namespace) -> ImagePrompts | None:
    """A vision-language model's processor workers, started (None for any other model)."""
    if not is_multimodal(args.tokenizer_name, args.revision):
        return None
    images = ImagePrompts(args.tokenizer_name, args.revision, args.validation_workers, fetch_policy(args))
    with bare_main():
        images.start()
    return images


async def _images_ready(images: ImagePrompts, args: Namespace) -> None:
    try:
        await images.ready()
    except Exception as err:  # noqa: BLE001 - whatever stopped a worker loading it, said in one line
        raise StartFailed(f"Unable to load the processor of {args.tokenizer_name}: {err!r}") from None


def fetch_policy(args: Namespace) -> FetchPolicy:
    """What a vision-language model's image URLs may reach (textgen_router.image_fetch)."""
    hosts = tuple(h.strip().lower() for h in args.image_fetch_allowed_hosts.split(",") if h.strip())
    return FetchPolicy(args.max_image_fetch_size, hosts, args.image_fetch_allow_link_local)


async def start(args: Namespace) -> Router:
    """Connect to the shards (warmup settles the token limits), load the tokenizer, build the app."""
    try:
        names = tuple(adapter.name for adapter in parse_lora_adapters(args.lora_adapters))
    except ValueError as err:
        raise StartFailed(str(err)) from None
    # The tokenizer loads in a thread while the shards warm up (other processes: the cores really overlap), and a
    # vision-language model's processor workers start there too. Awaited only after the backend, so a backend
    # failure is still the error reported, as in TGI.
    loading = _in_daemon_thread(_load_text, args)
    if router_gate.gated() and not await _in_daemon_thread(lambda _: router_gate.wait_until_open(), args):
        loading.cancel()
        raise StartFailed("the launcher stopped before the shards were ready")
    try:
        backend = await connect_backend(args.master_shard_uds_path, RouterConfig.from_args(args))
    except BaseException as err:
        loading.cancel()  # a cancelled future's outcome need not be retrieved
        if isinstance(err, StartupError):
            raise StartFailed(str(err)) from None
        raise
    try:
        if args.max_input_tokens is None:
            logger.info("Maximum input tokens defaulted to %d", backend.max_input_tokens)
        if args.max_total_tokens is None:
            logger.info("Maximum total tokens defaulted to %d", backend.max_total_tokens)
        metrics.configure_length_buckets(backend.max_input_tokens, backend.max_total_tokens)
        tokenizer, chat_template, images = await loading
        limits = Limits(
            args.max_best_of,
            args.max_stop_sequences,
            args.max_top_n_tokens,
            backend.max_input_tokens,
            backend.max_total_tokens,
        )
        if images is not None:
            await _images_ready(images, args)
        validator = Validator(
            tokenizer,
            limits,
            args.validation_workers,
            ServedAdapters(args.tokenizer_name, names),
            grammar_support=not args.disable_grammar_support,
            images=images,
        )
        state = RouterState(
            infer=backend.infer,
            validator=validator,
            model_id=args.tokenizer_name,
            max_concurrent_requests=args.max_concurrent_requests,
            max_client_batch_size=args.max_client_batch_size,
            validation_workers=args.validation_workers,
        )
        app = create_app(
            state, api_key=args.api_key, cors_allow_origin=args.cors_allow_origin, payload_limit=args.payload_limit
        )
        if chat_template.template is None:
            logger.warning("No chat template found for %s: /v1/chat/completions will answer 422", args.tokenizer_name)
        app.state.chat_template = chat_template
    except BaseException:
        await backend.close()
        raise
    return Router(app, backend, validator)


def server(app: ASGIApp, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for `app` that leaves signal handling to its caller (set `should_exit` to stop)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_keep_alive=5,
        http=ReadTimeoutProtocol,  # bounded header and body reads (uvicorn bounds only keep-alive idle time)
    )
    return _Server(config)


async def serve(args: Namespace) -> int:
    """Start, serve until SIGINT/SIGTERM (in-flight requests finish), close; returns the exit code."""
    try:
        router = await start(args)
    except StartFailed as err:
        logger.error("%s", err)
        print(f"Error: {err}", file=sys.stderr)
        return 1
    # Start-up imported FastAPI and transformers (and torch, where the tokenizer was built rather than read
    # from its cache file): hundreds of thousands of objects that live as long as the process. A full
    # collection walks them all, with the event loop stalled; frozen, collections only walk what serving
    # allocates (figures: benchmark/README.md, "Router figures"). The collector, off during the start (main),
    # runs from here.
    gc.freeze()
    gc.enable()
    try:
        host = listen_address(args.hostname)
        if host != args.hostname:
            logger.warning("Invalid hostname, defaulting to 0.0.0.0")
        servers = [server(router.app, host, args.port)]
        listeners = [servers[0].serve()]
        prometheus_socket = _bind(host, args.prometheus_port)
        if prometheus_socket is not None:
            servers.append(server(_metrics_app(), host, args.prometheus_port))
            listeners.append(_as_second_listener(servers[1].serve(sockets=[prometheus_socket])))

        def on_signal() -> None:
            logger.info("signal received, starting graceful shutdown")
            for srv in servers:
                srv.should_exit = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        logger.info("Connected")
        await asyncio.gather(*listeners)
        return 0
    finally:
        await router.close()


def log_level(directive: str) -> str:
    """The level in a LOG_LEVEL value; TGI also takes filter directives (`info,textgen_router=debug`)."""
    for part in directive.split(","):
        if "=" not in part and part.strip().upper() in ("TRACE", "DEBUG", "INFO", "WARN", "WARNING", "ERROR"):
            level = part.strip().upper()
            return {"TRACE": "DEBUG", "WARN": "WARNING"}.get(level, level)
    return "INFO"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "print-schema":
        print(json.dumps(create_app(None).openapi(), indent=2))
        sys.exit(0)
    setup_logging(log_level(os.environ.get("LOG_LEVEL", "info")), args.json_output)
    logging.getLogger("uvicorn.error").addFilter(_OneLifecycleLog())
    if args.validation_workers == 0:
        message = "Argument validation error: `validation_workers` must be > 0"
        logger.error(message)
        print(f"Error: {message}", file=sys.stderr)
        sys.exit(1)
    provider = setup_tracing(args.otlp_endpoint, args.otlp_service_name)
    # The start (serve's `start`: transformers' chat template renderer imported, the tokenizer loaded) makes
    # objects that live as long as the process, and serve freezes them: the collector is off until then. It ran
    # over them for 0.15 s of the start's CPU on a 2-core Zen 3, beside the loading shard.
    gc.disable()
    try:
        # uvloop: the per-token path is event-loop work (a task wake and a socket write per stream and step),
        # cheaper on libuv's loop (router CPU per streamed token: benchmark/README.md, "Router figures").
        code = uvloop.run(serve(args))
    finally:
        if provider is not None:
            provider.shutdown()
    # Everything is closed. Without this, the interpreter's final collections walk every transformers/torch
    # object the tokenizer load created, a visible delay between "Finished" and the exit.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    main()
