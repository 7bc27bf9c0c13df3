"""`textgen-launcher`: validate, download, start the shards then the router, watch them, stop them in order.

Exit codes (TGI's): 0 after a stop signal, 1 for any launcher error (printed as `Error: <Kind>`), 101
when sharding is requested but no device count is known (TGI panics there), 2 for unparsable flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from textgen_common.logs import setup_logging
from textgen_launcher.args import parse_args
from textgen_launcher.attention_defaults import resolve_attention
from textgen_launcher.children import Child, stop_all
from textgen_launcher.config import load_config
from textgen_launcher.devices import NoDeviceFound
from textgen_launcher.download import download_all
from textgen_launcher.env_info import runtime_env
from textgen_launcher.errors import LauncherError, ShardFailed, WebserverFailed
from textgen_launcher.ports import check_port_free
from textgen_launcher.router import open_router, spawn_router
from textgen_launcher.shards import Shard, spawn_shards, wait_ready
from textgen_launcher.validate import Settings, validate

logger = logging.getLogger("textgen_launcher")
PANIC_EXIT_CODE = 101
LOG_LEVELS = {
    "trace": "DEBUG",
    "debug": "DEBUG",
    "info": "INFO",
    "warn": "WARNING",
    "warning": "WARNING",
    "error": "ERROR",
}


class StopFlag:
    """Set by SIGINT, SIGTERM or SIGHUP; every wait loop of the launcher polls it."""

    def __init__(self) -> None:
        self.stopped = False
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        logger.info("Received %s", signal.Signals(signum).name)
        self.stopped = True

    def running(self) -> bool:
        return not self.stopped


def log_level() -> str:
    """LOG_LEVEL as TGI reads it: a bare level (`debug`), or filter directives (`info,textgen_router=debug`)
    in which a bare level or the launcher's own `target=level` decides (as in the router and the shards)."""
    parts = [p.strip().lower() for p in os.environ.get("LOG_LEVEL", "info").split(",") if p.strip()]
    bare = [p for p in parts if "=" not in p]
    own = [p.split("=", 1)[1] for p in parts if p.split("=", 1)[0] in ("textgen_launcher", "text_generation_launcher")]
    for level in own + bare:
        if level in LOG_LEVELS:
            return LOG_LEVELS[level]
    return "INFO"


def _public_args(args: argparse.Namespace) -> dict[str, object]:
    shown = dict(vars(args))
    for secret in ("api_key", "ngrok_authtoken"):
        if shown.get(secret):
            shown[secret] = "<redacted>"
    return shown


def _monitor(shards: list[Shard], router: Child, stop: StopFlag) -> LauncherError | None:
    """Until a stop signal or a death: which child died decides the error."""
    while stop.running():
        for shard in shards:
            if shard.child.poll() is not None:
                logger.error("Shard %d crashed", shard.rank)
                shard.report_exit()
                return ShardFailed()
        if router.poll() is not None:
            logger.error("Webserver Crashed")
            return WebserverFailed()
        time.sleep(0.1)
    return None


def _remove_sockets(shards: list[Shard]) -> None:
    for shard in shards:
        if os.path.exists(shard.socket):
            os.remove(shard.socket)


def serve(args: argparse.Namespace, level: str, stop: StopFlag) -> int:
    config = load_config(args.model_id, args.revision)
    attention, prefix_caching = resolve_attention(config, args.lora_adapters)
    # Set in the launcher's own environment, as TGI does, so that every child inherits them.
    os.environ["ATTENTION"], os.environ["PREFIX_CACHING"] = attention, prefix_caching
    logger.info("Using attention %s - Prefix caching %s", attention, prefix_caching)
    settings: Settings = validate(args, config)
    check_port_free(args.hostname, args.port, "Port")
    if not download_all(args, stop.running) or not stop.running():
        return 0
    shards: list[Shard] = []
    router: Child | None = None
    failure: LauncherError | None = None
    try:
        shards = spawn_shards(args, settings, level)
        # Started now, it imports and loads the tokenizer (seconds of CPU) while the shards load.
        router = spawn_router(args, settings)
        # raises ShardCannotStart if a shard dies first, WebserverFailed if the router does
        if wait_ready(shards, stop.running, router):
            open_router(router)
            failure = _monitor(shards, router, stop)
    finally:
        if router is not None:
            stop_all([router], args.graceful_termination_timeout)
        stop_all([s.child for s in shards], args.graceful_termination_timeout)
        _remove_sockets(shards)
    if failure is not None:
        raise failure
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    level = log_level()
    setup_logging(level, args.json_output)
    if args.env:
        print(runtime_env())
        return 0
    logger.info("Args %s", _public_args(args))
    stop = StopFlag()
    try:
        return serve(args, level, stop)
    except NoDeviceFound as exc:
        print(f"thread 'main' panicked: {exc}", file=sys.stderr)
        return PANIC_EXIT_CODE
    except LauncherError as exc:
        print(exc.render(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
