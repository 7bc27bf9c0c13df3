"""`textgen-server`: serve a model shard, download weights, or build a local test model.

serve's contract with the launcher: listens on unix://{--uds-path}-{RANK}; with --sharded, RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT must be in the environment. Readiness = Health answers on that socket. A
configuration it cannot honour exits non-zero after one clear log line; SIGTERM/SIGINT exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys

from textgen_common.logs import setup_logging
from textgen_server.build_choices import TEXT_ARCHS, TEXT_SIZES, VLM_ARCHS, VLM_SIZE_NAMES, check_build
from textgen_server.config import DTYPES, ServeConfig, UnsupportedConfigError

logger = logging.getLogger("textgen_server.cli")

SHARDED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def add_logging_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logger-level", default="INFO")
    parser.add_argument("--json-output", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="textgen-server", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve one model shard over gRPC on a unix socket")
    serve.add_argument("model_id")
    serve.add_argument("--revision")
    serve.add_argument("--sharded", action="store_true")
    serve.add_argument("--quantize")
    serve.add_argument("--speculate", type=int)
    serve.add_argument("--dtype", choices=DTYPES)
    serve.add_argument("--kv-cache-dtype")
    serve.add_argument("--trust-remote-code", action="store_true")
    serve.add_argument("--uds-path", default="/tmp/textgen-server")
    add_logging_options(serve)
    serve.add_argument("--otlp-endpoint")
    serve.add_argument("--otlp-service-name", default="text-generation-inference.server")
    serve.add_argument("--max-input-tokens", type=int)

    download = commands.add_parser("download-weights", help="fetch a model's weights into the local cache")
    download.add_argument("model_id")
    download.add_argument("--revision")
    download.add_argument("--extension", default=".safetensors")
    download.add_argument("--auto-convert", action=argparse.BooleanOptionalAction, default=True)
    add_logging_options(download)

    build = commands.add_parser("build-test-model", help="build a small random model with a local tokenizer")
    build.add_argument("out_dir")
    # Choices are checked by run_build (as argparse choices the message would not be the builders' one line).
    build.add_argument("--arch", default="llama", help=" | ".join(TEXT_ARCHS + VLM_ARCHS))
    build.add_argument(
        "--size", default="tiny", help=f"{' | '.join(TEXT_SIZES)} (vision-language archs: {' | '.join(VLM_SIZE_NAMES)})"
    )
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--lora-adapter", metavar="ADAPTER_DIR", help="also write a random PEFT LoRA adapter here")
    build.add_argument("--lora-rank", type=int, default=8)
    build.add_argument("--lora-seed", type=int, default=1)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    config = ServeConfig.from_args(args)
    if config.sharded:
        missing = [name for name in SHARDED_ENV if name not in os.environ]
        if missing:
            logger.error("--sharded requires the environment variables %s", ", ".join(missing))
            return 1
    try:
        config.check()
    except UnsupportedConfigError as error:
        logger.error("%s", error)
        return 1

    # What the imports below make (torch and the rest: ~200k objects) lives as long as the process. The collector
    # is off while they are made: it ran 415 times over them, 0.42-0.44 s of their 3.0-3.1 s on a 2-core Zen 3
    # (benchmark/README.md). Frozen then, the collections during the load, and the full one before the KV
    # pool is sized, walk only what the load makes; the few thousand objects the imports left unreachable stay.
    gc.disable()
    from textgen_server.hub import ModelNotFoundError
    from textgen_server.interceptor import setup_tracing
    from textgen_server.loader import get_model
    from textgen_server.model_thread import model_thread
    from textgen_server.servicer import serve
    from textgen_server.utils.memory import keep_freed_memory

    gc.freeze()
    gc.enable()
    keep_freed_memory()  # before the model thread starts, so that it allocates from the main heap (utils/memory.py)
    if config.otlp_endpoint:
        setup_tracing(config.otlp_endpoint, config.otlp_service_name)
    # Loaded on the thread that will run it: model_thread.py says why the main thread runs no torch kernel.
    worker = model_thread()
    try:
        model = worker.submit(get_model, config).result()
    except (UnsupportedConfigError, ModelNotFoundError) as error:
        logger.error("%s", error)
        return 1
    except Exception:
        logger.exception("Error when initializing model")
        return 1
    # The model load left hundreds of thousands of long-lived objects (torch, transformers): frozen, the
    # collector never walks them again, so no step pays for a full collection over them (benchmark/README.md).
    gc.freeze()
    fatal = asyncio.run(serve(model, config, worker))
    worker.shutdown()  # its last call ends before the interpreter does: no kernel left running at exit
    return 1 if fatal else 0


def run_download(args: argparse.Namespace) -> int:
    from textgen_server.hub import ModelNotFoundError, download_weights

    try:
        download_weights(args.model_id, args.revision, args.extension, args.auto_convert)
    except ModelNotFoundError as error:
        logger.error("%s", error)
        return 1
    return 0


def run_build(args: argparse.Namespace) -> int:
    try:
        # Checked before the builders' imports (torch, transformers), so that a wrong request fails at once.
        check_build(args.arch, args.size)
        if args.arch in VLM_ARCHS and args.lora_adapter:
            raise ValueError(f"{args.arch} is built without a LoRA adapter")
        from textgen_server.builder import build_test_adapter, build_test_model
        from textgen_server.vlm_builder import build_test_vlm

        if args.arch in VLM_ARCHS:
            model_dir = build_test_vlm(args.out_dir, args.arch, seed=args.seed, size=args.size)
        else:
            model_dir = build_test_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed)
        print(model_dir)
        if args.lora_adapter:
            print(build_test_adapter(args.lora_adapter, model_dir, rank=args.lora_rank, seed=args.lora_seed))
    except ValueError as err:  # a refusal, the CLI's or a builder's: one line, not a traceback
        logger.error("%s", err)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(getattr(args, "logger_level", "INFO"), getattr(args, "json_output", False))
    runners = {"serve": run_serve, "download-weights": run_download, "build-test-model": run_build}
    sys.exit(runners[args.command](args))


if __name__ == "__main__":
    main()
