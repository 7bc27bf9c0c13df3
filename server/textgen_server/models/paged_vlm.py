"""Vision-language models on the paged engine: llava_next, idefics3, qwen2_vl and qwen2_5_vl with prefix caching
and chunked prefill.

The text model is tp_llama's (the VLM checkpoint's language model, read under its own names; split across
shards as any Llama; a language model of another family runs on the padded engine, loader.vlm_is_paged), and
the vision tower and projector are the transformers module's, whole on every rank (its language model dropped
at load). Prompts and image features are models/vlm_inputs.py's.

A step embeds its tokens and puts image features at the image tokens it computes. Features are a function of
the pixels alone, so a prefill may be chunked anywhere, an image's tokens across chunks too, and a prefix-cache
hit may end inside an image: every position gets the embedding the whole prompt would give it. A row's features
are computed at the first step that reaches one of its image tokens and dropped once its last is computed.
With M-RoPE (Qwen2-VL) a row's tokens take the positions transformers gives them (models/vlm_inputs.py): while a row
has images to compute, its prompt's own table; after, its index plus the row's `rope_delta` (PagedBatch keeps it).
Whether two prompts may share cached blocks is the router's call: it keys an image's tokens by the image's bytes
(textgen_router.images), so placeholder ids alone never match.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from textgen_pb import generate_pb2
from textgen_server.models.paged_batch import PagedBatch
from textgen_server.models.paged_lm import PagedCausalLM
from textgen_server.models.vlm_inputs import RowImages, VlmPrompts

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    from textgen_server.config import PagingConfig, ShardConfig
    from textgen_server.models.tp_llama import TPCausalLM


class PagedVlm(PagedCausalLM):
    """PagedCausalLM whose steps embed images: `module` the text model, `vision` the transformers VLM."""

    def __init__(
        self,
        module: TPCausalLM,
        config: ShardConfig,
        tokenizer: PreTrainedTokenizerBase,
        paging: PagingConfig,
        vision: torch.nn.Module,
        processor: ProcessorMixin,
    ) -> None:
        super().__init__(module, config, tokenizer, paging)
        self.vision = vision
        self.prompts = VlmPrompts(tokenizer, processor)
        self.mrope = module.rotary.mrope_axes is not None  # the text model turns positions of three axes

    def prepare(self, request: generate_pb2.Request) -> tuple[list[int], LLMatcher | None, int, RowImages | None]:
        ids, matcher, adapter, inputs = self.prompts.prepare(request, self)
        if inputs is None:
            return ids, matcher, adapter, None
        positions = [p for p, token in enumerate(ids) if token == self.prompts.image_token_id]
        images = RowImages(inputs, positions)
        if self.mrope:
            images.rope, images.rope_delta = self.prompts.rope(self.vision, ids, inputs)
        return ids, matcher, adapter, images

    def _positions(self, batch: PagedBatch, positions: torch.Tensor) -> torch.Tensor:
        """M-RoPE: [T] positions moved by each row's `rope_delta`, or [3, T] where a row still has images (its
        chunk's positions from its prompt's table); else the tokens' indices."""
        if not self.mrope:
            return positions
        tables = [(i, im.rope) for i, im in enumerate(batch.images) if im is not None and im.rope is not None]
        if not tables and not any(batch.rope_deltas):
            return positions  # no row has had an image: every position is its index (three equal axes)
        device = positions.device
        chunks = torch.tensor(batch.chunk_lengths, device=device)
        shifted = positions + torch.repeat_interleave(torch.tensor(batch.rope_deltas, device=device), chunks)
        if not tables:
            return shifted
        out = shifted.expand(3, -1).clone()
        starts = [0, *itertools.accumulate(batch.chunk_lengths)]
        for i, rope in tables:
            cached, chunk = batch.cache_lengths[i], batch.chunk_lengths[i]
            out[:, starts[i] : starts[i] + chunk] = rope[:, cached : cached + chunk].to(device)
        return out

    def _image_embeds(self, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image features this step's image tokens take; a row whose last image token this step computes lets
        its images go."""
        where: list[int] = []
        what: list[torch.Tensor] = []
        start = 0  # the row's first token in the step (rows feed their chunks one after another)
        for i, (images, cached, chunk) in enumerate(
            zip(batch.images, batch.cache_lengths, batch.chunk_lengths, strict=True)
        ):
            if images is not None:
                first = bisect.bisect_left(images.positions, cached)
                end = bisect.bisect_left(images.positions, cached + chunk)
                if end > first:
                    if images.features is None:
                        images.features = self.prompts.features(
                            self.vision, images.inputs, len(images.positions), self.config.dtype
                        )
                    where += [start + p - cached for p in images.positions[first:end]]
                    what.append(images.features[first:end])
                if end == len(images.positions):
                    batch.images[i] = None
            start += chunk
        if not where:
            return None
        device = self.config.device
        return torch.tensor(where, dtype=torch.long, device=device), torch.cat(what).to(device)


# Where a VLM checkpoint keeps its language model's `model.*` tensors: llava-hf's layout (its head at
# `language_model.lm_head.weight`), transformers' own since 4.52, idefics3's. Qwen2-VL's hub checkpoints keep them
# under `model.*` itself (their tower under `visual.*`), which tp_llama reads as they are.
TEXT_PREFIXES = ("language_model.model.", "model.language_model.", "model.text_model.")


def text_model_aliases(names: Iterable[str], tied: bool) -> dict[str, list[str]]:
    """The names tp_llama reads (`model.*`, `lm_head.weight`) to the VLM checkpoint's names of those tensors."""
    aliases: dict[str, list[str]] = {}
    for name in names:
        for prefix in TEXT_PREFIXES:
            if name.startswith(prefix):
                aliases.setdefault("model." + name[len(prefix) :], []).append(name)
    head = ["language_model.lm_head.weight"]
    # A tied head is the embedding, under whichever of its names the checkpoint holds (Qwen2-VL-2B's is tied).
    embedding = ["model.embed_tokens.weight", *aliases.get("model.embed_tokens.weight", [])]
    aliases["lm_head.weight"] = head + embedding if tied else head
    return aliases


def drop_language_model(vlm: torch.nn.Module) -> torch.nn.Module:
    """The transformers VLM without its language model and head (tp_llama runs them): its vision tower and
    projector, which `get_image_features` uses."""
    inner = getattr(vlm, "model", vlm)
    for name in ("language_model", "text_model"):
        if isinstance(getattr(inner, name, None), torch.nn.Module):
            inner.register_module(name, None)
    vlm.register_module("lm_head", None)
    return vlm
