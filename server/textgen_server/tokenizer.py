"""The shard's tokenizer: prompts to ids, ids to text, and the ids the engines read (special, EOS, pad).

transformers' `AutoTokenizer` builds it as TGI's shard does (the tokenizer config's added and special tokens, the
BOS/EOS post-processor, padding and truncation on the left). Importing transformers and building the tokenizer
cost about 2 s of a tiny Llama shard's start on a 2-core Zen 3 (benchmark/README.md, "Start-up and the test
suite"), for a result that depends only on the tokenizer's files and the libraries' versions. Where transformers'
tokenizer is a fast one whose class encodes and decodes exactly as its `tokenizers` backend does (`TokenizersBackend`
without an override of those methods: Llama, Qwen2, GPT-2, Gemma and most others), the shard serves
`FastTokenizer`, which calls the backend as transformers would; it is kept in one file per model under
TEXTGEN_CACHE_DIR (textgen_common/tokenizer_files.py: the file, and what it depends on), and a later start reads it
with `tokenizers` alone. Other tokenizers, vision-language models (their processors hold transformers' tokenizer)
and `--trust-remote-code` keep transformers' object.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import tokenizers

from textgen_common.cache_dir import kept_file
from textgen_common.tokenizer_files import read_kept, tokenizer_identity, write_kept

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from textgen_server.model_config import ModelConfig


# What transformers' fast tokenizer does beyond its backend in the methods the shard calls; a class overriding
# any of them keeps transformers' object.
_BACKEND_METHODS = (
    "__call__",
    "_call_one",
    "encode",
    "_encode_plus",
    "decode",
    "_decode",
    "batch_decode",
    "clean_up_tokenization",
    "__len__",
)

# What the kept file holds beside the backend (textgen_common/tokenizer_files.py).
_KEPT_FIELDS = ("all_special_ids", "eos_token_id", "pad_token_id", "model_max_length", "clean_up_spaces")

# transformers' `clean_up_tokenization` (WordPiece-era spacing before punctuation and contractions), in its order.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


@dataclass
class FastTokenizer:
    """A fast tokenizer as the shard uses it: each method gives what transformers' gives for the same tokenizer."""

    backend: tokenizers.Tokenizer
    all_special_ids: list[int]
    eos_token_id: int | None
    pad_token_id: int | None
    model_max_length: int
    # Whether decoding applies transformers' clean-up of tokenization spaces (never for a BPE model, as there).
    clean_up_spaces: bool

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._cleaned(text) if self.clean_up_spaces else text

    @staticmethod
    def _cleaned(text: str) -> str:
        for before, after in _CLEAN_UP:
            text = text.replace(before, after)
        return text

    def batch_decode(self, sequences: list[list[int]]) -> list[str]:
        """Each sequence decoded as `decode` does, in one call to the backend (top-n and prompt tokens: a step's
        work)."""
        texts: list[str] = self.backend.decode_batch(sequences, skip_special_tokens=False)
        return [self._cleaned(text) for text in texts] if self.clean_up_spaces else texts

    def __len__(self) -> int:
        """The vocabulary with its added tokens."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))


ShardTokenizer: TypeAlias = "FastTokenizer | PreTrainedTokenizerBase"


def load_tokenizer(model_dir: Path, config: ModelConfig, trust_remote_code: bool, keep: bool) -> ShardTokenizer:
    """The model's tokenizer, padding and truncating on the left, with a pad token in every case: a
    `FastTokenizer` from the file an earlier start kept, where `keep` and one was; else built (see above)."""
    if not keep or trust_remote_code:
        return _build(model_dir, config, trust_remote_code)
    path = _cache_file(model_dir)
    kept = read_kept(path, _from_kept) if path is not None else None
    if kept is not None:
        return kept
    built = _build(model_dir, config, trust_remote_code)
    fast = as_fast(built)
    if fast is None:
        return built
    if path is not None:
        fields = {name: getattr(fast, name) for name in _KEPT_FIELDS}
        write_kept(path, fast.backend, **fields)
    return fast


def as_fast(tokenizer: PreTrainedTokenizerBase) -> FastTokenizer | None:
    """`tokenizer` as a FastTokenizer; None where its class encodes or decodes otherwise than its backend."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not isinstance(tokenizer, TokenizersBackend):
        return None
    below = type(tokenizer).__mro__[: type(tokenizer).__mro__.index(TokenizersBackend)]
    if any(name in vars(cls) for cls in below for name in _BACKEND_METHODS):
        return None
    clean_up = bool(tokenizer.clean_up_tokenization_spaces) and (
        type(tokenizer.backend_tokenizer.model).__name__ != "BPE"
        or bool(getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    )
    # What transformers sets on the backend before each encoding of one text without padding or truncation.
    backend = tokenizer.backend_tokenizer
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = bool(tokenizer.split_special_tokens)
    return FastTokenizer(
        backend=backend,
        all_special_ids=list(tokenizer.all_special_ids),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        model_max_length=int(tokenizer.model_max_length),
        clean_up_spaces=clean_up,
    )


def _build(model_dir: Path, config: ModelConfig, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for the model, with TGI's pad fallback."""
    from transformers import AutoTokenizer, PretrainedConfig
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    from textgen_server.model_config import transformers_config

    # Given a config, AutoTokenizer does not load the family's config class (model_config.py). Where the shard reads
    # its own (KeptConfig), transformers' plain config stands in for it only if tokenizer_config.json names the
    # tokenizer's class: without one AutoTokenizer picks the class by the config's type, so it is left to load the
    # family's class itself.
    named = get_tokenizer_config(model_dir).get("tokenizer_class")  # what AutoTokenizer reads first
    given = transformers_config(config) if isinstance(config, PretrainedConfig) or named else None
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir,
        config=given,
        trust_remote_code=trust_remote_code,
        padding_side="left",
        truncation_side="left",
    )
    if tokenizer.pad_token_id is None:
        # TGI's fallback order: config pad, config eos, tokenizer eos, then a new [PAD] token.
        text_config = config.get_text_config()  # a VLM's ids are its text model's
        fallback = text_config.pad_token_id if text_config.pad_token_id is not None else text_config.eos_token_id
        if isinstance(fallback, list):
            fallback = fallback[0]
        if fallback is not None:
            tokenizer.pad_token_id = fallback
        elif tokenizer.eos_token_id is not None:
            tokenizer.pad_token_id = tokenizer.eos_token_id
        else:
            tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def _cache_file(model_dir: Path) -> Path | None:
    """The kept file for `model_dir`'s tokenizer files; its config.json is among them (the pad fallback reads it)."""
    with contextlib.suppress(OSError):  # an unreadable directory: AutoTokenizer names what is wrong
        return kept_file("shard-tokenizer", tokenizer_identity(model_dir, "padding left, truncation left"))
    return None


def _from_kept(backend: tokenizers.Tokenizer, fields: dict[str, Any]) -> FastTokenizer:
    return FastTokenizer(backend=backend, **{name: fields[name] for name in _KEPT_FIELDS})
