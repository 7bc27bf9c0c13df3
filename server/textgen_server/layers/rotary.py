"""Rotary position embedding with every scaling variant transformers knows (linear, dynamic, llama3, yarn...).

Inverse frequencies of a scaled RoPE come from `transformers.modeling_rope_utils`, and its `dynamic_rope_update`
recomputes them for the dynamic/longrope variants, so positions are encoded exactly as the reference models encode
them. Unscaled RoPE, most models', is computed here: it needs no transformers import (model_config.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from textgen_server.model_config import ModelConfig


# The text models with M-RoPE, and the sections transformers gives them where their config names none.
MROPE_TEXT_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text")
MROPE_SECTION = (16, 24, 24)


def head_size(config: ModelConfig) -> int:
    """Per-head width of a decoder config: its `head_dim`, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _default_inv_freq(
    config: ModelConfig, device: torch.device | None = None, **_: object
) -> tuple[torch.Tensor, float]:
    """Unscaled RoPE: 1 / theta^(2i/d); attention scaling 1."""
    dim = head_size(config)
    theta = config.rope_parameters["rope_theta"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (theta**exponents), 1.0


def override_rope_scaling(config: ModelConfig, rope_type: str, factor: float) -> None:
    """Make `config` scale its RoPE by `rope_type` and `factor` in place of the model's own scaling (TGI's
    ROPE_SCALING / ROPE_FACTOR), keeping its base and partial rotary factor. Both engines build their rotary
    embedding from the config with transformers' init functions, so this one change serves them all.

    ValueError for a model without one RoPE for every layer (none at all, or one per layer type).
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(f"a {config.model_type} model has no single rotary position embedding to scale")
    kept = {key: params[key] for key in ("rope_theta", "partial_rotary_factor") if key in params}
    config.rope_parameters = {**kept, "rope_type": rope_type, "factor": factor}


class RotaryEmbedding(nn.Module):
    """cos/sin tables for `position_ids`; attribute names follow what `dynamic_rope_update` expects."""

    inv_freq: torch.Tensor  # a registered buffer (nn.Module's attribute lookup alone types it Tensor | Module)

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = _default_inv_freq(config, device)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

            from textgen_server.model_config import transformers_config

            # transformers' functions read (and standardize) a config of theirs; dynamic_rope_update reads it here
            self.config = transformers_config(config)
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device)
            # recomputes the frequencies past the trained length for the dynamic and longrope variants
            update = torch.no_grad()(dynamic_rope_update(type(self).forward))
            self.forward = update.__get__(self)  # type: ignore[method-assign]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = inv_freq
        # M-RoPE (Qwen2-VL): the frequencies in sections, each turned by one axis of a token's (temporal, height,
        # width) position; transformers' default sections where the config names none.
        section = config.rope_parameters.get("mrope_section") or (
            MROPE_SECTION if config.model_type in MROPE_TEXT_TYPES else None
        )
        self.mrope_axes: torch.Tensor | None = None
        if section is not None:
            axes = [axis % 3 for axis, width in enumerate(section) for _ in range(width)]
            self.mrope_axes = torch.tensor(axes, device=device)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [*position_ids.shape, head_dim] in x's dtype."""
        return self._cos_sin(x, position_ids[..., None].float() * self.inv_freq)

    @torch.no_grad()
    def multimodal(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE's (cos, sin), each [T, head_dim], for positions [3, T]: frequency i turned by axis
        `mrope_axes[i]`'s position, as transformers' Qwen2-VL text model turns it."""
        assert self.mrope_axes is not None, "a model with M-RoPE sections"
        freqs = position_ids[..., None].float() * self.inv_freq  # [3, T, head_dim / 2]
        axes = self.mrope_axes.expand(1, position_ids.shape[1], -1)
        return self._cos_sin(x, freqs.gather(0, axes)[0])

    def _cos_sin(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) in x's dtype of the angles `freqs` [..., head_dim / 2], each half of a head turned alike."""
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the per-position angles cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def rotate_heads_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> None:
    """Rotate x [T, H, D] (each head contiguous) in place, with `textgen::rotary_` (fused_ops.cpp, the same bits
    as `apply_rotary`) when `fused`."""
    if fused:
        torch.ops.textgen.rotary_(x, cos, sin)
    else:
        x.copy_(apply_rotary(x, cos, sin))
