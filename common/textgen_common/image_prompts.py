"""A vision-language prompt as the router and the shards both treat it (the router counts its tokens, the shards
run them): an image chunk's bytes decoded, which tokens open an image's span, and TGI's left truncation, which may
drop the text before the first image but never an image's tokens."""

from __future__ import annotations

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


def image_span_ids(processor: Any) -> set[int]:
    """The ids an image's span can start with: the processor's image token, and the tags some families put before
    it (idefics3's `<fake_token_around_image>` and `<global-img>`)."""
    ids = {processor.tokenizer.convert_tokens_to_ids(processor.image_token)}
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
