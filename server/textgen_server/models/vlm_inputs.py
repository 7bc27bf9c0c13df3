"""A vision-language model's prompts and image features, as both engines (models/vlm_causal_lm.py, padded, and
models/paged_vlm.py, paged) use them.

A request's generate.v3 input chunks, text and images in order, become one prompt: each image chunk is the family's
image token (its processor's `image_token`, framed as TGI's shard frames Qwen2-VL's) at its place, and the model's
own processor expands those tokens to the count the family gives an image and prepares its pixels, as transformers'
`generate` gets them. A row without images is tokenized as on every other engine. An image's features (the
transformers module's `get_image_features`) go to the prompt's image tokens in order: a function of the pixels
alone, so any run of the prompt's positions can be embedded on its own (a chunk of a chunked prefill, the rest
after a prefix-cache hit).

Qwen2-VL and Qwen2.5-VL place their tokens with M-RoPE: an image's tokens get (temporal, height, width) positions
of its grid, and the text after an image continues from the largest of them, so from the prompt's last image on a
token's position is its index plus the row's `rope_delta` (negative). transformers' `get_rope_index` gives both.

Truncation (on the left, as TGI's) may drop text before the first image but never an image's tokens: a request
whose `truncate` would is refused (TGI's shard fails there with "Image is truncated").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from textgen_common.image_prompts import image_span_ids, image_text, open_image, truncate_left
from textgen_pb import generate_pb2
from textgen_server.models.model import Model, prepare_row

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

# The families served, by config.json's model_type; those that place their tokens with M-RoPE.
VLM_MODEL_TYPES = ("llava_next", "idefics3", "qwen2_vl", "qwen2_5_vl")
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")

ImageInputs = dict[str, torch.Tensor]  # a row's processor outputs but its ids: pixel_values and their sizes or mask


@dataclass
class RowImages:
    """A row's images on the paged engine, until its prompt's last image token is computed: the processor's
    inputs, the prompt positions of its image tokens (ascending), and their features once a step needs them.
    With M-RoPE, each prompt token's rotary positions [3, prompt length] and the offset of the tokens after the
    last image (`rope_delta`: a token's position is its index plus it)."""

    inputs: ImageInputs
    positions: list[int]
    features: torch.Tensor | None = None
    rope: torch.Tensor | None = None
    rope_delta: int = 0


class VlmPrompts:
    """The model's processor and image token: a request's ids and image inputs, and their features."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, processor: ProcessorMixin) -> None:
        self.processor = processor
        self.image_token: str = getattr(processor, "image_token")  # noqa: B009 (each family's processor has one)
        self.image_text = image_text(processor)
        found = tokenizer.convert_tokens_to_ids(self.image_token)
        assert isinstance(found, int)
        self.image_token_id = found
        self.span_ids = image_span_ids(processor)

    def prepare(
        self, request: generate_pb2.Request, model: Model
    ) -> tuple[list[int], LLMatcher | None, int, ImageInputs | None]:
        """prepare_row's (ids, matcher, adapter index) and the row's image inputs (None without images)."""
        chunks = request.input_chunks.chunks if request.HasField("input_chunks") else []
        if len(chunks) <= 1 and not any(chunk.WhichOneof("chunk") == "image" for chunk in chunks):
            return (*prepare_row(request, model), None)
        inputs: ImageInputs = {}

        def encode(request: generate_pb2.Request) -> list[int]:
            """The processor's ids for the chunks (the image token at each image); its pixel tensors to `inputs`."""
            text = "".join(c.text if c.WhichOneof("chunk") == "text" else self.image_text for c in chunks)
            images = [open_image(c.image.data) for c in chunks if c.WhichOneof("chunk") == "image"]
            out = self.processor(
                text=text, images=images or None, return_tensors="pt", add_special_tokens=request.add_special_tokens
            )
            ids: list[int] = out.pop("input_ids")[0].tolist()
            out.pop("attention_mask", None)
            out.pop("mm_token_type_ids", None)  # which ids are images: `rope` finds them from the ids
            inputs.update(out)
            return truncate_left(ids, request.truncate, self.span_ids)

        return (*prepare_row(request, model, encode), inputs or None)

    def rope(self, module: torch.nn.Module, ids: list[int], inputs: ImageInputs) -> tuple[torch.Tensor, int]:
        """An M-RoPE prompt's rotary positions [3, len(ids)] and its `rope_delta`, as transformers' model places
        them (`module`: the image-text-to-text model; `inputs`: the prompt's image inputs, with its grids)."""
        vlm: Any = getattr(module, "model", module)
        ids_row = torch.tensor([ids])
        kinds = (ids_row == self.image_token_id).int()  # 1 at an image's tokens, 0 at text
        positions, delta = vlm.get_rope_index(ids_row, kinds, image_grid_thw=inputs["image_grid_thw"])
        return positions[:, 0], int(delta)

    def features(self, module: torch.nn.Module, inputs: ImageInputs, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The features of a row's images [image tokens, hidden], in the order of its `count` image tokens.
        `module` is the transformers image-text-to-text model (its vision tower and projector)."""
        device = next(module.parameters()).device
        on_device = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
        vlm: Any = module
        out = vlm.get_image_features(**on_device, return_dict=True)
        features = torch.cat(list(out.pooler_output), dim=0)
        if count != features.shape[0]:
            raise RuntimeError(f"{count} image tokens for {features.shape[0]} image features")
        return features
