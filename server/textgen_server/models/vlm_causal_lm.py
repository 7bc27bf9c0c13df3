"""Vision-language models on the padded engine (TGI's VlmCausalLM), for llava_next and idefics3.

A request's generate.v3 input chunks, text and images in order, become one prompt: each image chunk is the
family's image token (its processor's `image_token`) at its place, and the model's own processor expands those
tokens to the count the family gives an image and prepares its pixels, as transformers' `generate` gets them. A
row without images is tokenized as on every other engine. The prefill embeds the padded prompt, puts each row's
image features (the model's `get_image_features`) at its image tokens, and runs the language model on those
embeddings; decode steps are CausalLM's, reading the KV cache only. Images are kept until the batch's prefill
and then dropped; the padded engine never chunks a prefill, so an image is always embedded whole.

Truncation (on the left, as TGI's) may drop text before the first image but never an image's tokens: a request
whose `truncate` would is refused (TGI's shard fails there with "Image is truncated"). TGI's warmup request, its
text as long as `truncate` and an image after it, loses the start of its text.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image, UnidentifiedImageError

from textgen_common.image_prompts import image_span_ids, truncate_left
from textgen_pb import generate_pb2
from textgen_server.models.causal_lm import CausalLM, CausalLMBatch
from textgen_server.models.model import InvalidRequestError, Model, prepare_row, prepare_rows

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    from textgen_server.config import ShardConfig
    from textgen_server.models.kv_cache import KVCache

# The families served, by config.json's model_type.
VLM_MODEL_TYPES = ("llava_next", "idefics3")

ImageInputs = dict[str, torch.Tensor]  # a row's processor outputs but its ids: pixel_values and their sizes or mask


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
        self.processor = processor
        self.image_token: str = getattr(processor, "image_token")  # noqa: B009 (each family's processor has one)
        found = tokenizer.convert_tokens_to_ids(self.image_token)
        assert isinstance(found, int)
        self.image_token_id = found
        self.image_span_ids = image_span_ids(processor)

    @property
    def batch_type(self) -> type[VlmCausalLMBatch]:
        return VlmCausalLMBatch

    def prepare(self, request: generate_pb2.Request) -> tuple[list[int], LLMatcher | None, int, ImageInputs | None]:
        """prepare_row's (ids, matcher, adapter index) and the row's image inputs (None without images)."""
        chunks = request.input_chunks.chunks if request.HasField("input_chunks") else []
        if len(chunks) <= 1 and not any(chunk.WhichOneof("chunk") == "image" for chunk in chunks):
            return (*prepare_row(request, self), None)
        inputs: ImageInputs = {}

        def encode(request: generate_pb2.Request) -> list[int]:
            """The processor's ids for the chunks (the image token at each image); its pixel tensors to `inputs`."""
            text = "".join(c.text if c.WhichOneof("chunk") == "text" else self.image_token for c in chunks)
            images = [open_image(c.image.data) for c in chunks if c.WhichOneof("chunk") == "image"]
            out = self.processor(
                text=text, images=images or None, return_tensors="pt", add_special_tokens=request.add_special_tokens
            )
            ids: list[int] = out.pop("input_ids")[0].tolist()
            out.pop("attention_mask", None)
            inputs.update(out)
            return truncate_left(ids, request.truncate, self.image_span_ids)

        return (*prepare_row(request, self, encode), inputs or None)

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
            if inputs is None:
                continue
            on_device = {
                k: v.to(self.config.device, self.config.dtype if v.is_floating_point() else v.dtype)
                for k, v in inputs.items()
            }
            out = module.get_image_features(**on_device, return_dict=True)
            features = torch.cat(list(out.pooler_output), dim=0).to(embeds.dtype)
            at = input_ids[row] == self.image_token_id
            if int(at.sum()) != features.shape[0]:
                raise RuntimeError(f"{int(at.sum())} image tokens for {features.shape[0]} image features")
            embeds[row, at] = features
        return embeds


def open_image(data: bytes) -> Image.Image:
    """An image chunk's bytes decoded (any format PIL reads; the chunk's mimetype is not trusted, as in TGI)."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise InvalidRequestError(f"invalid image: {error}") from None
    return image.convert("RGB")
