"""TGI's `resolve_attention`: the ATTENTION and PREFIX_CACHING values every shard inherits.

An explicit ATTENTION / PREFIX_CACHING in the environment always wins. One difference from TGI: a vision-language
model keeps prefix caching (TGI turns it off for every VLM), for the router keys an image's tokens by the image
(textgen_router.images.cache_key) and the shards embed any run of a prompt's positions alike (models/paged_vlm.py).
"""

from __future__ import annotations

import logging
import os

from textgen_launcher.config import ModelConfig
from textgen_launcher.devices import has_gpu_driver

logger = logging.getLogger("textgen_launcher")
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def cuda_major() -> int | None:
    if not has_gpu_driver():
        return None
    import torch

    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None


def fallback_attention() -> str:
    major = cuda_major()
    return "paged" if major is None or major < 8 else "flashdecoding"


def resolve_attention(config: ModelConfig | None, lora_adapters: str | None) -> tuple[str, str]:
    """Returns (attention, prefix_caching)."""
    attention = os.environ.get("ATTENTION")
    prefix_caching = os.environ.get("PREFIX_CACHING")
    if config is not None:
        if prefix_caching is None and config.is_encoder_decoder:
            logger.info("Disabling prefix caching because of seq2seq model")
            prefix_caching = "0"
        if config.head_dim in FLASHINFER_HEAD_DIMS:
            if lora_adapters and prefix_caching is None:
                logger.info("Disabling prefix caching because of lora adapters")
                prefix_caching = "0"
            if config.model_type in ("falcon", "deepseek_v2") and attention is None:
                attention = fallback_attention()
                logger.info("Forcing attention to '%s' because model %s requires it", attention, config.model_type)
        else:
            if attention is None:
                attention = fallback_attention()
                logger.info(
                    "Forcing attention to '%s' because head dim is not supported by flashinfer, "
                    "also disabling prefix caching",
                    attention,
                )
            if prefix_caching is None:
                prefix_caching = "0"
    if attention == "paged" and prefix_caching is None:
        logger.info("Disabling prefix caching on paged attention")
        prefix_caching = "0"
    return attention or "flashinfer", prefix_caching or "true"
