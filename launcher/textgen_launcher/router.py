"""The router process: `textgen-router` with the launcher's limits, pointed at rank 0's socket."""

from __future__ import annotations

import argparse
import logging
import sys

from textgen_common import router_gate
from textgen_launcher.children import Child
from textgen_launcher.devices import nvidia_smi
from textgen_launcher.environment import router_env
from textgen_launcher.errors import WebserverCannotStart
from textgen_launcher.shards import socket_path
from textgen_launcher.validate import Settings

logger = logging.getLogger("textgen_launcher")
ROUTER_BIN = "textgen-router"


def router_command(args: argparse.Namespace, settings: Settings) -> list[str]:
    """TGI's `spawn_webserver` arguments, same order; optional ones only when set.

    The API key goes through the router's environment (API_KEY) instead: a command line is public in `ps`.
    """
    cmd = [ROUTER_BIN]
    for flag, value in (
        ("--max-client-batch-size", args.max_client_batch_size),
        ("--max-concurrent-requests", args.max_concurrent_requests),
        ("--max-best-of", args.max_best_of),
        ("--max-stop-sequences", args.max_stop_sequences),
        ("--max-top-n-tokens", args.max_top_n_tokens),
        ("--max-batch-prefill-tokens", settings.max_batch_prefill_tokens),
        ("--waiting-served-ratio", args.waiting_served_ratio),
        ("--max-waiting-tokens", args.max_waiting_tokens),
        ("--validation-workers", args.validation_workers),
        ("--hostname", args.hostname),
        ("--port", args.port),
        ("--prometheus-port", args.prometheus_port),
        ("--master-shard-uds-path", socket_path(args.shard_uds_path, 0)),
        ("--tokenizer-name", args.model_id),
        ("--payload-limit", args.payload_limit),
        ("--max-input-tokens", settings.max_input_tokens),
        ("--max-total-tokens", args.max_total_tokens),
        ("--usage-stats", args.usage_stats),
        ("--tokenizer-config-path", args.tokenizer_config_path),
        ("--max-batch-total-tokens", args.max_batch_total_tokens),
        ("--max-batch-size", args.max_batch_size),
        ("--revision", args.revision),
        ("--otlp-endpoint", args.otlp_endpoint),
        ("--otlp-service-name", args.otlp_service_name),
        # Not a TGI router flag: textgen's router refuses unknown adapters and lists the loaded ones.
        ("--lora-adapters", args.lora_adapters),
        # Not TGI's: what a vision-language model's image URLs may reach (textgen_router.image_fetch).
        ("--image-fetch-allowed-hosts", args.image_fetch_allowed_hosts or None),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    for flag, on in (
        ("--disable-grammar-support", args.disable_grammar_support),
        ("--trust-remote-code", args.trust_remote_code),
        ("--json-output", args.json_output),
        ("--image-fetch-allow-link-local", args.image_fetch_allow_link_local),
    ):
        if on:
            cmd.append(flag)
    for origin in args.cors_allow_origin:
        cmd += ["--cors-allow-origin", origin]
    return cmd


def _echo(line: str) -> None:
    # TGI prints the router's lines verbatim: the router already formats them (JSON with --json-output).
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def spawn_router(args: argparse.Namespace, settings: Settings) -> Child:
    """The router, started behind the gate (textgen_common.router_gate): it loads its tokenizer while the shards
    load and connects once `open_router` is called."""
    cards = nvidia_smi("gpu_name")
    env = router_env(args, settings.num_shard, cards[0] if cards else None)
    env[router_gate.GATE_ENV] = "1"
    logger.debug("Loading the webserver's tokenizer while the shards start")
    try:
        return Child("webserver", router_command(args, settings), env, _echo, echo_stderr=True, stdin_pipe=True)
    except FileNotFoundError:
        logger.error("%s not found in PATH", ROUTER_BIN)
        logger.error("Please install it with `make install`")
        raise WebserverCannotStart() from None


def open_router(router: Child) -> None:
    """Every shard is ready: the router may connect to them (TGI starts its webserver at this point)."""
    logger.info("Starting Webserver")
    router.send_line(router_gate.READY)
