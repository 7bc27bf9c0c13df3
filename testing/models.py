"""Tiny real test models (random weights, trained tokenizer), built once and cached on disk.

`build_model(arch, size)` returns the directory of a model made by `textgen_server.builder.build_test_model`,
cached under `~/.cache/textgen-test-models/<arch>-<size>-v<BUILDER_VERSION>-py<X.Y>-torch<V>` (override the
root with TEXTGEN_TEST_MODELS), so a second run costs nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MODEL_CACHE_ROOT = Path(os.environ.get("TEXTGEN_TEST_MODELS", Path.home() / ".cache" / "textgen-test-models"))


def build_model(arch: str, size: str = "tiny") -> Path:
    """Build (or reuse from the on-disk cache) a test model, keyed by everything that changes its bytes."""
    import torch

    from textgen_server import builder

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = f"{arch}-{size}-v{builder.BUILDER_VERSION}-py{py}-torch{torch.__version__.split('+')[0]}"
    # The builder reuses a matching build and writes through a temporary directory plus rename.
    return builder.build_test_model(MODEL_CACHE_ROOT / key, arch=arch, size=size)
