"""The few `config.json` fields the launcher reads (TGI's `RawConfig` -> `Config`)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textgen_launcher.args import QUANTIZE_CHOICES

logger = logging.getLogger("textgen_launcher")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str | None
    max_position_embeddings: int | None
    quantize: str | None
    head_dim: int | None
    num_heads: int | None
    num_kv_heads: int | None
    num_layers: int | None
    hidden_size: int | None
    intermediate_size: int | None
    vocab_size: int | None
    is_vlm: bool
    is_encoder_decoder: bool
    experts_per_token: int
    shared_experts: int
    local_experts: int


def _first(raw: dict[str, Any], *names: str) -> Any:
    return next((raw[n] for n in names if raw.get(n) is not None), None)


def parse_config(raw: dict[str, Any]) -> ModelConfig | None:
    """None where TGI's parse fails too: an unknown `quant_method` makes the whole config unusable."""
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    if quant is not None and quant not in QUANTIZE_CHOICES:
        return None
    hidden = _first(raw, "hidden_size", "n_embd")
    heads = _first(raw, "num_attention_heads", "n_head")
    head_dim = _first(raw, "head_dim") or _first(raw.get("text_config") or {}, "head_dim")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    return ModelConfig(
        model_type=raw.get("model_type"),
        max_position_embeddings=_first(raw, "max_position_embeddings", "max_seq_len", "n_positions"),
        quantize=quant,
        head_dim=head_dim,
        num_heads=heads,
        num_kv_heads=_first(raw, "num_key_value_heads") or heads,
        num_layers=_first(raw, "num_hidden_layers", "n_layer"),
        hidden_size=hidden,
        intermediate_size=_first(raw, "intermediate_size", "n_inner") or (4 * hidden if hidden else None),
        vocab_size=raw.get("vocab_size"),
        is_vlm=raw.get("vision_config") is not None,
        is_encoder_decoder=bool(raw.get("is_encoder_decoder")),
        experts_per_token=_first(raw, "num_experts_per_tok") or 1,
        shared_experts=_first(raw, "n_shared_experts") or 0,
        local_experts=_first(raw, "num_local_experts") or 1,
    )


CONFIG_FETCH_TIMEOUT_S = 10.0


def _hub_config(model_id: str, revision: str | None) -> dict[str, Any] | None:
    """From the hub cache, else one HTTP request (as TGI's launcher does): no retry loop, since a missing
    config only means default limits, and the download step reports an unreachable hub properly."""
    import httpx
    from huggingface_hub import constants, try_to_load_from_cache

    cache = os.environ.get("HUGGINGFACE_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        cached = try_to_load_from_cache(model_id, "config.json", cache_dir=cache, revision=revision)
    except ValueError:  # not a valid repo id
        return None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    if constants.HF_HUB_OFFLINE:
        return None
    token = os.environ.get("HF_TOKEN") or os.environ.get("HF_API_TOKEN")
    url = f"{constants.ENDPOINT}/{model_id}/resolve/{revision or 'main'}/config.json"
    try:
        response = httpx.get(
            url,
            headers={"Authorization": f"Bearer {token}"} if token else None,
            follow_redirects=True,
            timeout=CONFIG_FETCH_TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        logger.debug("No config.json for %s: %s", model_id, exc)
        return None
    return response.json() if response.status_code == 200 else None


def load_config(model_id: str, revision: str | None) -> ModelConfig | None:
    """The model's config from a local directory or the hub (cache first); None when unavailable."""
    local = Path(model_id)
    try:
        if local.is_dir():
            raw = json.loads((local / "config.json").read_text()) if (local / "config.json").is_file() else None
        else:
            raw = _hub_config(model_id, revision)
        return parse_config(raw) if isinstance(raw, dict) else None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        logger.warning("Could not read the config of %s: %s", model_id, exc)
        return None
