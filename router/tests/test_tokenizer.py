"""The router's tokenizer (textgen_router/tokenizer.py): built by transformers once, then read from the file kept
under TEXTGEN_CACHE_DIR, which a change of the model's tokenizer files replaces."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from router_fixtures import MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS
from transformers import AutoTokenizer

from textgen_common.cache_dir import ENV as CACHE_ENV
from textgen_router.chat_template import ChatTemplate
from textgen_router.tokenizer import load_tokenizer
from textgen_router.validation import PROCESS_MIN_CHARS, Limits, Validator

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def model(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the tiny model's tokenizer files, which a test may edit, and an empty cache directory."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_llama / name, directory / name)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return directory


def kept_files() -> list[Path]:
    return sorted(Path(os.environ[CACHE_ENV]).glob("tokenizer-*.json"))


def edit_config(model: Path, **changes: object) -> None:
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))


def test_a_changed_tokenizer_file_is_built_again(model: Path) -> None:
    assert load_tokenizer(model).special_tokens["eos_token"] == "</s>"
    assert len(kept_files()) == 1
    edit_config(model, eos_token="<pad>")
    assert load_tokenizer(model).special_tokens["eos_token"] == "<pad>"
    assert len(kept_files()) == 2
    assert load_tokenizer(model).special_tokens["eos_token"] == "<pad>"  # read from the second file


def test_a_bad_kept_file_is_built_again(model: Path) -> None:
    built = load_tokenizer(model)
    [kept] = kept_files()
    kept.write_text('{"tokenizer": "not a tokenizer"')
    again = load_tokenizer(model)
    assert again.encoder.to_str() == built.encoder.to_str() and again.special_tokens == built.special_tokens
    assert json.loads(kept.read_text())["special_tokens"] == built.special_tokens  # written whole again


def test_an_empty_cache_directory_keeps_nothing(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_tokenizer(model).is_fast
    assert not (tmp_path / "home").exists() and not (tmp_path / "cache").exists()


def test_split_special_tokens_holds_after_the_cache_and_in_worker_processes(model: Path) -> None:
    # transformers' split_special_tokens sets the encoder's encode_special_tokens, which its JSON does not hold:
    # the kept file and the worker processes (long inputs) carry it themselves.
    edit_config(model, split_special_tokens=True)
    oracle = AutoTokenizer.from_pretrained(model)
    load_tokenizer(model)
    kept = load_tokenizer(model)
    assert kept.encoder.encode_special_tokens
    validator = Validator(kept, Limits(1, 4, 5, MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS), workers=1)
    try:
        for text in ["a <s> b </s>", "a <s> b </s> " * (PROCESS_MIN_CHARS // 8)]:
            got = asyncio.run(validator.tokenize(text, add_special_tokens=False))
            assert got.ids == oracle(text, add_special_tokens=False)["input_ids"]
            assert oracle.convert_tokens_to_ids("<s>") not in got.ids
    finally:
        validator.close()


def test_a_start_with_a_kept_tokenizer_imports_neither_transformers_nor_torch(model: Path) -> None:
    load_tokenizer(model)
    script = (
        "import sys; from textgen_router.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(model)!r}); "
        "print(t.is_fast, sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "[]"]


def test_chat_templates_get_the_special_tokens_as_apply_chat_template_does(model: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}{{ pad_token }}"
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    built = load_tokenizer(model)
    for tokenizer in (built, load_tokenizer(model)):  # as built, and as read from the kept file
        assert ChatTemplate(tokenizer.special_tokens, template).apply(messages) == expected
    assert expected == "<s>system: Be brief.</s>\nuser: Hi</s>\nassistant:<pad>"


def test_a_cache_directory_that_cannot_be_written_still_loads(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "cache"))
    assert load_tokenizer(model).is_fast
    assert "Tokenizer not kept for the next start" in caplog.text
    assert blocked.read_text() == "" and sorted(tmp_path.iterdir()) == sorted([blocked, model])
