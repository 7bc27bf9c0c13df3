"""model_config.load_config: tp_llama's families get a KeptConfig holding what AutoConfig resolves, kept under
TEXTGEN_CACHE_DIR, so that a later start (with the tokenizer kept too, tokenizer.py) imports no transformers at all;
other configs are AutoConfig's own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from testing.models import build_vlm, edited_copy
from textgen_server.model_config import KeptConfig, ModelConfig, load_config
from textgen_server.tokenizer import FastTokenizer, load_tokenizer


@pytest.fixture
def kept_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A TEXTGEN_CACHE_DIR of the test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TEXTGEN_CACHE_DIR", str(root))
    return root


def legacy_llama(tiny_llama: Path, at: Path) -> Path:
    """tiny_llama with a config.json as older hub checkpoints have it: defaults left out, RoPE in the old keys."""

    def legacy(config: dict[str, Any]) -> None:
        for key in ("rope_parameters", "head_dim", "attention_bias", "mlp_bias", "rms_norm_eps", "tie_word_embeddings"):
            config.pop(key, None)
        config.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})

    return edited_copy(tiny_llama, at, "config.json", legacy)


def assert_same_as_autoconfig(config: ModelConfig, model_dir: Path) -> None:
    reference = AutoConfig.from_pretrained(model_dir)
    # to_dict leaves use_cache out; dtype stays the string config.json holds (--dtype decides): no shard reads either.
    # Values are compared as the kept file holds them (JSON: id2label's keys are strings).
    keys = set(reference.to_dict()) - {"use_cache", "dtype"}

    def as_kept(values: dict[str, Any]) -> Any:
        return json.loads(json.dumps(values))

    assert as_kept({key: getattr(config, key) for key in keys}) == as_kept(
        {key: getattr(reference, key) for key in keys}
    )


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "legacy-llama"])
def test_a_tp_family_s_config_is_kept_with_every_value_autoconfig_resolves(
    arch: str, request: pytest.FixtureRequest, kept_in: Path, tmp_path: Path
) -> None:
    if arch == "legacy-llama":
        model_dir = legacy_llama(request.getfixturevalue("tiny_llama"), tmp_path / "legacy")
    else:
        model_dir = request.getfixturevalue(f"tiny_{arch}")
    first = load_config(model_dir, trust_remote_code=False)
    (kept,) = kept_in.glob("config-*.json")
    second = load_config(model_dir, trust_remote_code=False)
    for config in (first, second):
        assert type(config) is KeptConfig
        assert_same_as_autoconfig(config, model_dir)
    if arch == "legacy-llama":  # the family's defaults and RoPE's new form came from LlamaConfig
        assert second.rms_norm_eps == 1e-6 and second.head_dim == second.hidden_size // second.num_attention_heads
        rope = second.rope_parameters
        assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("linear", 2.0, 500000.0)
    # A kept file that cannot be read is resolved again.
    kept.write_text("{")
    assert_same_as_autoconfig(load_config(model_dir, trust_remote_code=False), model_dir)


def test_a_second_directory_with_the_same_config_gets_its_own_name(
    tiny_llama: Path, kept_in: Path, tmp_path: Path
) -> None:
    load_config(tiny_llama, trust_remote_code=False)
    twin = Path(shutil.copytree(tiny_llama, tmp_path / "twin"))
    config = load_config(twin, trust_remote_code=False)
    assert len(list(kept_in.glob("config-*.json"))) == 1  # one file for both
    assert_same_as_autoconfig(config, twin)


def test_other_configs_are_autoconfig_s_own_and_not_kept(tiny_gpt2: Path, kept_in: Path) -> None:
    for model_dir in (tiny_gpt2, build_vlm("llava_next")):
        config = load_config(model_dir, trust_remote_code=False)
        assert type(config) is type(AutoConfig.from_pretrained(model_dir))
    assert not list(kept_in.glob("config-*.json"))


def test_with_nothing_kept_the_config_is_still_a_kept_config(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TEXTGEN_CACHE_DIR", "")
    config = load_config(tiny_llama, trust_remote_code=False)
    assert type(config) is KeptConfig
    assert_same_as_autoconfig(config, tiny_llama)


def test_the_tokenizer_is_autotokenizer_s_with_or_without_a_named_class(
    tiny_llama: Path, kept_in: Path, tmp_path: Path
) -> None:
    # Without tokenizer_class, AutoTokenizer picks the class by the config's type.
    unnamed = edited_copy(tiny_llama, tmp_path / "unnamed", "tokenizer_config.json", lambda t: t.pop("tokenizer_class"))
    for model_dir in (tiny_llama, unnamed):
        # keep=False: transformers' own object, as the shard builds it before serving it from its backend
        tokenizer = load_tokenizer(model_dir, load_config(model_dir, trust_remote_code=False), False, keep=False)
        reference = AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
        assert type(tokenizer) is type(reference)
        assert tokenizer.init_kwargs == reference.init_kwargs  # type: ignore[union-attr]
        ids = list(range(3, 60))
        assert tokenizer.decode(ids) == reference.decode(ids)


def test_a_later_start_imports_no_transformers(tiny_llama: Path, kept_in: Path) -> None:
    """A shard's whole load (get_model) in a new process, after a first start kept the config and the tokenizer."""
    first = load_tokenizer(tiny_llama, load_config(tiny_llama, trust_remote_code=False), False, keep=True)
    assert isinstance(first, FastTokenizer)
    code = (
        "import sys\n"
        "from textgen_server.config import ServeConfig\n"
        "from textgen_server.loader import get_model\n"
        "model = get_model(ServeConfig(sys.argv[1]))\n"
        "print(type(model).__name__, type(model.tokenizer).__name__, 'transformers' in sys.modules)\n"
    )
    env = {**os.environ, "TEXTGEN_CACHE_DIR": str(kept_in)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "PagedCausalLM FastTokenizer False"
