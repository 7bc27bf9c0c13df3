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
- ``qwen2_vl`` / ``qwen2_5_vl``: their own towers over images at their own resolution (``qwen_patch`` patches,
  2x2 merged, up to the area of two tiles a side), M-RoPE positions; text a Qwen2 (q/k/v biases).

Sizes (``VLM_SIZES``): ``tiny`` (32-pixel tiles of 8-pixel patches, a 2-layer tower, builder.py's tiny Llama:
seconds to build, for tests) and ``small`` (224-pixel tiles of 16-pixel patches, a 12-layer 768-wide tower of
~86M parameters, builder.py's small Llama: ~200M in all, about SmolVLM-256M's size, for benchmark/vlm_load.py).

Qwen2-VL's processors take videos too, and transformers builds their video processor only with torchvision (not a
dependency of textgen): those are saved as a tokenizer and an image processor, and loaded with
textgen_common.image_prompts.load_processor.

Contract: ``build_test_vlm(out_dir, arch, seed, size) -> Path`` is deterministic for a given
``VLM_BUILDER_VERSION``, Python minor version (the tokenizer's corpus) and torch version, and returns at once when
``out_dir`` holds the same build (the stamp of ``builder.publish``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Callable
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
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLVisionConfig,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLTextConfig,
    Qwen2VLVisionConfig,
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

VLM_BUILDER_VERSION = 1  # bumped when a family's bytes change (adding a family leaves the others' builds valid)

# Each family's tokens beyond the text model's, as its hub checkpoints name them.
IMAGE_TOKENS = {
    "llava_next": ["<image>"],
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"],
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
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
    qwen_patch: int  # Qwen2-VL's patch side (its images are not tiled): dozens of tokens for the tiny one's images


VLM_SIZES = {
    "tiny": VlmSize("tiny", tile=32, patch=8, hidden=32, layers=2, heads=4, intermediate=64, qwen_patch=4),
    "small": VlmSize("small", tile=224, patch=16, hidden=768, layers=12, heads=12, intermediate=3072, qwen_patch=14),
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


def text_config(tokenizer: PreTrainedTokenizerFast, text: str, arch: str = "llama") -> PretrainedConfig:
    """builder.py's `arch` of size `text`, its vocabulary grown to hold the image tokens (even: 2 shards split it)."""
    dims = dataclasses.replace(SIZE_DIMS[text], vocab=len(tokenizer) + len(tokenizer) % 2)
    return model_config(arch, dims, special_token_ids(tokenizer.backend_tokenizer))


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


MERGE = 2  # Qwen2-VL's spatial merge: 2x2 patches a token


def qwen_text(tokenizer: PreTrainedTokenizerFast, text: str, config_class: type[Any]) -> PretrainedConfig:
    """builder.py's Qwen2 of size `text` as a Qwen2-VL text config: M-RoPE sections of a quarter, three eighths and
    three eighths of the rotary frequencies (Qwen2-VL's 16, 24, 24 of 64)."""
    qwen2 = text_config(tokenizer, text, "qwen2").to_dict()
    half = qwen2["hidden_size"] // qwen2["num_attention_heads"] // 2
    section = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]
    keys = (
        *("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"),
        *("max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"),
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    return config_class(
        **{k: qwen2[k] for k in keys}, rope_parameters=rope, initializer_range=INIT_STD, tie_word_embeddings=False
    )


def qwen_image_processor(size: VlmSize) -> Qwen2VLImageProcessorPil:
    """Images resized to whole 2x2 merges of patches, between one merge's area and that of two tiles a side."""
    unit = size.qwen_patch * MERGE
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": unit * unit, "longest_edge": (2 * size.tile) ** 2},
        patch_size=size.qwen_patch,
        merge_size=MERGE,
    )


def qwen_vision(arch: str, size: VlmSize) -> PretrainedConfig:
    """The tower's config: Qwen2-VL's (full attention), or Qwen2.5-VL's (windows of 2x2 merges, the last layer full
    attention, so both kinds run)."""
    common: dict[str, Any] = dict(
        depth=size.layers,
        num_heads=size.heads,
        patch_size=size.qwen_patch,
        spatial_merge_size=MERGE,
        initializer_range=INIT_STD,
    )
    text_hidden = SIZE_DIMS[size.text].hidden
    if arch == "qwen2_vl":
        mlp_ratio = size.intermediate // size.hidden
        return Qwen2VLVisionConfig(embed_dim=size.hidden, hidden_size=text_hidden, mlp_ratio=mlp_ratio, **common)
    window = 2 * size.qwen_patch * MERGE
    return Qwen2_5_VLVisionConfig(
        hidden_size=size.hidden,
        out_hidden_size=text_hidden,
        intermediate_size=size.intermediate,
        window_size=window,
        fullatt_block_indexes=[size.layers - 1],
        **common,
    )


# Each Qwen family's (config, text config, model) classes.
QWEN_CLASSES: dict[str, tuple[type[Any], type[Any], type[PreTrainedModel]]] = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLTextConfig, Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLTextConfig, Qwen2_5_VLForConditionalGeneration),
}


def qwen_vl(arch: str, tokenizer: PreTrainedTokenizerFast, size: VlmSize) -> tuple[PreTrainedModel, Any]:
    config_class, text_class, model_class = QWEN_CLASSES[arch]
    config = config_class(
        text_config=qwen_text(tokenizer, size.text, text_class),
        vision_config=qwen_vision(arch, size),
        **qwen_token_ids(tokenizer),
    )
    return model_class(config), qwen_image_processor(size)


def qwen_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    names = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>"}
    names |= {"image": "<|image_pad|>", "video": "<|video_pad|>"}
    return {f"{name}_token_id": token_id(tokenizer, token) for name, token in names.items()}


FAMILIES: dict[str, Callable[[PreTrainedTokenizerFast, VlmSize], tuple[PreTrainedModel, Any]]] = {
    "llava_next": llava_next,
    "idefics3": idefics3,
    **{arch: functools.partial(qwen_vl, arch) for arch in QWEN_CLASSES},
}


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
    if arch in QWEN_CLASSES:  # an image processor and a tokenizer, as the hub has them (module docstring)
        tokenizer.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    return publish(tmp, out, stamp)
