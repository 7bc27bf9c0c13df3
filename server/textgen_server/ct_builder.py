"""Builds compressed-tensors checkpoints (llmcompressor's format, as vLLM users publish them) offline from a float
model.

The `compressed-tensors` package does the work, so the layout on disk is the package's own: the scheme is attached
with ``apply_quantization_config``, each weight group's min/max becomes a scale (and zero point) through
``calculate_qparams``, ``ModelCompressor`` compresses the modules and writes ``quantization_config`` into config.json.
Only the calibration is ours, and it is plain round-to-nearest (no data): a memoryless min/max of every group, which
is what llmcompressor's default observer computes for weights. Every decoder ``Linear`` is quantized (targets
``["Linear"]``), ``lm_head`` is ignored; embeddings, norms and ``lm_head`` stay float32 as in the source.

Contract: ``build_compressed_tensors_model(src, out, scheme) -> Path`` writes ``out`` (config.json with
``quantization_config``, model.safetensors, the tokenizer and generation config of ``src``) through a temporary
directory plus rename, and returns at once when ``out`` already holds the same build (``quant-stamp.json``, which
names the compressed-tensors version too). The model is loaded in float32, so scales are float32.

Schemes (``SCHEMES``) and the tensors written for each decoder projection ``p`` with float weight [N (out), K (in)]
(the tiny llama: q/o_proj [64, 64], k/v_proj [32, 64], gate/up_proj [128, 64], down_proj [64, 128]):

- ``w4a16``: 4-bit int, symmetric, strategy group, group_size 32, format ``pack-quantized``.
  ``p.weight_packed`` int32 [N, K/8]; ``p.weight_scale`` float32 [N, K/32]; ``p.weight_shape`` int64 [2] = (N, K).
- ``w4a16-asym``: the same with symmetric false, plus ``p.weight_zero_point`` int32 [N/8, K/32] (packed along N).
- ``w8a16``: 8-bit int, symmetric, strategy channel, format ``pack-quantized``. ``p.weight_packed`` int32 [N, K/4];
  ``p.weight_scale`` float32 [N, 1]; ``p.weight_shape`` int64 [2] = (N, K).
- ``w8a8``: weights 8-bit int, symmetric, strategy channel; input activations 8-bit int, symmetric, strategy token,
  dynamic; format ``int-quantized``. ``p.weight`` int8 [N, K]; ``p.weight_scale`` float32 [N, 1]. Nothing is stored
  for the activations (their scales are computed per token at run time).

Symmetric schemes store no zero point. Quantized values are signed, q in [-2^(b-1), 2^(b-1) - 1], and
w ~= (q - z) * s with z the (signed int8) zero point, 0 when symmetric, and s, z of row n and group k // group_size
(channel: one per row). Packing (``pack-quantized``, compressed_tensors.compressors.pack_quantized.helpers): each value
is stored as the unsigned q + 2^(b-1), 32/b values per int32, consecutive along K, the first at the lowest bits:
element k of row n sits at bits b * (k % (32/b)) of word k // (32/b). Packed zero points are the same, but along N:
``weight_zero_point[n // 8, g]`` holds z + 8 of row n at bits 4 * (n % 8).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from textgen_server.builder import is_built, publish
from textgen_server.quant_builder import COPIED_FILES, STAMP, _read_source_stamp

# Bumped whenever the bytes written for the same arguments change, so cached builds are not reused.
CT_BUILDER_VERSION = 1

SCHEMES = ("w4a16", "w4a16-asym", "w8a16", "w8a8")
GROUP_SIZE = 32


def build_compressed_tensors_model(src: str | Path, out: str | Path, scheme: str, lm_head: bool = False) -> Path:
    """Quantize every decoder Linear of the float Llama-family model `src` into `out` with `scheme`; returns `out`.

    `scheme` is one of SCHEMES (see the module docstring for what each writes); `lm_head`: the LM head is quantized
    too (left out of `ignore`). Raises ValueError on an unknown scheme, or when a weight's input size is not a
    multiple of the group size.
    """
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from transformers import AutoModelForCausalLM

    if scheme not in SCHEMES:
        raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    src, out = Path(src), Path(out)
    stamp: dict[str, Any] = {
        "ct_builder_version": CT_BUILDER_VERSION,
        "compressed_tensors": compressed_tensors.__version__,
        "source": src.name,
        "source_stamp": _read_source_stamp(src),
        "scheme": scheme,
        "lm_head": lm_head,
    }
    if is_built(out, stamp, STAMP):
        return out

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": quantization_scheme(scheme)}, ignore=[] if lm_head else ["lm_head"]
    )
    # Attaches the scheme to every targeted module and registers its (empty) weight_scale / weight_zero_point.
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        attached = getattr(module, "quantization_scheme", None)
        if isinstance(module, torch.nn.Linear) and attached is not None:
            _calibrate_weight(module, attached.weights)
            module.quantization_status = QuantizationStatus.FROZEN

    # llmcompressor's save path: the config is rebuilt from the schemes on the modules, the modules are compressed
    # in place, the model saved, and quantization_config written into its config.json.
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    tmp = out.with_name(f"{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    compressor.update_config(str(tmp))
    for file_name in COPIED_FILES:
        if (src / file_name).is_file():
            shutil.copy2(src / file_name, tmp / file_name)
    return publish(tmp, out, stamp, STAMP)


def quantization_scheme(scheme: str) -> Any:
    """The compressed_tensors QuantizationScheme of `scheme` (targets ["Linear"], its format set explicitly).

    The package's presets W4A16 / W4A16_ASYM / W8A16 / W8A8 with group size 32 instead of 128, and W8A16 per channel.
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def int_weights(bits: int, symmetric: bool, strategy: str) -> Any:
        group_size = GROUP_SIZE if strategy == "group" else None
        return QuantizationArgs(
            num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size, dynamic=False
        )

    if scheme == "w4a16":
        return QuantizationScheme(targets=["Linear"], weights=int_weights(4, True, "group"), format="pack-quantized")
    if scheme == "w4a16-asym":
        return QuantizationScheme(targets=["Linear"], weights=int_weights(4, False, "group"), format="pack-quantized")
    if scheme == "w8a16":
        return QuantizationScheme(targets=["Linear"], weights=int_weights(8, True, "channel"), format="pack-quantized")
    if scheme == "w8a8":
        tokens = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        return QuantizationScheme(
            targets=["Linear"],
            weights=int_weights(8, True, "channel"),
            input_activations=tokens,
            format="int-quantized",
        )
    raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")


def _calibrate_weight(module: torch.nn.Linear, args: Any) -> None:
    """Round-to-nearest qparams of `module`'s weight for its weight QuantizationArgs `args`: its groups' (or rows')
    min and max through the package's calculate_qparams, stored in the weight_scale / weight_zero_point that
    apply_quantization_config registered."""
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization.utils import calculate_qparams

    weight = module.weight.detach()
    if args.strategy == "group":
        n, k = weight.shape
        if k % args.group_size:
            raise ValueError(f"input size {k} of a [{n}, {k}] weight is not a multiple of {args.group_size}")
        groups = weight.unflatten(-1, (k // args.group_size, args.group_size))
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K / group_size]
    elif args.strategy == "channel":
        low, high = weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)  # [N, 1]
    else:
        raise ValueError(f"weight strategy {args.strategy!r} is not built here")
    scale, zero_point = calculate_qparams(low, high, args)
    update_offload_parameter(module, "weight_scale", scale)
    if hasattr(module, "weight_zero_point"):  # registered for every scheme; the compressor drops symmetric ones
        update_offload_parameter(module, "weight_zero_point", zero_point)
