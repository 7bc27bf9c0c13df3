"""The shard's loader refuses, before reading any weight, a checkpoint it cannot serve (textgen_server.loader)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, Gemma3Config, LlavaNextConfig

from textgen_server.config import ServeConfig, UnsupportedConfigError
from textgen_server.loader import get_model


@pytest.mark.parametrize("config_class", [LlavaNextConfig, Gemma3Config])
def test_a_vision_language_model_is_refused_naming_its_family(
    config_class: type, tiny_llama: Path, tmp_path: Path
) -> None:
    """gemma3's config loads as a causal LM in transformers: served as text, its images would be ignored."""
    for tokenizer_file in tiny_llama.glob("tokenizer*"):
        shutil.copy(tokenizer_file, tmp_path)
    config_class().save_pretrained(tmp_path)  # a config only: the refusal comes before the weights
    model_type = AutoConfig.from_pretrained(tmp_path).model_type
    message = f"is a vision-language model \\({model_type}\\), which this shard cannot run: textgen serves text"
    with pytest.raises(UnsupportedConfigError, match=message):
        get_model(ServeConfig(str(tmp_path)))
