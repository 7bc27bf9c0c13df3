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


def _config_path(model_id: str, revision: str | None) -> Path | None:
    local = Path(model_id) / "config.json"
    if Path(model_id).is_dir():
        return local if local.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        token = os.environ.get("HF_TOKEN") or os.environ.get("HF_API_TOKEN")
        return Path(hf_hub_download(model_id, "config.json", revision=revision, token=token))
    except Exception as exc:  # noqa: BLE001 - any hub failure means "no config", as in TGI
        logger.debug("No config.json for %s: %s", model_id, exc)
        return None


def load_config(model_id: str, revision: str | None) -> ModelConfig | None:
    """The model's config from a local directory or the hub (cache first); None when unavailable."""
    path = _config_path(model_id, revision)
    if path is None:
        return None
    try:
        return parse_config(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        logger.warning("Could not parse %s: %s", path, exc)
        return None
