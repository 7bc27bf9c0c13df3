"""compressed-tensors checkpoints (what llmcompressor writes and vLLM users publish): the schemes served.

`quantization_config` with `quant_method: compressed-tensors` names a `format` and `config_groups`, each a scheme
(weights' and activations' quantization arguments) for the modules its `targets` match, minus the `ignore` list.
Served, for one group targeting every `Linear`:
- `pack-quantized`, int weights of 4 or 8 bits (W4A16, W8A16), symmetric or with zero points, per group or per
  channel, activations left float. Per projection: `weight_packed` int32 [N, K*bits/32], the unsigned values
  q + 2^(bits-1) packed along K from the lowest bits; `weight_scale` [N, groups]; with zero points
  `weight_zero_point` int32 [N*bits/32, groups], z + 2^(bits-1) packed along N the same way; with group act-order a
  `weight_g_idx` [K].
- `int-quantized` W8A8: int8 weights per channel (`weight` int8 [N, K], `weight_scale` [N, 1]) with input
  activations quantized to int8 per token at run time (dynamic, symmetric): the kernel quantizes each row of x as
  the package does and multiplies integers (layers/quant_kernels.py, `Int8DynamicKernel`). Under tensor
  parallelism a row-parallel projection (o_proj, down_proj) sees only its rank's part of each row, and quantizes
  that part with its own scale, as vLLM does: W8A8 tokens on several shards may differ from one shard's.
Every other format, type or strategy is refused at start, naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from textgen_server.config import UnsupportedConfigError
from textgen_server.layers.quantized_weight import QuantConfig, QuantizedWeight, unpack

FORMATS = ("pack-quantized", "int-quantized")


def _refuse(what: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(
        f"compressed-tensors checkpoint with {what} is not supported: textgen serves pack-quantized int4/int8 weights "
        "(W4A16, W8A16) and int-quantized W8A8 with dynamic per-token activations"
    )


def read_ct_config(raw: dict[str, Any]) -> QuantConfig:
    """The served form of a compressed-tensors `quantization_config`; UnsupportedConfigError naming what is not."""
    fmt = str(raw.get("format", ""))
    groups = raw.get("config_groups") or {}
    if fmt not in FORMATS:
        raise _refuse(f"format {fmt or 'none'}")
    if len(groups) != 1:
        raise _refuse(f"{len(groups)} config groups")
    (group,) = groups.values()
    if group.get("format") not in (None, fmt):
        raise _refuse(f"a group in format {group.get('format')}")
    if list(group.get("targets") or []) != ["Linear"]:
        raise _refuse(f"targets {group.get('targets')}")
    weights = group.get("weights") or {}
    bits, strategy = int(weights.get("num_bits", 0)), str(weights.get("strategy"))
    if weights.get("type") != "int" or bits not in (4, 8) or strategy not in ("group", "channel"):
        raise _refuse(f"{weights.get('type')} {bits}-bit weights by {strategy}")
    if weights.get("actorder") not in (None, "group"):
        raise _refuse(f"act-order {weights.get('actorder')}")
    activations = group.get("input_activations")
    if fmt == "pack-quantized" and activations:
        raise _refuse("quantized input activations in pack-quantized format")
    if fmt == "int-quantized":
        wanted = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
        if not activations or any(activations.get(k) != v for k, v in wanted.items()) or bits != 8:
            raise _refuse(f"int-quantized weights of {bits} bits with input activations {activations}")
        if strategy != "channel" or not weights.get("symmetric", True):
            raise _refuse(f"int-quantized W8A8 weights by {strategy}, symmetric {weights.get('symmetric')}")
    return QuantConfig(
        method="compressed-tensors",
        bits=bits,
        group_size=int(weights.get("group_size") or 0) if strategy == "group" else -1,
        desc_act=weights.get("actorder") == "group",
        sym=bool(weights.get("symmetric", True)),
        modules_to_not_convert=tuple(raw.get("ignore") or ()),
        format=fmt,
    )


def load_ct(weights: Any, prefix: str, qc: QuantConfig) -> QuantizedWeight:
    """The projection at `prefix` of a compressed-tensors checkpoint (`weights`: utils.weights.Weights)."""
    scales = weights.get_tensor(f"{prefix}.weight_scale")  # [N, groups], [N, 1] per channel
    offset = 1 << (qc.bits - 1)  # the stored values are the signed ones plus this
    if qc.format == "int-quantized":
        q = (weights.get_tensor(f"{prefix}.weight").to(torch.int16) + offset).to(torch.uint8)
    else:
        q = unpack(weights.get_tensor(f"{prefix}.weight_packed"), qc.bits, dim=1)
    n, k = q.shape
    if f"{prefix}.weight_zero_point" in weights:
        zeros = unpack(weights.get_tensor(f"{prefix}.weight_zero_point"), qc.bits, dim=0)[:n].to(scales.dtype)
    else:
        zeros = torch.full_like(scales, offset)
    group = k if qc.group_size == -1 else qc.group_size
    g_name = f"{prefix}.weight_g_idx"
    g_idx = weights.get_tensor(g_name).long() if g_name in weights else torch.arange(k) // group
    if scales.shape != (n, k // group) or zeros.shape != scales.shape or g_idx.shape[0] != k:
        raise ValueError(
            f"{prefix}: inconsistent compressed-tensors tensors (q {tuple(q.shape)}, scales {tuple(scales.shape)}, "
            f"zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)})"
        )
    return QuantizedWeight(q, zeros, scales, g_idx, qc.bits, group, dynamic_activations=qc.format == "int-quantized")
