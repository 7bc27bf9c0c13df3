"""Vision-language models on the padded engine (TGI's VlmCausalLM), for llava_next and idefics3.

Prompts and image features are models/vlm_inputs.py's. The prefill embeds the padded prompt, puts each row's
image features at its image tokens, and runs the language model on those embeddings; decode steps are CausalLM's,
reading the KV cache only. Images are kept until the batch's prefill and then dropped; the padded engine never
chunks a prefill, so an image is always embedded whole. TGI's warmup request, its text as long as `truncate` and
an image after it, loses the start of its text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from textgen_pb import generate_pb2
from textgen_server.models.causal_lm import CausalLM, CausalLMBatch
from textgen_server.models.model import InvalidRequestError, Model, prepare_rows
from textgen_server.models.vlm_inputs import ImageInputs, VlmPrompts

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    from textgen_server.config import ShardConfig
    from textgen_server.models.kv_cache import KVCache


@dataclass
class VlmCausalLMBatch(CausalLMBatch):
    images: list[ImageInputs | None] | None = None  # each row's image inputs, until the prefill has used them

    @classmethod
    def from_pb(cls, pb: generate_pb2.Batch, model: Model) -> VlmCausalLMBatch:
        if not pb.requests:
            raise InvalidRequestError("Batch must have at least one request")
        assert isinstance(model, VlmCausalLM)
        rows = prepare_rows(pb.requests, model.prepare)
        batch = cls.from_rows(pb, model, [(ids, matcher, adapter) for ids, matcher, adapter, _ in rows])
        by_id = {request.id: row[3] for request, row in zip(pb.requests, rows, strict=True)}
        batch.images = [by_id[request.id] for request in batch.requests]
        return batch

    def filter(self, request_ids: list[int]) -> VlmCausalLMBatch:
        assert self.images is None, "a batch is filtered after its prefill only"
        filtered = super().filter(request_ids)
        assert isinstance(filtered, VlmCausalLMBatch)
        return filtered

    @classmethod
    def concatenate(cls, batches: list[VlmCausalLMBatch]) -> VlmCausalLMBatch:
        assert all(b.images is None for b in batches), "batches are concatenated after their prefills only"
        return super().concatenate(batches)


class VlmCausalLM(CausalLM):
    """CausalLM whose prefill embeds images: `module` is a transformers image-text-to-text model."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: ShardConfig,
        tokenizer: PreTrainedTokenizerBase,
        processor: ProcessorMixin,
    ) -> None:
        super().__init__(module, config, tokenizer)
        self.prompts = VlmPrompts(tokenizer, processor)

    @property
    def batch_type(self) -> type[VlmCausalLMBatch]:
        return VlmCausalLMBatch

    def prepare(self, request: generate_pb2.Request) -> tuple[list[int], LLMatcher | None, int, ImageInputs | None]:
        return self.prompts.prepare(request, self)

    def forward(
        self, batch: CausalLMBatch, all_logits: bool, inputs_embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        assert isinstance(batch, VlmCausalLMBatch)
        images, batch.images = batch.images, None
        if images is None or not any(images):
            return super().forward(batch, all_logits)
        return super().forward(batch, all_logits, inputs_embeds=self.embed(batch.input_ids, images))

    def embed(self, input_ids: torch.Tensor, images: list[ImageInputs | None]) -> torch.Tensor:
        """The prompt's embeddings [B, L, H], each row's image features at its image tokens."""
        module: Any = self.module  # a transformers image-text-to-text model
        embeds = module.get_input_embeddings()(input_ids)
        for row, inputs in enumerate(images):
            if inputs is not None:
                at = input_ids[row] == self.prompts.image_token_id
                features = self.prompts.features(module, inputs, int(at.sum()), self.config.dtype)
                embeds[row, at] = features.to(embeds.dtype)
        return embeds
