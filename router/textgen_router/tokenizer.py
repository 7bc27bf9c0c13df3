"""The router's tokenizer: the encoder validation runs and the special tokens chat templates read.

Built as TGI's router builds it: transformers' `AutoTokenizer` applies the model's tokenizer config (added and
special tokens, the BOS/EOS post-processor) and its fast tokenizer is then used as a `tokenizers.Tokenizer`. A
model without a fast tokenizer keeps transformers' slow one.

Importing transformers and building that tokenizer was most of a router's start (about 7 of its 8 s of CPU on
the tiny model; benchmark/README.md, "Start-up and the test suite"), for a result that depends only on the
model's tokenizer files and the libraries' versions. So the fast tokenizer (its JSON, as the validation worker
processes already receive it) and the special tokens are kept in one file per model under TEXTGEN_CACHE_DIR
(textgen_common/cache_dir.py; empty: nothing is kept), named after a hash of what changes them: the files beside
the tokenizer (name, size, modification time; weights excepted), the loading options, and the versions of
transformers and tokenizers. A later start reads that file with `tokenizers` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from textgen_common.cache_dir import cache_dir, kept_file
from textgen_common.tokenizer_files import read_kept, tokenizer_identity, write_kept

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Tokenizer:
    """The model's tokenizer as the router uses it."""

    # `tokenizers`' encoder of the fast tokenizer, or transformers' slow tokenizer for a model without one.
    encoder: tokenizers.Tokenizer | PreTrainedTokenizerBase
    # The named special tokens (bos_token, eos_token, ...) as transformers gives them to chat templates.
    special_tokens: dict[str, str]

    @property
    def is_fast(self) -> bool:
        return isinstance(self.encoder, tokenizers.Tokenizer)


def load_tokenizer(name: str | Path, revision: str | None = None, trust_remote_code: bool = False) -> Tokenizer:
    """The model's tokenizer (fast when the model ships one), from a local directory or the hub cache: from the
    cache file when an earlier start kept one for these files (see the module docstring)."""
    path = _cache_file(name, revision, trust_remote_code)
    cached = read_kept(path, _from_kept) if path is not None else None
    if cached is not None:
        return cached
    # Imported here: transformers (and torch under it) take seconds to import, which a cached tokenizer,
    # `print-schema` and argument errors need not pay.
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(name), revision=revision, trust_remote_code=trust_remote_code)
    special = {key: str(value) for key, value in loaded.special_tokens_map.items()}
    if not loaded.is_fast:
        return Tokenizer(loaded, special)
    encoder = loaded.backend_tokenizer
    # A hub model's files are in the hub cache only now, after the download.
    path = path or _cache_file(name, revision, trust_remote_code)
    if path is not None:
        write_kept(path, encoder, special_tokens=special)
    return Tokenizer(encoder, special)


def _from_kept(encoder: tokenizers.Tokenizer, fields: dict[str, Any]) -> Tokenizer:
    return Tokenizer(encoder, dict(fields["special_tokens"]))


def _model_dir(name: str | Path, revision: str | None) -> Path | None:
    """The directory of the model's tokenizer files: `name` itself, or its hub cache snapshot (None when the
    hub cache does not hold it)."""
    local = Path(name)
    if local.is_dir():
        return local
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(str(name), "tokenizer_config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def _cache_file(name: str | Path, revision: str | None, trust_remote_code: bool) -> Path | None:
    if cache_dir() is None:
        return None  # nothing is kept: the directory is not listed either
    directory = _model_dir(name, revision)
    if directory is None:
        return None
    options = f"revision {revision} trust_remote_code {trust_remote_code}"
    return kept_file("tokenizer", tokenizer_identity(directory, options))
