"""The shard's loader refuses, before reading any weight, a checkpoint or option it cannot serve
(textgen_server.loader)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, Gemma3Config

from testing.models import build_vlm
from textgen_server.config import ServeConfig, UnsupportedConfigError
from textgen_server.loader import eos_token_ids, get_model, refuse_for_vlm
from textgen_server.model_config import load_config


def test_a_vision_language_family_not_served_is_refused_naming_it(tiny_llama: Path, tmp_path: Path) -> None:
    """gemma3's config loads as a causal LM in transformers: served as text, its images would be ignored."""
    for tokenizer_file in tiny_llama.glob("tokenizer*"):
        shutil.copy(tokenizer_file, tmp_path)
    Gemma3Config().save_pretrained(tmp_path)  # a config only: the refusal comes before the weights
    message = (
        "is a vision-language model \\(gemma3\\), which this shard cannot run: of those textgen serves llava_next, "
        "idefics3, qwen2_vl, qwen2_5_vl"
    )
    with pytest.raises(UnsupportedConfigError, match=message):
        get_model(ServeConfig(str(tmp_path)))


@pytest.mark.parametrize(
    ("option", "name"),
    [
        ({"quantize": "eetq"}, "--quantize"),
        ({"speculate": 2}, "--speculate"),
        ({"lora_adapters": "a"}, "LORA_ADAPTERS"),
    ],
)
def test_what_the_vlm_engine_cannot_honour_is_refused(option: dict[str, object], name: str) -> None:
    serve = ServeConfig(str(build_vlm("llava_next")), **option)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match=f"{name} is not supported for a vision-language model \\(llava"):
        get_model(serve)


def test_a_sharded_vlm_needs_the_paged_engine() -> None:
    serve = ServeConfig(str(build_vlm("llava_next")), sharded=True, use_flash_attention=False)
    with pytest.raises(UnsupportedConfigError, match="--sharded is not supported for a vision-language model"):
        refuse_for_vlm(serve, AutoConfig.from_pretrained(serve.model_id))


def test_an_m_rope_vlm_needs_the_paged_engine() -> None:
    """Qwen2-VL's positions (M-RoPE) are placed by the paged engine only: the padded one is refused, not run with
    the wrong positions."""
    serve = ServeConfig(str(build_vlm("qwen2_vl")), use_flash_attention=False)
    with pytest.raises(
        UnsupportedConfigError, match="USE_FLASH_ATTENTION=false is not supported for qwen2_vl: its M-RoPE"
    ):
        refuse_for_vlm(serve, AutoConfig.from_pretrained(serve.model_id))


def test_every_eos_id_of_generation_config_json_ends_a_sequence(tiny_llama: Path, tmp_path: Path) -> None:
    """generation_config.json's EOS list (a chat model's several) joins the config's and the tokenizer's; a file
    that is not JSON is skipped, as transformers' GenerationConfig skipped it."""
    model_dir = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    config = load_config(model_dir, trust_remote_code=False)
    assert eos_token_ids(model_dir, config, 1) == {config.eos_token_id, 1}
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_token_ids(model_dir, config, 1) == {config.eos_token_id, 1, 7, 9}
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert eos_token_ids(model_dir, config, None) == {config.eos_token_id, 11}
    (model_dir / "generation_config.json").write_text("{not json")
    assert eos_token_ids(model_dir, config, None) == {config.eos_token_id}
