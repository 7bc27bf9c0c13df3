"""Test oracle: turns a GPTQ-v1 or AWQ-GEMM checkpoint back into a float32 one that transformers loads.

Written apart from `textgen_server.quant_builder` on purpose (none of the server's packing or unpacking is used;
only the builders' publish-by-rename, `builder.publish`): a layout misunderstanding in the packer would otherwise be
mirrored here and cancel out. The unpacking reads each field with
a vectorised shift table and a mask, where the packer ORs field by field, and AWQ's column order is taken from
the slot each column lives in (the inverse of the packer's table).

``int8_per_channel_model_dir(src, out)`` is the oracle of `--quantize eetq` (quantized at load from a float
checkpoint): the float weights rounded to symmetric per-channel int8 and back, in float64.

``dequantize_model_dir(src, out) -> Path`` writes ``out`` through a temporary directory plus rename and returns at
once when ``out`` already holds the dequantization of the same ``src`` (``dequant-stamp.json``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from textgen_server.builder import is_built, publish

# Bumped whenever what this oracle writes changes.
ORACLE_VERSION = 1

STAMP = "dequant-stamp.json"

# AutoAWQ GEMM: output column c (0..7) of a run of 8 is stored in nibble slot AWQ_SLOT_OF_COLUMN[c]. Even columns
# fill slots 0..3, odd ones slots 4..7.
AWQ_SLOT_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)

# Everything but the weights and the config is copied as is.
SKIPPED_FILES = {"config.json", "quantize_config.json", "quant-stamp.json", STAMP}


def unpack_fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Split each int32 of `words` [R, C] into its 32/bits fields: [R, C, 32/bits], field f from bit bits*f up."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    # Arithmetic shift of a negative int32 drags sign bits in from the top; the mask drops them.
    return torch.bitwise_right_shift(words.to(torch.int32).unsqueeze(-1), shifts) & (2**bits - 1)


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """Float32 weight [N, K] of one GPTQ v1 layer: w[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) * s[g_idx[k], n]."""
    rows, n = qweight.shape
    fields = unpack_fields(qweight, bits)  # [K / P, N, P]: field f of row r is input k = r * P + f
    q = fields.permute(0, 2, 1).reshape(-1, n)  # [K, N]
    zeros = unpack_fields(qzeros, bits).reshape(qzeros.shape[0], -1) + 1  # [groups, N], v1 stores zero - 1
    g = g_idx.long()
    w = (q - zeros[g]).float() * scales.float()[g]
    return w.t().contiguous()


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 weight [N, K] of one AWQ GEMM layer: w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]."""
    slots = torch.tensor(AWQ_SLOT_OF_COLUMN)

    def columns(words: torch.Tensor) -> torch.Tensor:
        fields = unpack_fields(words, 4)  # [R, N/8, 8 slots]
        return fields[:, :, slots].reshape(words.shape[0], -1)  # [R, N]: pick each column from its slot

    q = columns(qweight)  # [K, N]
    zeros = columns(qzeros)  # [groups, N]
    k = q.shape[0]
    g = torch.arange(k) // group_size
    w = (q - zeros[g]).float() * scales.float()[g]
    return w.t().contiguous()


def dequantize_tensors(tensors: dict[str, torch.Tensor], qconfig: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Float32 state dict from a quantized one: every `<p>.qweight` group becomes `<p>.weight`, the rest is cast."""
    method = qconfig["quant_method"]
    bits = int(qconfig["bits"])
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            continue  # read with their qweight
        if not name.endswith(".qweight"):
            out[name] = tensor.to(torch.float32)
            continue
        p = name.removesuffix(".qweight")
        if method == "gptq":
            out[f"{p}.weight"] = unpack_gptq(
                tensor, tensors[f"{p}.qzeros"], tensors[f"{p}.scales"], tensors[f"{p}.g_idx"], bits
            )
        elif method == "awq":
            if bits != 4 or str(qconfig.get("version", "gemm")).lower() != "gemm":
                raise ValueError(f"only 4-bit AWQ GEMM checkpoints are read, not {qconfig}")
            k = tensor.shape[0]
            group = k if int(qconfig["group_size"]) == -1 else int(qconfig["group_size"])
            out[f"{p}.weight"] = unpack_awq(tensor, tensors[f"{p}.qzeros"], tensors[f"{p}.scales"], group)
        else:
            raise ValueError(f"unknown quant_method {method!r}")
    return out


def dequantize_model_dir(src: str | Path, out: str | Path) -> Path:
    """Write the float32 checkpoint of the quantized model `src` to `out` (cached by stamp); returns `out`."""
    src, out = Path(src), Path(out)
    source_stamp = src / "quant-stamp.json"
    stamp = {
        "oracle_version": ORACLE_VERSION,
        "source": str(src.resolve()),
        "source_stamp": json.loads(source_stamp.read_text()) if source_stamp.is_file() else None,
    }
    if is_built(out, stamp, STAMP):
        return out
    config = json.loads((src / "config.json").read_text())
    qconfig = config.pop("quantization_config", None)
    if qconfig is None:
        raise ValueError(f"{src} has no quantization_config in config.json")
    tensors: dict[str, torch.Tensor] = {}
    index = src / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    for file_name in files:
        tensors.update(load_file(str(src / file_name)))
    weights = dequantize_tensors(tensors, qconfig)
    return _publish_float32(src, out, config, weights, stamp)


# eetq quantizes these projections of a float checkpoint (TGI keeps the LM head and the embeddings float).
PROJECTION = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def int8_per_channel_model_dir(src: str | Path, out: str | Path) -> Path:
    """The float checkpoint `src` as `--quantize eetq` means it, in float32: every decoder projection's weight w
    replaced by round(w / s) * s with s = max |w| / 127 per output feature (symmetric int8, one scale a row)."""
    src, out = Path(src), Path(out)
    stamp = {"oracle_version": ORACLE_VERSION, "source": str(src.resolve()), "scheme": "int8-per-channel"}
    if is_built(out, stamp, STAMP):
        return out
    config = json.loads((src / "config.json").read_text())
    weights = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        w = tensor.double()  # the oracle's own arithmetic: float64, rounded once at the end
        if PROJECTION.search(name):
            step = w.abs().amax(dim=1, keepdim=True) / 127
            w = torch.round(w / step) * step
        weights[name] = w.float()
    return _publish_float32(src, out, config, weights, stamp)


def _publish_float32(
    src: Path, out: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], stamp: dict[str, Any]
) -> Path:
    """Write `weights` and `config` (as float32) with `src`'s other files to `out`, through a temporary directory."""
    tmp = out.with_name(f"{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and path.name not in SKIPPED_FILES and not path.name.startswith("model"):
            shutil.copy2(path, tmp / path.name)
    config.pop("torch_dtype", None)
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
    return publish(tmp, out, stamp, STAMP)
