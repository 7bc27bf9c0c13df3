"""A vision-language prompt as the router and the shards both treat it (the router counts its tokens, the shards
run them): the model's processor, an image chunk's bytes decoded, the text that stands for an image before the
processor expands it, which tokens open an image's span, and TGI's left truncation, which may drop the text before
the first image but never an image's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image


def open_image(data: bytes) -> Image:
    """An image's bytes decoded to RGB (any format PIL reads: a chunk's mimetype is not trusted, as in TGI).
    ValueError `invalid image: ...` for bytes the decoder refuses, whatever it raises: they come from a client."""
    import io

    from PIL import Image as PILImage  # the router's own process never decodes an image

    try:
        image = PILImage.open(io.BytesIO(data))
        image.load()
    except Exception as error:  # noqa: BLE001 - PIL raises OSError, ValueError, SyntaxError, DecompressionBombError
        raise ValueError(f"invalid image: {error}") from None
    return image.convert("RGB")


# Qwen2-VL's families, by model type, and their processor classes (loaded without a video processor:
# `load_processor`). Their processors do not frame an image; TGI's shard writes one as `<|vision_start|>`, its
# `<|image_pad|>` tokens, `<|vision_end|>`.
_VIDEO_BOUND = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
_QWEN_FRAME = ("<|vision_start|>", "<|vision_end|>")


def load_processor(model_id: str | Path, revision: str | None = None) -> Any:
    """The model's own processor (transformers' `AutoProcessor`): its images to pixel values, its prompts' image
    tokens expanded to the count the family gives each image.

    Qwen2-VL's and Qwen2.5-VL's processors also take videos, and transformers builds their video processor only
    with torchvision, which is not a dependency of textgen (the package registry's wheels are CUDA builds that do
    not import beside a CPU torch): `AutoProcessor` raises ImportError there. textgen serves images only, so those
    processors are built from the model's image processor and tokenizer, with no video processor: the same class,
    whose `__call__` expands the image tokens as it always does."""
    from transformers import AutoConfig, AutoProcessor  # the router's own process never imports transformers

    try:
        return AutoProcessor.from_pretrained(model_id, revision=revision)
    except ImportError:
        model_type = AutoConfig.from_pretrained(model_id, revision=revision).model_type
        if model_type not in _VIDEO_BOUND:
            raise
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    family = getattr(transformers, _VIDEO_BOUND[model_type])

    def check_argument_for_proper_class(self: Any, name: str, argument: Any) -> Any:
        if name == "video_processor" and argument is None:
            return None  # no videos: the class's check would import the video processor's torchvision
        return family.check_argument_for_proper_class(self, name, argument)

    images_only = type(family.__name__, (family,), {"check_argument_for_proper_class": check_argument_for_proper_class})
    tokenizer = AutoTokenizer.from_pretrained(model_id, revision=revision)
    return images_only(
        image_processor=AutoImageProcessor.from_pretrained(model_id, revision=revision),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,  # the checkpoint's, which AutoProcessor would have read
    )


def _frame(processor: Any) -> tuple[str, str]:
    """The tags around an image that the family's processor does not add (none but for Qwen2-VL's)."""
    return _QWEN_FRAME if type(processor).__name__ in _VIDEO_BOUND.values() else ("", "")


def image_text(processor: Any) -> str:
    """The text that stands for one image in a prompt, before the processor expands its image token."""
    start, end = _frame(processor)
    return start + processor.image_token + end


def image_span_ids(processor: Any) -> set[int]:
    """The ids an image's span can start with: the processor's image token, and the tags some families put before
    it (idefics3's `<fake_token_around_image>` and `<global-img>`, Qwen2-VL's `<|vision_start|>`)."""
    tokenizer = processor.tokenizer
    ids = {tokenizer.convert_tokens_to_ids(processor.image_token)}
    start = _frame(processor)[0]
    if start:
        ids.add(tokenizer.convert_tokens_to_ids(start))
    return ids | {
        getattr(processor, name)
        for name in ("fake_image_token_id", "global_image_token_id")
        if hasattr(processor, name)
    }


def truncate_left(ids: list[int], truncate: int | None, span_ids: set[int]) -> list[int]:
    """`ids` cut to their last `truncate` (None or 0: all of them). ValueError where the cut would reach an image's
    tokens (TGI's shard fails there with "Image is truncated")."""
    if not truncate or len(ids) <= truncate:
        return ids
    cut = len(ids) - truncate
    if cut > next((i for i, token in enumerate(ids) if token in span_ids), len(ids)):
        raise ValueError(
            f"the prompt with its images is {len(ids)} tokens: truncating it to {truncate} would cut an image"
        )
    return ids[cut:]
