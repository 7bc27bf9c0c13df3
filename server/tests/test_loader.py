"""The shard's loader refuses, before reading any weight, a checkpoint it cannot serve (textgen_server.loader)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import Gemma3Config

from testing.models import build_vlm
from textgen_server.config import ServeConfig, UnsupportedConfigError
from textgen_server.loader import get_model
from textgen_server.vlm_builder import VLM_ARCHS


def refused_as_vlm(model_dir: Path, model_type: str) -> None:
    message = f"is a vision-language model \\({model_type}\\), which this shard cannot run: textgen serves text"
    with pytest.raises(UnsupportedConfigError, match=message):
        get_model(ServeConfig(str(model_dir)))


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_a_vision_language_model_is_refused_naming_its_family(arch: str) -> None:
    refused_as_vlm(build_vlm(arch), arch)


def test_a_vlm_that_transformers_loads_as_a_causal_lm_is_refused_too(tiny_llama: Path, tmp_path: Path) -> None:
    """gemma3's config loads as a causal LM in transformers: served as text, its images would be ignored."""
    for tokenizer_file in tiny_llama.glob("tokenizer*"):
        shutil.copy(tokenizer_file, tmp_path)
    Gemma3Config().save_pretrained(tmp_path)  # a config only: the refusal comes before the weights
    refused_as_vlm(tmp_path, "gemma3")
