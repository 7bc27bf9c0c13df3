"""Every TGI launcher flag, with its environment variable and default (TGI `launcher/src/main.rs` `Args`).

A flag's environment variable is its name in UPPER_SNAKE_CASE; the command line wins over the
environment. Boolean flags read true from any value but an empty one or `false/f/no/n/off/0` (clap's rule).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any, Callable

from textgen_common.cli_values import U16, U32, USIZE, batch_sizes, env_flag

QUANTIZE_CHOICES = (
    "awq",
    "compressed-tensors",
    "eetq",
    "exl2",
    "gptq",
    "marlin",
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
    "fp8",
)


def true_or_false(value: str) -> bool:
    """`--sharded` takes an explicit value, like clap's `Option<bool>`."""
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"invalid value '{value}' (possible values: true, false)")
    return value == "true"


def size_list(value: str) -> list[int]:
    """`--cuda-graphs 1,2,4`: comma-separated non-negative integers."""
    try:
        return batch_sizes(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"invalid value '{value}' ({error})") from None


def _env_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


class _Builder:
    """Adds flags whose default comes from the environment; remembers which env var fed which flag."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.env_of: dict[str, str] = {}
        # Repeatable flags: clap lets command-line values replace the env value, argparse would append to it.
        self.list_defaults: dict[str, list[str]] = {}

    def value(
        self,
        *flags: str,
        type: Callable[[str], Any] = str,
        default: Any = None,
        choices: Sequence[str] | None = None,
        help: str,
    ) -> None:
        env = _env_name(flags[-1])
        # A string default goes through `type` like a command-line value, so bad env values fail loudly.
        self.parser.add_argument(
            *flags,
            type=type,
            default=os.environ.get(env, default),
            choices=choices,
            help=f"{help} [env: {env}]" + (f" [default: {default}]" if default is not None else ""),
        )
        self.env_of[self.parser._option_string_actions[flags[-1]].dest] = env

    def flag(self, *flags: str, help: str) -> None:
        env = _env_name(flags[-1])
        self.parser.add_argument(
            *flags,
            action="store_true",
            default=env_flag(env),
            help=f"{help} [env: {env}]",
        )

    def many(self, *flags: str, help: str) -> None:
        env = _env_name(flags[-1])
        action = self.parser.add_argument(*flags, action="append", default=None, help=f"{help} [env: {env}]")
        self.list_defaults[action.dest] = [os.environ[env]] if os.environ.get(env) else []


def build_parser() -> tuple[argparse.ArgumentParser, _Builder]:
    parser = argparse.ArgumentParser(
        prog="textgen-launcher",
        usage="%(prog)s [OPTIONS]",
        description="Serve a text-generation model: download its weights, start one shard process per device "
        "and the HTTP router (TGI's text-generation-launcher).",
    )
    b = _Builder(parser)
    b.value("--model-id", default="bigscience/bloom-560m", help="Hub model id or local directory")
    b.value("--revision", help="Hub revision (branch, tag or commit, e.g. refs/pr/2)")
    b.value("--validation-workers", type=USIZE, default="2", help="Tokenizer threads in the router")
    b.value("--sharded", type=true_or_false, help="true|false: shard the model (false disables device detection)")
    b.value("--num-shard", type=USIZE, help="Number of shard processes")
    b.value("--quantize", choices=QUANTIZE_CHOICES, help="Weight quantization (passed to the shards)")
    b.value("--speculate", type=USIZE, help="Number of speculative tokens (passed to the shards)")
    b.value("--dtype", choices=("float16", "bfloat16"), help="Weights dtype")
    b.value("--kv-cache-dtype", choices=("fp8_e4m3fn", "fp8_e5m2"), help="KV cache dtype (passed to the shards)")
    b.flag("--trust-remote-code", help="Allow custom model code from the hub")
    b.value("--max-concurrent-requests", type=USIZE, default="128", help="Requests in flight before 429")
    b.value("--max-best-of", type=USIZE, default="2", help="Largest `best_of`")
    b.value("--max-stop-sequences", type=USIZE, default="4", help="Most `stop` sequences")
    b.value("--max-top-n-tokens", type=U32, default="5", help="Largest `top_n_tokens`")
    b.value("--max-input-tokens", type=USIZE, help="Most prompt tokens (default: decided by the shards' warmup)")
    b.value("--max-input-length", type=USIZE, help="Deprecated alias of --max-input-tokens")
    b.value("--max-total-tokens", type=USIZE, help="Most prompt + generated tokens per request")
    b.value("--waiting-served-ratio", type=float, default="0.3", help="Waiting/running ratio that allows a prefill")
    b.value("--max-batch-prefill-tokens", type=U32, help="Prefill token budget (default: from the model config)")
    b.value("--max-batch-total-tokens", type=U32, help="Token budget of a whole batch")
    b.value("--max-waiting-tokens", type=USIZE, default="20", help="Decode steps before waiting requests are let in")
    b.value("--max-batch-size", type=USIZE, help="Most requests in a batch")
    b.value(
        "--cuda-graphs", type=size_list, help="Comma-separated CUDA graph batch sizes; 0 disables (no effect on CPU)"
    )
    b.value("--hostname", default="0.0.0.0", help="IP address the router listens on")
    b.value("-p", "--port", type=U16, default="3000", help="HTTP port")
    b.value("--prometheus-port", type=U16, default="9000", help="Port of the extra Prometheus listener")
    b.value("--shard-uds-path", default="/tmp/textgen-server", help="Socket prefix; rank r uses <prefix>-<r>")
    b.value("--master-addr", default="localhost", help="torch.distributed master address")
    b.value("--master-port", type=USIZE, default="29500", help="torch.distributed master port")
    b.value("--huggingface-hub-cache", help="Hub cache directory for the download and the shards")
    b.value("--weights-cache-override", help="Directory holding the weights (skips the hub)")
    b.flag(
        "--disable-custom-kernels", help="Shards run torch ops only: no C++ CPU ops, F.linear without a measured choice"
    )
    b.value("--cuda-memory-fraction", type=float, default="1.0", help="Fraction of device memory to use")
    b.value("--rope-scaling", choices=("linear", "dynamic"), help="RoPE scaling type")
    b.value("--rope-factor", type=float, help="RoPE scaling factor")
    b.flag("--json-output", help="Log JSON lines")
    b.value("--otlp-endpoint", help="OTLP gRPC collector for traces (router and shards)")
    b.value("--otlp-service-name", default="text-generation-inference.router", help="OTLP service name")
    b.many("--cors-allow-origin", help="Allowed CORS origin (repeatable)")
    b.value("--api-key", help="Bearer key required on the generation routes")
    b.value("--watermark-gamma", type=float, help="Watermark gamma (passed to the shards)")
    b.value("--watermark-delta", type=float, help="Watermark delta (passed to the shards)")
    b.flag("--ngrok", help="ngrok tunneling (not supported: rejected)")
    b.value("--ngrok-authtoken", help="ngrok auth token")
    b.value("--ngrok-edge", help="ngrok edge")
    b.value("--tokenizer-config-path", help="Local tokenizer_config.json (chat template source)")
    b.flag("--disable-grammar-support", help="Reject requests with a `grammar`")
    parser.add_argument("-e", "--env", action="store_true", help="Print the runtime environment and exit")
    b.value("--max-client-batch-size", type=USIZE, default="4", help="Most prompts in one /v1/completions call")
    b.value("--lora-adapters", help="LoRA adapters: id1,id2 or name=path or id@revision")
    b.value(
        "--usage-stats",
        default="on",
        choices=("on", "off", "no-stack"),
        help="Accepted for compatibility; textgen never sends usage statistics",
    )
    b.value("--payload-limit", type=USIZE, default="2000000", help="HTTP body limit in bytes")
    b.value(
        "--image-fetch-allowed-hosts",
        default="",
        help="Not TGI's: hosts a VLM's image URLs may name (comma-separated, *.example.com for subdomains; empty: any)",
    )
    b.flag(
        "--image-fetch-allow-link-local",
        help="Not TGI's: let image URLs resolve to link-local and cloud metadata addresses",
    )
    b.flag("--enable-prefill-logprobs", help="Compute prompt logprobs (shard env REQUEST_LOGPROBS=1)")
    b.value(
        "-g",
        "--graceful-termination-timeout",
        type=USIZE,
        default="90",
        help="Seconds to let in-flight requests finish on shutdown",
    )
    return parser, b


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser, built = build_parser()
    args = parser.parse_args(argv)
    # argparse checks `choices` only on the command line; values from the environment are checked here.
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.choices and value is not None and value not in action.choices:
            parser.error(
                f"argument {'/'.join(action.option_strings)}: invalid choice: '{value}' from env "
                f"{built.env_of[action.dest]} (choose from {', '.join(action.choices)})"
            )
    for dest, default in built.list_defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    return args
