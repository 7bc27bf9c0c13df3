"""The oracle of a vision-language model's tokens: transformers' greedy `generate` with the model's own processor
(float32, one request at a time), and real image bytes to send it and textgen alike."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from textgen_common.image_prompts import image_text, load_processor


def image_bytes(seed: int, height: int, width: int, fmt: str = "PNG") -> bytes:
    """A seeded random RGB image, encoded as `fmt` (PNG, JPEG, WEBP)."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    data = io.BytesIO()
    Image.fromarray(pixels).save(data, format=fmt)
    return data.getvalue()


class VlmOracle:
    def __init__(self, model_dir: Path) -> None:
        # AutoProcessor, but Qwen2-VL's without the video processor that needs torchvision: the same class and call
        self.processor = load_processor(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        self.image_text = image_text(self.processor)  # the image token, framed as TGI frames Qwen2-VL's

    def inputs(self, before: str, image: bytes | None, after: str) -> Any:
        """The processor's tensors for `before`, the image (its processor's image token there), `after`."""
        return self.pieces_inputs([before, after] if image is None else [before, image, after])

    def pieces_inputs(self, pieces: list[str | bytes]) -> Any:
        """The processor's tensors for a prompt of texts and images (bytes) in order."""
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pieces if isinstance(p, bytes)]
        text = "".join(p if isinstance(p, str) else self.image_text for p in pieces)
        if not images:
            return self.processor.tokenizer(text, return_tensors="pt")
        return self.processor(text=text, images=images, return_tensors="pt")

    def greedy(
        self, before: str, image: bytes | None, after: str, new_tokens: int, ignore_eos: bool = True
    ) -> list[int]:
        """The greedy tokens after `inputs(before, image, after)`. EOS (a tiny random model's best token at times)
        ends them, or with `ignore_eos` (the gRPC tests' requests) neither ends nor is forbidden (as
        `min_new_tokens` would forbid it)."""
        return self.greedy_pieces([before, after] if image is None else [before, image, after], new_tokens, ignore_eos)

    @torch.inference_mode()
    def greedy_pieces(self, pieces: list[str | bytes], new_tokens: int, ignore_eos: bool = True) -> list[int]:
        """`greedy` for a prompt of texts and images (bytes) in order."""
        inputs = self.pieces_inputs(pieces)
        stop: dict[str, Any] = {"eos_token_id": []} if ignore_eos else {}
        out = self.model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **stop)
        return out[0, inputs["input_ids"].shape[1] :].tolist()
