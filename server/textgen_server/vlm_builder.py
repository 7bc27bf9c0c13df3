"""Builds small vision-language models offline: seeded random weights, the project's trained tokenizer with the
family's image tokens, the family's own image processor and processor, and a chat template.

A built directory is what the hub holds for such a model (``config.json``, ``model.safetensors``, the tokenizer
files, ``processor_config.json``), so that ``AutoProcessor`` and ``AutoModelForImageTextToText`` load it as is:
transformers' ``generate`` with the model's own processor is the oracle of a VLM's tokens (issue 38), and these
are the models it runs on. Families:

- ``llava_next``: a CLIP tower over square tiles, anyres grids of one or two tiles a side, the image newline;
  text a Llama.
- ``idefics3`` (SmolVLM): its own tower over square tiles, images split into tiles plus a global one, a pixel
  shuffle by 2; text a Llama.

Sizes (``VLM_SIZES``): ``tiny`` (32-pixel tiles of 8-pixel patches, a 2-layer tower, builder.py's tiny Llama:
seconds to build, for tests) and ``small`` (224-pixel tiles of 16-pixel patches, a 12-layer 768-wide tower of
~86M parameters, builder.py's small Llama: ~200M in all, about SmolVLM-256M's size, for benchmark/vlm_load.py).

Not built: ``qwen2_vl``, whose processor requires a video processor, which transformers provides only with
torchvision (not a dependency of textgen; the package registry's torchvision wheels are CUDA builds, which do
not import beside a CPU torch).

Contract: ``build_test_vlm(out_dir, arch, seed, size) -> Path`` is deterministic for a given
``VLM_BUILDER_VERSION``, Python minor version (the tokenizer's corpus) and torch version, and returns at once when
``out_dir`` holds the same build (the stamp of ``builder.publish``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CLIPVisionConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    Idefics3VisionConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
)

from textgen_server.build_choices import VLM_ARCHS, VLM_SIZE_NAMES, check_choice
from textgen_server.builder import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    INIT_STD,
    PAD,
    SIZE_DIMS,
    is_built,
    model_config,
    publish,
    special_token_ids,
    train_tokenizer,
)

VLM_BUILDER_VERSION = 1

# Each family's tokens beyond the text model's, as its hub checkpoints name them.
IMAGE_TOKENS = {
    "llava_next": ["<image>"],
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"],
}


@dataclass(frozen=True)
class VlmSize:
    """One size: the text model's (builder.SIZE_DIMS) and the tower's tile and patch sides and shape."""

    text: str
    tile: int  # pixels: the tower's input side
    patch: int
    hidden: int
    layers: int
    heads: int
    intermediate: int


VLM_SIZES = {
    "tiny": VlmSize("tiny", tile=32, patch=8, hidden=32, layers=2, heads=4, intermediate=64),
    "small": VlmSize("small", tile=224, patch=16, hidden=768, layers=12, heads=12, intermediate=3072),
}
SHUFFLE = 2  # idefics3's pixel shuffle: (tile / patch)^2 / SHUFFLE^2 tokens a tile


def grid_pinpoints(size: VlmSize) -> list[list[int]]:
    """llava_next's anyres resolutions: one or two tiles a side."""
    return [[size.tile, 2 * size.tile], [2 * size.tile, size.tile], [2 * size.tile, 2 * size.tile]]


def tokenizer_for(arch: str, text: str) -> PreTrainedTokenizerFast:
    """The `text` size's trained tokenizer with the family's image tokens added as special tokens."""
    raw = train_tokenizer(SIZE_DIMS[text].vocab, SIZE_DIMS[text].corpus, add_bos=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END, *IMAGE_TOKENS[arch]],
        chat_template=CHAT_TEMPLATE,
        model_max_length=SIZE_DIMS[text].max_positions,
    )


def text_config(tokenizer: PreTrainedTokenizerFast, text: str) -> PretrainedConfig:
    """builder.py's Llama of size `text`, its vocabulary grown to hold the image tokens (even: 2 shards split it)."""
    dims = dataclasses.replace(SIZE_DIMS[text], vocab=len(tokenizer) + len(tokenizer) % 2)
    return model_config("llama", dims, special_token_ids(tokenizer.backend_tokenizer))


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(found, int)
    return found


def vision(size: VlmSize) -> dict[str, Any]:
    """The tower's config fields; the tiny one small, but deep enough that every part of it changes the tokens."""
    return dict(
        image_size=size.tile,
        patch_size=size.patch,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.intermediate,
        initializer_range=INIT_STD,
    )


def llava_next(tokenizer: PreTrainedTokenizerFast, size: VlmSize) -> tuple[PreTrainedModel, ProcessorMixin]:
    config = LlavaNextConfig(
        text_config=text_config(tokenizer, size.text),
        vision_config=CLIPVisionConfig(projection_dim=size.hidden, **vision(size)),
        image_token_index=token_id(tokenizer, "<image>"),
        image_grid_pinpoints=grid_pinpoints(size),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=(size.tile // size.patch) ** 2,
    )
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": size.tile},
        crop_size={"height": size.tile, "width": size.tile},
        image_grid_pinpoints=grid_pinpoints(size),
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=size.patch,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
        chat_template=CHAT_TEMPLATE,
    )
    return LlavaNextForConditionalGeneration(config), processor


def idefics3(tokenizer: PreTrainedTokenizerFast, size: VlmSize) -> tuple[PreTrainedModel, ProcessorMixin]:
    config = Idefics3Config(
        text_config=text_config(tokenizer, size.text),
        vision_config=Idefics3VisionConfig(**vision(size)),
        scale_factor=SHUFFLE,
        image_token_id=token_id(tokenizer, "<image>"),
    )
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 2 * size.tile}, max_image_size={"longest_edge": size.tile}
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(size.tile // size.patch) ** 2 // SHUFFLE**2,
        chat_template=CHAT_TEMPLATE,
    )
    return Idefics3ForConditionalGeneration(config), processor


FAMILIES = {"llava_next": llava_next, "idefics3": idefics3}


def build_test_vlm(out_dir: str | Path, arch: str, seed: int = 0, size: str = "tiny") -> Path:
    """Build (or reuse) the `arch` VLM of `size` in `out_dir`; returns the directory. ValueError for an unknown
    arch or size."""
    check_choice("vision-language arch", arch, VLM_ARCHS)
    check_choice("vision-language size", size, VLM_SIZE_NAMES)
    out = Path(out_dir)
    stamp = {"vlm_builder_version": VLM_BUILDER_VERSION, "arch": arch, "seed": seed, "size": size}
    if is_built(out, stamp):
        return out
    # Built beside the target and renamed at the end, as builder.build_test_model does.
    tmp = out.with_name(f"{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dims = VLM_SIZES[size]
    tokenizer = tokenizer_for(arch, dims.text)
    torch.manual_seed(seed)
    model, processor = FAMILIES[arch](tokenizer, dims)
    model.eval().save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    return publish(tmp, out, stamp)
