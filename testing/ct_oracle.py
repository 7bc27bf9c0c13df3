"""Test oracle for compressed-tensors checkpoints: code that is not textgen's reads them.

``ct_oracle_logits(model_dir, input_ids)``: transformers loads the checkpoint through its compressed-tensors
integration and runs it on the CPU, in float32.

- Weight-only schemes (no activation quantization in the config): ``CompressedTensorsConfig(dequantize=True)``
  (what ``run_compressed=False`` means in transformers 5): each module's tensors are decompressed by the package's
  compressor while loading, and the model runs dense. This is the route that loads every weight-only format: with
  compressed-tensors 0.20.0 and transformers 5.24 the default route refuses asymmetric ``pack-quantized`` (it
  compresses the empty model on the meta device, where the packer leaves ``weight_zero_point`` [N, groups] unpacked,
  and the checkpoint's packed [N/8, groups] then mismatches). For the symmetric ones both routes give equal logits.
- Schemes with activation quantization (W8A8): the default route (``dequantize=False``). transformers attaches the
  package's quantized forward to every targeted Linear and the weights are decompressed on the first forward pass;
  each Linear's input is then quantized and dequantized as the config says (int8, symmetric, one scale per token,
  computed at run time by the package), which runs on the CPU. ``dequantize=True`` would drop that step.

``ct_dequantized_weights(model_dir)``: every tensor of the checkpoint with each quantized module's compressed
tensors replaced by its float32 ``weight``, decompressed by the package's own compressor for the config's format
(the model-free path; the package's ``CompressedTensorsDequantizer`` cannot be used on ``int-quantized`` checkpoints
targeting ``Linear``: it takes every ``*.weight`` for a quantized one, norms and embeddings included).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def ct_oracle_model(model_dir: Path) -> Any:
    """transformers' float32 model of the compressed-tensors checkpoint `model_dir`, on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    groups = _quantization_config(model_dir)["config_groups"].values()
    quantizes_activations = any(g.get("input_activations") or g.get("output_activations") for g in groups)
    with warnings.catch_warnings():
        # "You passed `quantization_config` ... loading attributes will be overwritten": that is the point.
        warnings.simplefilter("ignore", UserWarning)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(dequantize=not quantizes_activations),
        )
    return model.eval()


def ct_oracle_logits(model_dir: Path, input_ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(input_ids), vocab] of transformers on the compressed-tensors checkpoint `model_dir`."""
    with torch.no_grad():
        logits = ct_oracle_model(model_dir)(torch.tensor([input_ids])).logits[0]
    return logits.float()


def ct_dequantized_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model_dir`, each quantized module's compressed ones replaced by `<module>.weight` float32,
    decompressed by compressed_tensors' compressor of the config's format."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(_quantization_config(model_dir))
    if len(config.config_groups) != 1:
        raise ValueError("only checkpoints with one config group are read here")
    scheme = next(iter(config.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(scheme.format or config.format)
    names = compressor.compression_param_names(scheme)  # the first one is in every quantized module
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    # A quantized module is one with a weight_scale (the ignored and untargeted ones have none).
    modules = sorted(name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale"))
    for module in modules:
        local = {name: tensors.pop(f"{module}.{name}") for name in names}
        tensors[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].to(torch.float32)
    return tensors


def _quantization_config(model_dir: Path) -> dict:
    return dict(json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"])
