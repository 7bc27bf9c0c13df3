"""Quantized checkpoints (`--quantize gptq | awq | eetq | compressed-tensors`): which one a model is, and reading it.

A checkpoint says how it was quantized in config.json's `quantization_config` (or, for older GPTQ exports, a
`quantize_config.json` / `quant_config.json` beside it), as TGI reads it. The two layouts served, per projection
`<prefix>` with W of shape [N out, K in] and groups of G input features:
- GPTQ v1 (AutoGPTQ, optimum): `qweight` int32 [K*bits/32, N] packed along K (word i holds rows k = i*(32/bits)+j
  at bit offset bits*j), `qzeros` int32 [K/G, N*bits/32] packed along N the same way and storing zero - 1,
  `scales` [K/G, N], `g_idx` int32 [K] (the group of each input feature: with act-order, `desc_act`, not k // G).
- AWQ GEMM (AutoAWQ): `qweight` int32 [K, N/8] packed along N with the 8 columns of a word interleaved
  (column n0 + AWQ_ORDER[j] in nibble j), `qzeros` the same way, holding the zero itself, `scales` [K/G, N].
Both dequantize as W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)], the form `QuantizedWeight`
(layers/quantized_weight.py) holds.
`eetq` (TGI's int8 weight-only quantization at load) makes that form from a float checkpoint: symmetric int8, one
scale per output feature, computed over the whole row before tensor parallelism splits it (so any shard count
computes with the same integers). compressed-tensors checkpoints are read by layers/ct_format.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from textgen_server.config import UnsupportedConfigError
from textgen_server.layers.ct_format import load_ct, read_ct_config
from textgen_server.layers.quantized_weight import QuantConfig, QuantizedWeight, unpack

# TGI's --quantize values; the ones a CPU shard serves, and what it says for the others.
SERVED = ("gptq", "awq", "eetq", "compressed-tensors")
QUANTIZED_AT_LOAD = ("eetq",)
REFUSED = {
    "bitsandbytes": "bitsandbytes' kernels need a CUDA GPU",
    "bitsandbytes-nf4": "bitsandbytes' kernels need a CUDA GPU",
    "bitsandbytes-fp4": "bitsandbytes' kernels need a CUDA GPU",
    "marlin": "Marlin's kernels need a CUDA GPU; serve the GPTQ checkpoint with --quantize gptq",
    "exl2": "exllama's kernels need a CUDA GPU; a GPTQ export of the model serves with --quantize gptq",
    "fp8": "torch has no fp8 matmul on a CPU, so fp8 weights would run no faster than bfloat16; use --quantize eetq "
    "(int8) or a GPTQ or AWQ checkpoint",
}
# AutoAWQ's GEMM packing: nibble j of a word holds column AWQ_ORDER[j] of its 8 columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _raw_quant_config(model_dir: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    if isinstance(config.get("quantization_config"), dict):
        return dict(config["quantization_config"])
    for name in ("quantize_config.json", "quant_config.json"):  # AutoGPTQ's and AutoAWQ's own files
        path = model_dir / name
        if path.is_file():
            raw: dict[str, Any] = json.loads(path.read_text())
            raw.setdefault("quant_method", "awq" if name == "quant_config.json" else "gptq")
            return raw
    return None


def read_quant_config(model_dir: Path, config: dict[str, Any], requested: str | None) -> QuantConfig | None:
    """The checkpoint's quantization as served, or None for a float checkpoint served as is.

    `requested` is `--quantize` (the launcher passes what it detected); UnsupportedConfigError for a method this
    shard does not serve, a flag that contradicts the checkpoint, or a layout it cannot read.
    """
    if requested is not None and requested not in SERVED:
        reason = REFUSED.get(requested, "not a quantization textgen knows")
        raise UnsupportedConfigError(f"--quantize {requested} is not supported: {reason}")
    raw = _raw_quant_config(model_dir, config)
    method = str(raw.get("quant_method", "")).lower() if raw else None
    if method and method not in SERVED:
        reason = REFUSED.get(method, "not a quantization textgen serves")
        raise UnsupportedConfigError(f"the checkpoint's quantization ({method}) is not supported: {reason}")
    if requested is None and method is None:
        return None
    if requested in QUANTIZED_AT_LOAD:
        if method is not None:
            raise UnsupportedConfigError(
                f"--quantize {requested} quantizes float weights at load; this checkpoint is already quantized with "
                f"{method} (drop --quantize, or give --quantize {method})"
            )
        return QuantConfig(method=requested, bits=8, group_size=-1)
    if method is None or raw is None:
        raise UnsupportedConfigError(
            f"--quantize {requested} needs a checkpoint quantized with {requested} (a quantization_config in "
            "config.json): textgen does not quantize float weights at load"
        )
    if requested is not None and requested != method:
        raise UnsupportedConfigError(f"--quantize {requested} was given for a checkpoint quantized with {method}")
    if method == "compressed-tensors":
        return read_ct_config(raw)
    return _read_gptq_awq(raw, method)


def _read_gptq_awq(raw: dict[str, Any], method: str) -> QuantConfig:
    bits, group = int(raw.get("bits", raw.get("w_bit", 0))), int(raw.get("group_size", raw.get("q_group_size", 0)))
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4 or not raw.get("zero_point", True):
            raise UnsupportedConfigError(
                f"AWQ checkpoint (version {version}, {bits} bits, zero_point {raw.get('zero_point')}) is not "
                "supported: textgen serves AWQ's 4-bit GEMM layout with zero points"
            )
    else:
        fmt = str(raw.get("checkpoint_format", "gptq"))
        if fmt != "gptq" or bits not in (4, 8):
            raise UnsupportedConfigError(
                f"GPTQ checkpoint ({bits} bits, checkpoint_format {fmt}) is not supported: textgen serves 4- and "
                "8-bit GPTQ in the gptq (v1) format"
            )
    if group == 0 or group < -1:
        raise UnsupportedConfigError(
            f"{method} checkpoint with group_size {group} is not supported: expected a group size, or -1 (one "
            "group per output feature)"
        )
    return QuantConfig(
        method=method,
        bits=bits,
        group_size=group,
        desc_act=bool(raw.get("desc_act", False)),
        sym=bool(raw.get("sym", True)),
        modules_to_not_convert=tuple(raw.get("modules_to_not_convert") or ()),
    )


# The tensor whose presence says a checkpoint stores a module quantized, per format.
QUANTIZED_MARKER = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_scale"}


def stored_quantized(weights: Any, prefix: str, qc: QuantConfig) -> bool:
    """Whether the checkpoint stores the module at `prefix` quantized, for the LM head: a checkpoint quantizes it
    only by choice (GPTQModel's `lm_head`, a compressed-tensors `ignore` that does not name it), while `quantizes`
    answers for the decoder projections, which are quantized unless excluded. eetq quantizes at load and, as TGI,
    only the decoder projections."""
    marker = QUANTIZED_MARKER.get(qc.method)
    return marker is not None and qc.quantizes(prefix) and f"{prefix}.{marker}" in weights


def load_quantized(weights: Any, prefix: str, qc: QuantConfig) -> QuantizedWeight:
    """The projection at `prefix` (`weights`: utils.weights.Weights) as integers: unpacked from a GPTQ or AWQ
    checkpoint, or quantized from the float weight (eetq)."""
    if qc.method == "eetq":
        return QuantizedWeight.per_channel_int8(weights.get_tensor(f"{prefix}.weight"))
    if qc.method == "compressed-tensors":
        return load_ct(weights, prefix, qc)
    scales = weights.get_tensor(f"{prefix}.scales").t().contiguous()  # [N, groups]
    if qc.method == "gptq":
        q = unpack(weights.get_tensor(f"{prefix}.qweight"), qc.bits, dim=0).t().contiguous()  # [N, K]
        zeros = unpack(weights.get_tensor(f"{prefix}.qzeros"), qc.bits, dim=1).t().to(scales.dtype) + 1
        g_idx = weights.get_tensor(f"{prefix}.g_idx").long() if f"{prefix}.g_idx" in weights else None
    else:
        q = unpack(weights.get_tensor(f"{prefix}.qweight"), 4, dim=1, order=AWQ_ORDER).t().contiguous()
        zeros = unpack(weights.get_tensor(f"{prefix}.qzeros"), 4, dim=1, order=AWQ_ORDER).t().to(scales.dtype)
        g_idx = None
    n, k = q.shape
    if g_idx is None:
        g_idx = torch.arange(k) // (k if qc.group_size == -1 else qc.group_size)
    if scales.shape[0] != n or zeros.shape != scales.shape or g_idx.shape[0] != k:
        raise ValueError(
            f"{prefix}: inconsistent {qc.method} tensors (q {tuple(q.shape)}, scales {tuple(scales.shape)}, "
            f"zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)})"
        )
    return QuantizedWeight(q, zeros, scales, g_idx, qc.bits, k if qc.group_size == -1 else qc.group_size)
