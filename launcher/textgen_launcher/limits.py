"""TGI's default `max_batch_prefill_tokens` (launcher `main.rs`, v3): a FLOPs estimate on known cards,
else a per-model default, clamped to the context length and to what device memory can hold.

`max_input_tokens` / `max_total_tokens` are not computed here: as in TGI, the shards decide them during
Warmup unless the user set them.
"""

from __future__ import annotations

import logging
import os

from textgen_launcher.config import ModelConfig
from textgen_launcher.devices import nvidia_smi

logger = logging.getLogger("textgen_launcher")

# Dense f16 TFLOPS per card, keyed by a fragment of the lower-cased nvidia-smi name (most specific first).
CARD_TFLOPS = (
    ("h200", 989),
    ("h100", 900),
    ("a100", 312),
    ("l40s", 363),
    ("l40", 181),
    ("a10g", 125),
    ("a40", 149),
    ("l4", 121),
    ("t4", 65),
    ("4090", 82),
)
DEFAULT_PREFILL = 4096
MODEL_PREFILL = {"qwen2_vl": 10000, "qwen2_5_vl": 10000, "gemma3": 8000}
F16_BYTES = 2


def card_tflops(card_name: str) -> int | None:
    name = card_name.lower()
    return next((flops for key, flops in CARD_TFLOPS if key in name), None)


def known(*values: int | None) -> list[int] | None:
    """The values when none is None (a config field the estimate needs but the model's config lacks)."""
    present = [v for v in values if v is not None]
    return present if len(present) == len(values) else None


def flops_per_token(c: ModelConfig) -> int | None:
    dims = known(c.num_layers, c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size)
    if c.is_vlm or dims is None:
        return None
    layers, hidden, head_dim, heads, kv_heads, intermediate = dims
    # q, k, v, attention and o projections (k and v on the kv heads), then the MLP of the active experts.
    attention = 2 * hidden * head_dim * (3 * heads + 2 * kv_heads)
    mlp = 6 * hidden * intermediate * (c.experts_per_token + c.shared_experts)
    return layers * (attention + mlp)


def compute_optimal(c: ModelConfig | None, cards: list[str], num_shard: int) -> int | None:
    if c is None or not cards:
        return None
    tflops, per_token = card_tflops(cards[0]), flops_per_token(c)
    if tflops is None or not per_token:
        return None
    optimal = tflops * 10**12 * num_shard // per_token
    return optimal if optimal > 100 else None


def model_bytes(c: ModelConfig) -> int | None:
    """f16 weight bytes; None for quantized models, whose size this estimate cannot know."""
    dims = known(
        c.vocab_size, c.hidden_size, c.num_layers, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
    )
    if c.quantize or dims is None:
        return None
    vocab, hidden, layers, head_dim, heads, kv_heads, intermediate = dims
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate * c.local_experts
    return F16_BYTES * (2 * vocab * hidden + layers * (attention + mlp))


def token_bytes(c: ModelConfig) -> int | None:
    """KV bytes per token, plus the active experts' intermediate activations of a MoE model."""
    dims = known(c.num_layers, c.num_kv_heads, c.head_dim)
    if dims is None:
        return None
    layers, kv_heads, head_dim = dims
    kv = 2 * layers * kv_heads * head_dim * F16_BYTES
    if c.experts_per_token <= 1:
        return kv
    if c.intermediate_size is None:
        return None
    return kv + c.intermediate_size * c.experts_per_token * F16_BYTES


def vram_cap(c: ModelConfig, memory_mib: list[str], num_shard: int, fraction: float) -> int | None:
    weights, per_token = model_bytes(c), token_bytes(c)
    if not memory_mib or weights is None or not per_token:
        return None
    wiggle = float(os.environ.get("TGI_WIGGLE_ROOM", "0.95"))
    total = int(memory_mib[0].split()[0]) * 2**20 * num_shard * fraction * wiggle
    return max(int((total - weights) // per_token), 0)


def default_max_batch_prefill_tokens(c: ModelConfig | None, num_shard: int, memory_fraction: float) -> int:
    cards = nvidia_smi("gpu_name") or []
    model_type = (c.model_type if c else None) or ""
    value = compute_optimal(c, cards, num_shard) or MODEL_PREFILL.get(model_type, DEFAULT_PREFILL)
    if c is not None and c.max_position_embeddings:
        value = min(value, c.max_position_embeddings)
    cap = vram_cap(c, nvidia_smi("memory.total") or [], num_shard, memory_fraction) if c and cards else None
    if cap is not None and cap < value:
        logger.warning(
            "Reducing the max batch prefill from %d to %d because there is not enough VRAM to support it.", value, cap
        )
        value = cap
    logger.info("Default `max_batch_prefill_tokens` to %d", value)
    return value
