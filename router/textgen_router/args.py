"""`textgen-router` arguments: TGI's router flags, each also read from its UPPER_SNAKE_CASE env var.

A flag given on the command line wins over the env var, which wins over the default. Boolean flags take
no value; through env, an empty value or `false/f/no/n/off/0` mean false and anything else true (clap's rules).
Subcommand `print-schema` prints the OpenAPI JSON and exits.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from textgen_common.cli_values import U16, U32, USIZE, env_flag


class _Parser:
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def value(
        self, flag: str, type: Callable[[str], object], default: object = None, short: str | None = None, **kw: object
    ) -> None:
        env = flag.lstrip("-").replace("-", "_").upper()
        # A string default is converted by argparse like a CLI value, so a bad env value fails the same way.
        env_value = os.environ.get(env)
        names = [short, flag] if short else [flag]
        self.parser.add_argument(
            *names,
            type=type,
            default=env_value if env_value is not None else default,
            help=f"(env: {env}, default: {default})",
            **kw,  # type: ignore[arg-type]
        )

    def flag(self, flag: str) -> None:
        env = flag.lstrip("-").replace("-", "_").upper()
        self.parser.add_argument(flag, action="store_true", default=env_flag(env), help=f"(env: {env})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="textgen-router", description="textgen router (TGI-compatible HTTP API)")
    p = _Parser(parser)
    p.value("--max-concurrent-requests", USIZE, 128)
    p.value("--max-best-of", USIZE, 2)
    p.value("--max-stop-sequences", USIZE, 4)
    p.value("--max-top-n-tokens", U32, 5)
    p.value("--max-input-tokens", USIZE)
    p.value("--max-total-tokens", USIZE)
    p.value("--waiting-served-ratio", float, 1.2)
    p.value("--max-batch-prefill-tokens", U32, 4096)
    p.value("--max-batch-total-tokens", U32)
    p.value("--max-waiting-tokens", USIZE, 20)
    p.value("--max-batch-size", USIZE)
    p.value("--hostname", str, "0.0.0.0")
    p.value("--port", U16, 3000, short="-p")
    p.value("--prometheus-port", U16, 9000)
    p.value("--master-shard-uds-path", str, "/tmp/textgen-server-0")
    p.value("--tokenizer-name", str, "bigscience/bloom")
    p.value("--tokenizer-config-path", str)
    p.value("--revision", str)
    p.flag("--trust-remote-code")
    p.value("--validation-workers", USIZE, 2)
    p.value("--api-key", str)
    p.flag("--json-output")
    p.value("--otlp-endpoint", str)
    p.value("--otlp-service-name", str, "text-generation-inference.router")
    parser.add_argument("--cors-allow-origin", action="append", help="repeatable (env: CORS_ALLOW_ORIGIN)")
    p.flag("--disable-grammar-support")
    p.value("--max-client-batch-size", USIZE, 4)
    # Not a TGI router flag: the launcher's --lora-adapters, so the router knows the adapters the shards load.
    p.value("--lora-adapters", str)
    # Accepted for drop-in compatibility with TGI's launcher; textgen sends no usage statistics.
    p.value("--usage-stats", str, "on", choices=["on", "off", "no-stack"])
    p.value("--payload-limit", USIZE, 2_000_000)
    p.value("--max-image-fetch-size", USIZE, 1_073_741_824)
    # Not TGI's: the hosts a vision-language model's image URLs may name (comma-separated; `*.example.com` for
    # its subdomains; empty: any), and whether they may resolve to link-local or cloud metadata addresses
    # (image_fetch.py).
    p.value("--image-fetch-allowed-hosts", str, "")
    p.flag("--image-fetch-allow-link-local")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("print-schema", help="print the OpenAPI schema (JSON) and exit")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    # An appended list cannot take an env default through argparse; TGI takes the env value as one origin.
    if args.cors_allow_origin is None and os.environ.get("CORS_ALLOW_ORIGIN"):
        args.cors_allow_origin = [os.environ["CORS_ALLOW_ORIGIN"]]
    return args
