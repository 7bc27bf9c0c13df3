"""A request's images, for a vision-language model: TGI's markdown images in `inputs`, and the prompt's token ids
with each image expanded as the model's own processor expands it.

- Which models: those whose `config.json` names a model type TGI's router parses images for (`VLM_MODEL_TYPES`);
  for any other model a markdown image stays text, as in TGI.
- `split(inputs)`: the text and images of `inputs`, in order. An image is TGI's `![](url)` (an empty alt text
  only: `![alt](url)` is text). The url is a data URI, checked as TGI checks it (`data:<mime>;base64,<data>`,
  TGI's errors and messages), or an http(s) URL, which `ImagePrompts.load` fetches (image_fetch.py: never an
  open proxy).
- `ImagePrompts`: the model's processor (transformers, and torch under it) in worker processes, so that the
  router's own process never imports them and a large image never stalls its event loop. It returns a prompt's
  ids, images expanded (the real count, where TGI's router counts some families from a formula), truncated as the
  shards truncate them (textgen_common.image_prompts: never into an image).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import multiprocessing
import re
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from textgen_common.image_prompts import image_span_ids, image_text, load_processor, open_image, truncate_left
from textgen_router.image_fetch import FetchPolicy, fetch_image
from textgen_router.model_files import model_file
from textgen_router.types import ValidationError

# TGI's router (`validation.rs`, `prepare_input`) parses images for these model types only.
VLM_MODEL_TYPES = (
    "idefics",
    "mllama",
    "idefics2",
    "idefics3",
    "gemma3",
    "llama4",
    "paligemma",
    "llava_next",
    "qwen2_vl",
    "qwen2_5_vl",
)
IMAGE_MARKDOWN = re.compile(r"!\[\]\([^\)]*\)")  # TGI's


@dataclass(frozen=True)
class Image:
    """An image chunk as the shards receive it (generate.v3 `Image`)."""

    data: bytes
    mimetype: str


@dataclass(frozen=True)
class ImageUrl:
    """An http(s) image URL, not fetched yet."""

    url: str


Chunk = str | Image
Piece = str | Image | ImageUrl


def is_multimodal(model_id: str, revision: str | None) -> bool:
    """Whether the model's config.json names one of VLM_MODEL_TYPES."""
    path = model_file(model_id, "config.json", revision)
    if path is None:
        return False
    try:
        return json.loads(path.read_text()).get("model_type") in VLM_MODEL_TYPES
    except (OSError, ValueError):
        return False


def split(inputs: str) -> list[Piece]:
    """The text and images of `inputs` in order (no empty text pieces). Raises ValidationError (422)."""
    chunks: list[Piece] = []
    start = 0
    for match in IMAGE_MARKDOWN.finditer(inputs):
        if match.start() > start:
            chunks.append(inputs[start : match.start()])
        chunks.append(image_at(match.group()[4:-1]))
        start = match.end()
    if start < len(inputs):
        chunks.append(inputs[start:])
    return chunks


