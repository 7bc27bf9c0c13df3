"""The shard's tokenizer (textgen_server/tokenizer.py): transformers' fast tokenizer served as a `FastTokenizer`
that encodes, decodes and names its special ids as transformers' does, kept under TEXTGEN_CACHE_DIR so that a
later start reads it with `tokenizers` alone; every other tokenizer stays transformers' object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from testing.models import edited_copy
from textgen_server.model_config import load_config
from textgen_server.tokenizer import FastTokenizer, as_fast, load_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, and a comma . Then ' quotes ' isn't it ?",
    "héllo wörld 🙂 — ünïcode\ttabs\nnewlines",
    "<s> special </s> tokens <|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture
def kept_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A TEXTGEN_CACHE_DIR of the test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TEXTGEN_CACHE_DIR", str(root))
    return root


def shard_tokenizer(model_dir: Path, keep: bool = True, trust_remote_code: bool = False) -> object:
    return load_tokenizer(model_dir, load_config(model_dir, trust_remote_code), trust_remote_code, keep)


def reference(model_dir: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer as TGI's shard builds it, with the pad fallback where the model has no pad token."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def assert_same(fast: object, ref: PreTrainedTokenizerBase) -> None:
    assert isinstance(fast, FastTokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert (
                fast(text, add_special_tokens=special)["input_ids"]
                == ref(text, add_special_tokens=special)["input_ids"]
            )
    ids = ref(" ".join(TEXTS))["input_ids"]
    spans = [ids, ids[3:11], [*ref.all_special_ids, *ids[:5]], list(range(len(ref)))]
    for span in spans:
        for skip in (True, False):
            assert fast.decode(span, skip_special_tokens=skip) == ref.decode(span, skip_special_tokens=skip)
    singles = [[i] for i in range(len(ref))]
    assert fast.batch_decode(singles) == ref.batch_decode(singles)
    assert len(fast) == len(ref)
    assert fast.all_special_ids == ref.all_special_ids
    assert (fast.eos_token_id, fast.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
    assert fast.model_max_length == ref.model_max_length


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral", "qwen2"])
def test_built_and_kept_the_tokenizer_works_as_transformers_does(
    arch: str, request: pytest.FixtureRequest, kept_in: Path
) -> None:
    model_dir = request.getfixturevalue(f"tiny_{arch}")
    built = shard_tokenizer(model_dir)
    (kept,) = kept_in.glob("shard-tokenizer-*.json")
    again = shard_tokenizer(model_dir)  # read from the kept file
    ref = reference(model_dir)
    for tokenizer in (built, again):
        assert_same(tokenizer, ref)


def word_level_model(tiny_llama: Path, at: Path, clean_up: bool) -> Path:
    """The tiny Llama's config with a word-level tokenizer (not BPE: transformers' clean-up of tokenization spaces
    applies to its decoding when `clean_up`)."""
    words = ["<unk>", "<s>", "</s>", "hello", "world", ".", ",", "?", "'", "s", "isn't", "n't", "it"]
    backend = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=clean_up,
    )
    at.mkdir()
    tokenizer.save_pretrained(at)
    (at / "config.json").write_text((tiny_llama / "config.json").read_text())
    return at


@pytest.mark.parametrize("clean_up", [True, False])
def test_decoding_cleans_up_spaces_where_transformers_does(
    clean_up: bool, tiny_llama: Path, kept_in: Path, tmp_path: Path
) -> None:
    model_dir = word_level_model(tiny_llama, tmp_path / "words", clean_up)
    ref = reference(model_dir)
    text = "hello , world . it isn't ? it ' s"
    assert ("hello, world." in ref.decode(ref(text)["input_ids"])) is clean_up  # the case is the one meant
    for tokenizer in (shard_tokenizer(model_dir), shard_tokenizer(model_dir)):
        assert_same(tokenizer, ref)


def test_a_bpe_model_keeps_its_spaces_as_in_transformers(tiny_llama: Path, kept_in: Path, tmp_path: Path) -> None:
    model_dir = edited_copy(
        tiny_llama, tmp_path / "clean", "tokenizer_config.json", lambda t: t.update(clean_up_tokenization_spaces=True)
    )
    fast = shard_tokenizer(model_dir)
    assert isinstance(fast, FastTokenizer) and not fast.clean_up_spaces
    assert_same(fast, reference(model_dir))


def test_a_changed_or_unreadable_kept_file_is_built_again(tiny_llama: Path, kept_in: Path, tmp_path: Path) -> None:
    model_dir = edited_copy(tiny_llama, tmp_path / "model", "tokenizer_config.json", lambda t: None)
    shard_tokenizer(model_dir)
    (kept,) = kept_in.glob("shard-tokenizer-*.json")
    kept.write_text('{"tokenizer": "not a tokenizer"')
    assert_same(shard_tokenizer(model_dir), reference(model_dir))
    # Another EOS in tokenizer_config.json: another file, and the new EOS.
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<|im_end|>"}))
    changed = shard_tokenizer(model_dir)
    assert len(list(kept_in.glob("shard-tokenizer-*.json"))) == 2
    assert isinstance(changed, FastTokenizer) and changed.eos_token_id == reference(model_dir).eos_token_id
    assert changed.eos_token_id != reference(tiny_llama).eos_token_id


def test_nothing_is_kept_where_the_cache_is_off_and_the_tokenizer_is_still_the_same(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEXTGEN_CACHE_DIR", "")
    assert_same(shard_tokenizer(tiny_llama), reference(tiny_llama))


def test_remote_code_and_vlms_keep_transformers_tokenizer(tiny_llama: Path, kept_in: Path) -> None:
    for tokenizer in (shard_tokenizer(tiny_llama, trust_remote_code=True), shard_tokenizer(tiny_llama, keep=False)):
        assert isinstance(tokenizer, PreTrainedTokenizerBase)
    assert not list(kept_in.glob("shard-tokenizer-*.json"))


def test_a_class_that_encodes_or_decodes_otherwise_is_not_served_from_its_backend(tiny_llama: Path) -> None:
    class SpellsOut(PreTrainedTokenizerFast):
        def decode(self, token_ids: object, skip_special_tokens: bool = False, **kwargs: object) -> str:
            return "spelled out"

    class Plain(PreTrainedTokenizerFast):
        pass

    assert as_fast(SpellsOut.from_pretrained(tiny_llama)) is None
    assert isinstance(as_fast(Plain.from_pretrained(tiny_llama)), FastTokenizer)
