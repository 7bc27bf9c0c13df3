"""A fast tokenizer kept in TEXTGEN_CACHE_DIR for the next start (the router's, textgen_router/tokenizer.py, and the
shard's, textgen_server/tokenizer.py): the identity its file is named after, and the file itself (the `tokenizers`
backend's JSON, its encode_special_tokens flag, and what else its reader keeps)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import tokenizers

from textgen_common.cache_dir import write_whole

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Files that never change what the tokenizer is: left out of the identity, so that they are not stat'ed either.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


def tokenizer_identity(directory: Path, options: str) -> str:
    """The directory's resolved path, the loading `options`, the versions of transformers and tokenizers, and the
    files beside the tokenizer (name, size, modification time; weights excepted)."""
    key = [
        str(directory.resolve()),
        options,
        f"transformers {importlib.metadata.version('transformers')}",
        f"tokenizers {importlib.metadata.version('tokenizers')}",
    ]
    for entry in sorted(directory.iterdir()):
        if entry.name.endswith(WEIGHT_SUFFIXES):
            continue
        with contextlib.suppress(OSError):
            stat = entry.stat()
            key.append(f"{entry.name} {stat.st_size} {stat.st_mtime_ns}")
    return "\n".join(key)


def read_kept(path: Path, build: Callable[[tokenizers.Tokenizer, dict[str, Any]], T]) -> T | None:
    """What `build` makes of the kept backend and the file's other fields; None where the file is missing,
    unreadable or stale (the caller builds the tokenizer again)."""
    try:
        kept = json.loads(path.read_text())
        backend = tokenizers.Tokenizer.from_str(kept.pop("tokenizer"))
        backend.encode_special_tokens = bool(kept.pop("encode_special_tokens"))
        return build(backend, kept)
    except Exception:  # noqa: BLE001 - a missing, unreadable or stale file: built again
        return None


def write_kept(path: Path, backend: tokenizers.Tokenizer, **fields: Any) -> None:
    """Keep `backend` and `fields` for the next start; a failure to write costs only a later build."""
    kept = {
        "tokenizer": backend.to_str(),
        # transformers' split_special_tokens, which the JSON does not hold
        "encode_special_tokens": backend.encode_special_tokens,
        **fields,
    }
    try:
        write_whole(path, json.dumps(kept))
    except OSError as error:
        logger.warning("Tokenizer not kept for the next start (%s): %s", path, error)
