"""Environment variables the launcher gives its children (TGI `download_convert_model`, `shard_manager`,
`spawn_webserver`)."""

from __future__ import annotations

import argparse
import os

from textgen_launcher.validate import Settings


def base_env(args: argparse.Namespace) -> dict[str, str]:
    """Download and shard processes: the launcher's environment minus LOG_LEVEL (they get --logger-level)."""
    env = {k: v for k, v in os.environ.items() if k != "LOG_LEVEL"}
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # HF_HUB_ENABLE_HF_TRANSFER is passed through when set but not defaulted to 1 as in TGI: recent
    # huggingface_hub no longer uses hf_transfer and warns about the variable.
    if os.environ.get("HF_API_TOKEN"):
        env["HF_TOKEN"] = os.environ["HF_API_TOKEN"]
    if args.huggingface_hub_cache:
        env["HUGGINGFACE_HUB_CACHE"] = args.huggingface_hub_cache
    if args.weights_cache_override:
        env["WEIGHTS_CACHE_OVERRIDE"] = args.weights_cache_override
    return env


def rope_env(scaling: str | None, factor: float | None) -> dict[str, str]:
    """Either flag alone implies the other: scaling without factor is 1.0, factor without scaling is linear."""
    if scaling is None and factor is None:
        return {}
    return {"ROPE_SCALING": scaling or "linear", "ROPE_FACTOR": str(factor if factor is not None else 1.0)}


def shard_env(args: argparse.Namespace, settings: Settings, rank: int) -> dict[str, str]:
    env = base_env(args)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(settings.num_shard),
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(args.master_port),
        TORCH_NCCL_AVOID_RECORD_STREAMS="1",
        CUDA_MEMORY_FRACTION=str(args.cuda_memory_fraction),
        SAFETENSORS_FAST_GPU="1",
    )
    env.update(rope_env(args.rope_scaling, args.rope_factor))
    optional = {
        "MAX_TOTAL_TOKENS": args.max_total_tokens,
        "MAX_BATCH_SIZE": args.max_batch_size,
        "LORA_ADAPTERS": args.lora_adapters,
        "WATERMARK_GAMMA": args.watermark_gamma,
        "WATERMARK_DELTA": args.watermark_delta,
        "CUDA_GRAPHS": ",".join(map(str, settings.cuda_graphs)) or None,
        "REQUEST_LOGPROBS": "1" if args.enable_prefill_logprobs else None,
        "DISABLE_CUSTOM_KERNELS": "True" if args.disable_custom_kernels else None,
    }
    env.update({k: str(v) for k, v in optional.items() if v is not None})
    return env


def router_env(args: argparse.Namespace, num_shard: int, card: str | None) -> dict[str, str]:
    """The router inherits everything (LOG_LEVEL included); COMPUTE_TYPE names the hardware in `x-compute-type`.

    The hub cache given as a flag reaches the router too (it reads the tokenizer from the same snapshot).
    """
    env = dict(os.environ)
    if args.api_key is not None:
        env["API_KEY"] = args.api_key
    if args.huggingface_hub_cache:
        env["HUGGINGFACE_HUB_CACHE"] = args.huggingface_hub_cache
    if os.environ.get("HF_API_TOKEN"):
        env["HF_TOKEN"] = os.environ["HF_API_TOKEN"]
    if "COMPUTE_TYPE" not in env and card:
        env["COMPUTE_TYPE"] = f"{num_shard}-{card.lower().replace(' ', '-')}"
    return env
