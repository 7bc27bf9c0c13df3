"""model_config.load_config: tp_llama's families get a plain config holding what AutoConfig resolves, kept under
TEXTGEN_CACHE_DIR, so that a later start imports none of transformers' model loading; other configs are
AutoConfig's own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from testing.models import build_vlm, edited_copy
from textgen_server.loader import load_tokenizer
from textgen_server.model_config import load_config


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


def assert_same_as_autoconfig(config: PretrainedConfig, model_dir: Path) -> None:
    reference = AutoConfig.from_pretrained(model_dir)
    keys = set(reference.to_dict()) - {"use_cache"}  # a plain config never keeps use_cache, and no shard reads it
    assert {key: getattr(config, key) for key in keys} == {key: getattr(reference, key) for key in keys}


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
        assert type(config) is PretrainedConfig
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


def test_with_nothing_kept_the_config_is_still_the_plain_one(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TEXTGEN_CACHE_DIR", "")
    config = load_config(tiny_llama, trust_remote_code=False)
    assert type(config) is PretrainedConfig
    assert_same_as_autoconfig(config, tiny_llama)


def test_the_tokenizer_is_autotokenizer_s_with_or_without_a_named_class(
    tiny_llama: Path, kept_in: Path, tmp_path: Path
) -> None:
    # Without tokenizer_class, AutoTokenizer picks the class by the config's type.
    unnamed = edited_copy(tiny_llama, tmp_path / "unnamed", "tokenizer_config.json", lambda t: t.pop("tokenizer_class"))
    for model_dir in (tiny_llama, unnamed):
        tokenizer = load_tokenizer(model_dir, load_config(model_dir, trust_remote_code=False), False)
        reference = AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
        assert type(tokenizer) is type(reference)
        assert tokenizer.init_kwargs == reference.init_kwargs
        ids = list(range(3, 60))
        assert tokenizer.decode(ids) == reference.decode(ids)


def test_a_later_start_imports_none_of_transformers_model_loading(tiny_llama: Path, kept_in: Path) -> None:
    load_config(tiny_llama, trust_remote_code=False)  # the first start keeps it
    code = (
        "import sys; from pathlib import Path\n"
        "from textgen_server.loader import load_tokenizer\n"
        "from textgen_server.model_config import load_config\n"
        "config = load_config(Path(sys.argv[1]), False)\n"
        "load_tokenizer(Path(sys.argv[1]), config, False)\n"
        "print(sorted(m for m in ('transformers.activations', 'torch.distributed.tensor') if m in sys.modules))\n"
    )
    env = {**os.environ, "TEXTGEN_CACHE_DIR": str(kept_in)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
