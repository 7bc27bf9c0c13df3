"""Shard processes: one `textgen-server serve` per rank, ready once its socket answers the Health RPC."""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from textgen_launcher.children import Child, stop_all
from textgen_launcher.download import SERVER_BIN
from textgen_launcher.environment import shard_env
from textgen_launcher.errors import ArgumentValidation, ShardCannotStart, WebserverFailed
from textgen_launcher.forward import LineForwarder
from textgen_launcher.validate import Settings

logger = logging.getLogger("textgen_launcher")
# Until a shard's socket exists a probe is one stat: polled this often, the router's gate opens within 20 ms of the
# last shard's readiness (at 0.1 s, 50 ms on average was added to every launch).
POLL_S = 0.02
WAITING_LOG_EVERY_S = 5.0


@dataclass
class Shard:
    rank: int
    socket: str
    child: Child

    def report_exit(self) -> None:
        """What a dead shard left on stderr (TGI prints it only when the shard ends)."""
        self.child.drain()
        if self.child.stderr_tail:
            logger.error("Shard complete standard error output:\n%s", self.child.stderr_text())
        code = self.child.poll()
        if code is not None and code < 0:
            logger.error("Shard process was signaled to shutdown with signal %d", -code)


def shard_command(args: argparse.Namespace, settings: Settings, log_level: str) -> list[str]:
    """TGI's argument order; `--uds-path` is the prefix, the shard appends `-<rank>`."""
    cmd = [
        SERVER_BIN,
        "serve",
        args.model_id,
        "--uds-path",
        args.shard_uds_path,
        "--logger-level",
        log_level,
        "--json-output",
    ]
    if args.trust_remote_code:
        cmd.append("--trust-remote-code")
    if settings.num_shard > 1:
        cmd.append("--sharded")
    for flag, value in (
        ("--quantize", settings.quantize),
        ("--speculate", args.speculate),
        ("--dtype", args.dtype),
        ("--kv-cache-dtype", args.kv_cache_dtype),
        ("--revision", args.revision),
        ("--otlp-endpoint", args.otlp_endpoint),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += ["--otlp-service-name", args.otlp_service_name]
    if settings.max_input_tokens is not None:
        cmd += ["--max-input-tokens", str(settings.max_input_tokens)]
    return cmd


def socket_path(prefix: str, rank: int) -> str:
    return f"{prefix}-{rank}"


def spawn_shards(args: argparse.Namespace, settings: Settings, log_level: str) -> list[Shard]:
    shards: list[Shard] = []
    cmd = shard_command(args, settings, log_level)
    paths = [socket_path(args.shard_uds_path, rank) for rank in range(settings.num_shard)]
    for path in paths:
        # TGI deletes whatever is there; a socket that still answers belongs to another launcher's shard.
        if os.path.exists(path):
            from textgen_launcher.health import answers_health  # see wait_ready

            if answers_health(path):
                raise ArgumentValidation(f"{path} is the socket of a running shard; choose another --shard-uds-path")
    for rank, path in enumerate(paths):
        if os.path.exists(path):  # a stale socket from an earlier run would look ready
            os.remove(path)
        logger.info("Starting shard %d", rank)
        forwarder = LineForwarder(f"shard {rank}", {"rank": rank}, args.json_output)
        try:
            child = Child(f"shard {rank}", cmd, shard_env(args, settings, rank), forwarder.emit, echo_stderr=False)
        except FileNotFoundError:
            logger.error("%s not found in PATH", SERVER_BIN)
            logger.error("Please install it with `make install`")
            stop_all([s.child for s in shards], args.graceful_termination_timeout)
            raise ShardCannotStart() from None
        shards.append(Shard(rank, path, child))
    return shards


def wait_ready(shards: list[Shard], running: Callable[[], bool], router: Child) -> bool:
    """Blocks until every shard answers Health; False if a stop signal came first.

    A shard that exits before it is ready raises ShardCannotStart, and the router (started meanwhile, behind its
    gate) exiting raises WebserverFailed: the caller stops the others.
    """
    # Imported here, while the shards load: the launcher starts them before it imports gRPC (about 0.1 s).
    from textgen_launcher.health import answers_health

    start = time.monotonic()
    pending = {s.rank: s for s in shards}
    next_log = start + WAITING_LOG_EVERY_S
    while pending:
        if not running():
            return False
        if router.poll() is not None:
            logger.error("Webserver Crashed")
            raise WebserverFailed()
        for rank, shard in list(pending.items()):
            if shard.child.poll() is not None:
                logger.error("Shard %d failed to start", rank)
                shard.report_exit()
                raise ShardCannotStart()
            if answers_health(shard.socket):
                logger.info("Shard %d ready in %.1fs", rank, time.monotonic() - start)
                del pending[rank]
        if time.monotonic() >= next_log:
            for rank in pending:
                logger.info("Waiting for shard %d to be ready...", rank)
            next_log += WAITING_LOG_EVERY_S
        if pending:
            time.sleep(POLL_S)
    return True
