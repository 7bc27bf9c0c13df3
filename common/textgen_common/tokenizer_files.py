"""What a tokenizer loaded from a model directory depends on: the identity its kept copies are filed under in
TEXTGEN_CACHE_DIR (the router's, textgen_router/tokenizer.py, and the shard's, textgen_server/tokenizer.py)."""

from __future__ import annotations

import contextlib
import importlib.metadata
from pathlib import Path

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
