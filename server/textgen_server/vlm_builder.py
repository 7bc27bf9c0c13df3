"""Builds tiny vision-language models offline: seeded random weights, the project's trained tokenizer with the
family's image tokens, the family's own image processor and processor, and a chat template.

A built directory is what the hub holds for such a model (``config.json``, ``model.safetensors``, the tokenizer
files, ``processor_config.json``), so that ``AutoProcessor`` and ``AutoModelForImageTextToText`` load it as is:
transformers' ``generate`` with the model's own processor is the oracle of a VLM's tokens (issue 38), and these
are the models it runs on. Families, at one size each (tiny: seconds to build, for tests):

- ``llava_next``: a CLIP tower over 32-pixel tiles of 8-pixel patches, anyres grids of 32/64 pixels, the image
  newline; text a tiny Llama.
- ``idefics3`` (SmolVLM): its own tower over 32-pixel tiles, images split into tiles plus a global one, a pixel
  shuffle by 2 (4 tokens a tile); text a tiny Llama.

Not built: ``qwen2_vl``, whose processor requires a video processor, which transformers provides only with
torchvision (not a dependency of textgen).

Contract: ``build_test_vlm(out_dir, arch, seed) -> Path`` is deterministic for a given ``VLM_BUILDER_VERSION``,
Python minor version (the tokenizer's corpus) and torch version, and returns at once when ``out_dir`` holds the
same build (the stamp of ``builder.publish``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
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
VLM_ARCHS = ("llava_next", "idefics3")

# Each family's tokens beyond the text model's, as its hub checkpoints name them.
IMAGE_TOKENS = {
    "llava_next": ["<image>"],
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"],
}
TILE, PATCH = 32, 8  # pixels: the towers' input side and patch side (16 patches a tile)
GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # llava_next's anyres resolutions (tiles of TILE)
SHUFFLE = 2  # idefics3's pixel shuffle: (TILE / PATCH)^2 / SHUFFLE^2 = 4 tokens a tile


def tokenizer_for(arch: str) -> PreTrainedTokenizerFast:
    """The tiny model's trained tokenizer with the family's image tokens added as special tokens."""
    raw = train_tokenizer(SIZE_DIMS["tiny"].vocab, SIZE_DIMS["tiny"].corpus, add_bos=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END, *IMAGE_TOKENS[arch]],
        chat_template=CHAT_TEMPLATE,
        model_max_length=SIZE_DIMS["tiny"].max_positions,
    )


def text_config(tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The tiny Llama of builder.py, its vocabulary grown to hold the image tokens (even: 2 shards split it)."""
    dims = dataclasses.replace(SIZE_DIMS["tiny"], vocab=len(tokenizer) + len(tokenizer) % 2)
    return model_config("llama", dims, special_token_ids(tokenizer.backend_tokenizer))


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(found, int)
    return found


# The towers' shape: small, but deep enough that every part of them changes the tokens.
VISION: dict[str, Any] = dict(
    image_size=TILE,
    patch_size=PATCH,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    initializer_range=INIT_STD,
)


def llava_next(tokenizer: PreTrainedTokenizerFast) -> tuple[PreTrainedModel, ProcessorMixin]:
    config = LlavaNextConfig(
        text_config=text_config(tokenizer),
        vision_config=CLIPVisionConfig(projection_dim=32, **VISION),
        image_token_index=token_id(tokenizer, "<image>"),
        image_grid_pinpoints=GRID_PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=(TILE // PATCH) ** 2,
    )
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}, image_grid_pinpoints=GRID_PINPOINTS
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
        chat_template=CHAT_TEMPLATE,
    )
    return LlavaNextForConditionalGeneration(config), processor


def idefics3(tokenizer: PreTrainedTokenizerFast) -> tuple[PreTrainedModel, ProcessorMixin]:
    config = Idefics3Config(
        text_config=text_config(tokenizer),
        vision_config=Idefics3VisionConfig(**VISION),
        scale_factor=SHUFFLE,
        image_token_id=token_id(tokenizer, "<image>"),
    )
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(TILE // PATCH) ** 2 // SHUFFLE**2,
        chat_template=CHAT_TEMPLATE,
    )
    return Idefics3ForConditionalGeneration(config), processor


FAMILIES = {"llava_next": llava_next, "idefics3": idefics3}


def build_test_vlm(out_dir: str | Path, arch: str, seed: int = 0) -> Path:
    """Build (or reuse) the tiny `arch` VLM in `out_dir`; returns the directory. ValueError for an unknown arch."""
    if arch not in VLM_ARCHS:
        raise ValueError(f"unknown vision-language arch {arch!r}; expected one of {', '.join(VLM_ARCHS)}")
    out = Path(out_dir)
    stamp = {"vlm_builder_version": VLM_BUILDER_VERSION, "arch": arch, "seed": seed}
    if is_built(out, stamp):
        return out
    # Built beside the target and renamed at the end, as builder.build_test_model does.
    tmp = out.with_name(f"{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = tokenizer_for(arch)
    torch.manual_seed(seed)
    model, processor = FAMILIES[arch](tokenizer)
    model.eval().save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    return publish(tmp, out, stamp)
