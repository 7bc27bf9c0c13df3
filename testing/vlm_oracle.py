"""The oracle of a vision-language model's tokens: transformers' greedy `generate` with the model's own processor
(float32, one request at a time), and real image bytes to send it and textgen alike."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor


def image_bytes(seed: int, height: int, width: int, fmt: str = "PNG") -> bytes:
    """A seeded random RGB image, encoded as `fmt` (PNG, JPEG, WEBP)."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    data = io.BytesIO()
    Image.fromarray(pixels).save(data, format=fmt)
    return data.getvalue()


class VlmOracle:
    def __init__(self, model_dir: Path) -> None:
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        self.image_token: str = self.processor.image_token

    def inputs(self, before: str, image: bytes | None, after: str) -> Any:
        """The processor's tensors for `before`, the image (its processor's image token there), `after`."""
        if image is None:
            return self.processor.tokenizer(before + after, return_tensors="pt")
        rgb = Image.open(io.BytesIO(image)).convert("RGB")
        return self.processor(text=before + self.image_token + after, images=[rgb], return_tensors="pt")

    @torch.inference_mode()
    def greedy(self, before: str, image: bytes | None, after: str, new_tokens: int) -> list[int]:
        """The greedy tokens after `inputs(before, image, after)`."""
        inputs = self.inputs(before, image, after)
        out = self.model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()