def image_at(url: str) -> Image | ImageUrl:
    """The image a markdown url names: a data URI decoded, as TGI checks it, or an http(s) URL to fetch."""
    if url.startswith(("http://", "https://")):
        return ImageUrl(url)
    if not url.startswith("data:"):
        raise ValidationError(f"invalid image content: {url}")
    content = url[len("data:") :]
    parts = content.split(";")
    if len(parts) != 2 or not parts[1].startswith("base64,"):
        raise ValidationError(f"invalid image content: {content}")
    try:
        data = base64.b64decode(parts[1][len("base64,") :], validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValidationError(f"base64 encoding is invalid: {err}") from None
    return Image(data, parts[0])


# The workers fork from a server process that imported these once (transformers' processors import its model
# loading, scipy and torch: ~6 s of CPU on a 2-core Zen 3), rather than each importing them as a spawned process
# does; the router's own process never imports them.
WORKER_PRELOAD = ["transformers.processing_utils", "transformers.models.auto.processing_auto", "PIL.Image", __name__]


class ImagePrompts:
    """The model's processor in `workers` worker processes (forked from a preloaded server, each loading the
    processor once), and the policy its image URLs are fetched under."""

    def __init__(self, model_id: str, revision: str | None, workers: int, fetch_policy: FetchPolicy) -> None:
        self.fetch_policy = fetch_policy
        self._model = (model_id, revision)
        self._workers = workers
        self._pool = self._new_pool()
        self._starting: list[Future[int]] = []

    def _new_pool(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(WORKER_PRELOAD)
        return ProcessPoolExecutor(
            max_workers=self._workers,
            mp_context=context,
            initializer=_load_processor,
            initargs=self._model,
        )

    def start(self) -> None:
        """Start the workers now (each loads the processor: seconds), not on the first image request; the
        router starts them with the shards' warmup and awaits `ready` before it serves."""
        self._starting = [self._pool.submit(int) for _ in range(self._workers)]

    async def ready(self) -> None:
        await asyncio.gather(*(asyncio.wrap_future(started) for started in self._starting))

    async def load(self, pieces: list[Piece]) -> list[Chunk]:
        """`pieces` with every image URL fetched, all at once."""
        fetched = await asyncio.gather(
            *(fetch_image(p.url, self.fetch_policy) for p in pieces if isinstance(p, ImageUrl))
        )
        images = iter(Image(data, mimetype) for data, mimetype in fetched)
        return [next(images) if isinstance(p, ImageUrl) else p for p in pieces]

    async def ids(
        self, chunks: list[Chunk], add_special_tokens: bool, truncate: int | None
    ) -> tuple[list[int], list[int]]:
        """The prompt's ids, images expanded, truncated as the shards truncate it (never into an image), and its
        prefix-cache key (`cache_key`)."""
        loop = asyncio.get_running_loop()
        texts_and_images = [c if isinstance(c, str) else c.data for c in chunks]
        try:
            out = await loop.run_in_executor(self._pool, _expand, texts_and_images, add_special_tokens, truncate)
        except BrokenProcessPool:
            # A worker died (an image too large for memory, a kill): the pool refuses all work from then on.
            self._pool = self._new_pool()
            raise ValidationError("the images could not be prepared: the worker preparing them died") from None
        if isinstance(out, str):
            raise ValidationError(out)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class _Prompts:
    """A worker's processor and what every request reads of it, found once when the worker starts."""

    processor: Any
    image_text: str  # what stands for an image before the processor expands it
    span_ids: set[int]  # the ids an image's span can start with (truncation never cuts into one)
    image_token_id: int


_PROMPTS: _Prompts | None = None


def _load_processor(model_id: str, revision: str | None) -> None:
    global _PROMPTS
    processor = load_processor(model_id, revision)
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    _PROMPTS = _Prompts(processor, image_text(processor), image_span_ids(processor), image_token_id)


def _expand(
    chunks: list[str | bytes], add_special_tokens: bool, truncate: int | None
) -> tuple[list[int], list[int]] | str:
    """In a worker: the processor's ids for the prompt (an image token at each image), truncated, and their
    prefix-cache key; or the 422 message of an image that does not decode, or of a truncation that would cut one."""
    prompts = _PROMPTS
    assert prompts is not None, "the worker's initializer loads the processor"
    try:
        images = [open_image(chunk) for chunk in chunks if isinstance(chunk, bytes)]
    except ValueError as err:
        return str(err)
    text = "".join(c if isinstance(c, str) else prompts.image_text for c in chunks)
    try:
        ids: list[int] = prompts.processor(text=text, images=images, add_special_tokens=add_special_tokens)[
            "input_ids"
        ][0]
    except Exception as err:  # noqa: BLE001 - an image the processor cannot take (too small, odd mode) is a 422
        return f"the images could not be prepared for the model: {err}"
    try:
        ids = truncate_left(list(ids), truncate, prompts.span_ids)
    except ValueError as err:
        return str(err)
    return ids, cache_key(ids, prompts.image_token_id, [c for c in chunks if isinstance(c, bytes)])


def cache_key(ids: list[int], image_token_id: int, images: list[bytes]) -> list[int]:
    """`ids` as the prefix cache looks them up: each image token's key is drawn from the bytes of the prompt's
    images and its place among its image tokens, a negative number that no token id equals. So a cached prefix
    runs through an image only for a prompt with the same images (a different image of the same size has the
    same placeholder ids, but not the same KV). Keyed by all of the prompt's images, not only those before a
    token: a prompt that adds an image after the same first one shares the text before the first image only."""
    digest = hashlib.sha256()
    for image in images:
        digest.update(hashlib.sha256(image).digest())
    seed = int.from_bytes(digest.digest()[:8], "little")
    key = list(ids)
    ordinal = 0
    for i, token in enumerate(ids):
        if token == image_token_id:
            key[i] = -1 - (seed + ordinal) % 2**62
            ordinal += 1
    return key
