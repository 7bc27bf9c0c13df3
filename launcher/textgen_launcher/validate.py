"""TGI's start-up checks (launcher `main`, in TGI's order and with its messages) and the settings they derive."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from textgen_launcher.config import ModelConfig
from textgen_launcher.devices import find_num_shards
from textgen_launcher.errors import ArgumentValidation
from textgen_launcher.limits import default_max_batch_prefill_tokens

logger = logging.getLogger("textgen_launcher")
DEFAULT_CUDA_GRAPHS = [1, 2, 4, 8, 16, 32]


@dataclass(frozen=True)
class Settings:
    """What the launcher derives from the flags and the model config before starting anything."""

    num_shard: int
    max_input_tokens: int | None
    max_batch_prefill_tokens: int
    quantize: str | None
    cuda_graphs: list[int]


def _cuda_graphs(requested: list[int] | None, quantize: str | None) -> list[int]:
    if requested is not None:
        return [size for size in requested if size > 0]
    if quantize in ("bitsandbytes", "exl2"):
        logger.warning("%s doesn't work with cuda graphs, deactivating them", quantize.capitalize())
        return []
    return list(DEFAULT_CUDA_GRAPHS)


def validate(args: argparse.Namespace, config: ModelConfig | None) -> Settings:
    """Raises ArgumentValidation / NotEnoughCUDADevices / NoDeviceFound exactly where TGI fails."""
    num_shard = find_num_shards(args.sharded, args.num_shard)
    if num_shard > 1 and args.quantize == "exl2":
        raise ArgumentValidation("Sharding is currently not supported with `exl2` quantization")
    if args.max_input_tokens is not None and args.max_input_length is not None:
        raise ArgumentValidation(
            f"Both `max_input_tokens` ({args.max_input_tokens}) and `max_input_length` ({args.max_input_length}) "
            "are set. Please define only `max_input_tokens` as `max_input_length is deprecated for naming consistency."
        )
    max_input = args.max_input_tokens if args.max_input_tokens is not None else args.max_input_length
    prefill = args.max_batch_prefill_tokens
    if prefill is None:
        prefill = default_max_batch_prefill_tokens(config, num_shard, args.cuda_memory_fraction)
    if max_input is not None and args.max_total_tokens is not None and max_input >= args.max_total_tokens:
        raise ArgumentValidation(
            f"`max_input_tokens`({max_input}) must be < `max_total_tokens`({args.max_total_tokens})"
        )
    if args.quantize == "bitsandbytes":
        logger.warning(
            "Bitsandbytes is deprecated, use `eetq` instead, which provides better latencies overall "
            "and is drop-in in most cases."
        )
    quantize = args.quantize or (config.quantize if config else None)
    cuda_graphs = _cuda_graphs(args.cuda_graphs, quantize)
    if args.validation_workers == 0:
        raise ArgumentValidation("`validation_workers` must be > 0")
    if args.trust_remote_code:
        logger.warning(
            "`trust_remote_code` is set. Trusting that model `%s` do not contain malicious code.", args.model_id
        )
    if (
        args.max_batch_total_tokens is not None
        and args.max_total_tokens is not None
        and args.max_total_tokens > args.max_batch_total_tokens
    ):
        raise ArgumentValidation(
            f"`max_total_tokens` must be <= `max_batch_total_tokens`. "
            f"Given: {args.max_total_tokens} and {args.max_batch_total_tokens}"
        )
    if args.ngrok:
        if args.ngrok_authtoken is None:
            raise ArgumentValidation("`ngrok-authtoken` must be set when using ngrok tunneling")
        if args.ngrok_edge is None:
            raise ArgumentValidation("`ngrok-edge` must be set when using ngrok tunneling")
        # TGI's own router panics on ngrok at runtime; refusing here is the honest version of that.
        raise ArgumentValidation("ngrok tunneling is not supported by textgen; expose the port another way")
    return Settings(num_shard, max_input, prefill, quantize, cuda_graphs)
