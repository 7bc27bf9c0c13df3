"""Tiny real test models (random weights, trained tokenizer), built once and cached on disk.

`build_model(arch, size)` returns the directory of a model made by `textgen_server.builder.build_test_model`,
cached under `~/.cache/textgen-test-models/<arch>-<size>-v<BUILDER_VERSION>-py<X.Y>-torch<V>` (override the
root with TEXTGEN_TEST_MODELS), so a second run costs nothing; `build_vlm(arch)` likewise for the tiny
vision-language models of `textgen_server.vlm_builder`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL_CACHE_ROOT = Path(os.environ.get("TEXTGEN_TEST_MODELS", Path.home() / ".cache" / "textgen-test-models"))


def edited_copy(model_dir: Path, at: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of `model_dir` at `at` whose JSON file `name` (config.json, ...) `edit` changed in place."""
    shutil.copytree(model_dir, at)
    settings = json.loads((at / name).read_text())
    edit(settings)
    (at / name).write_text(json.dumps(settings))
    return at


def build_model(arch: str, size: str = "tiny") -> Path:
    """Build (or reuse from the on-disk cache) a test model, keyed by everything that changes its bytes."""
    import torch

    from textgen_server import builder

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = f"{arch}-{size}-v{builder.BUILDER_VERSION}-py{py}-torch{torch.__version__.split('+')[0]}"
    # The builder reuses a matching build and writes through a temporary directory plus rename.
    return builder.build_test_model(MODEL_CACHE_ROOT / key, arch=arch, size=size)


def build_vlm(arch: str) -> Path:
    """The tiny vision-language model of `textgen_server.vlm_builder` (one of build_choices.VLM_ARCHS), cached like
    the text models, keyed by VLM_BUILDER_VERSION."""
    import torch

    from textgen_server import vlm_builder

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = f"{arch}-tiny-vlm{vlm_builder.VLM_BUILDER_VERSION}-py{py}-torch{torch.__version__.split('+')[0]}"
    return vlm_builder.build_test_vlm(MODEL_CACHE_ROOT / key, arch)


def build_quantized_model(
    method: str, bits: int = 4, desc_act: bool = False, sym: bool = True, lm_head: bool = False
) -> Path:
    """The tiny llama quantized by `textgen_server.quant_builder` (group size 32), cached beside it.

    method "gptq" (bits 4 or 8, optional act order / asymmetric zeros / the LM head quantized too) or "awq"
    (4-bit). Keyed by the float model's cache key plus the quantization arguments and QUANT_BUILDER_VERSION.
    """
    from textgen_server import quant_builder

    base = build_model("llama")
    options = (
        f"{method}-b{bits}-g32" + ("-act" if desc_act else "") + ("" if sym else "-asym") + ("-head" if lm_head else "")
    )
    key = f"{base.name}-{options}-q{quant_builder.QUANT_BUILDER_VERSION}"
    return quant_builder.quantize_model_dir(
        base, MODEL_CACHE_ROOT / key, method, bits=bits, group_size=32, desc_act=desc_act, sym=sym, lm_head=lm_head
    )


def build_dequantized_oracle(qdir: Path) -> Path:
    """The float32 checkpoint `testing.dequantize` makes of the quantized model `qdir`, cached beside the others.

    Keyed by `qdir`'s name plus a hash of its full path, so two quantized models of one name never share a build.
    """
    import hashlib

    from testing import dequantize

    qdir = Path(qdir)
    digest = hashlib.sha256(str(qdir.resolve()).encode()).hexdigest()[:8]
    key = f"{qdir.name}-{digest}-dequant-v{dequantize.ORACLE_VERSION}"
    return dequantize.dequantize_model_dir(qdir, MODEL_CACHE_ROOT / key)


def build_int8_oracle(model_dir: Path) -> Path:
    """The float32 checkpoint `testing.dequantize` makes of `--quantize eetq` on the float model `model_dir`."""
    from testing import dequantize

    key = f"{Path(model_dir).name}-int8-per-channel-v{dequantize.ORACLE_VERSION}"
    return dequantize.int8_per_channel_model_dir(model_dir, MODEL_CACHE_ROOT / key)


def build_ct_model(scheme: str, lm_head: bool = False) -> Path:
    """The tiny llama as a compressed-tensors checkpoint (`textgen_server.ct_builder`), cached beside it.

    scheme: one of ct_builder.SCHEMES ("w4a16", "w4a16-asym", "w8a16", "w8a8"); `lm_head`: the LM head quantized
    too. Keyed by the float model's cache key plus those and CT_BUILDER_VERSION (the build's stamp also names the
    compressed-tensors version).
    """
    from textgen_server import ct_builder

    base = build_model("llama")
    key = f"{base.name}-ct-{scheme}{'-head' if lm_head else ''}-c{ct_builder.CT_BUILDER_VERSION}"
    return ct_builder.build_compressed_tensors_model(base, MODEL_CACHE_ROOT / key, scheme, lm_head)
