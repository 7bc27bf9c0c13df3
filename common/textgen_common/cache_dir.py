"""TEXTGEN_CACHE_DIR: where shards and routers keep what they worked out at one start for the next ones (the
shard's CPU kernel timings, textgen_server/layers/measurements.py, resolved config, textgen_server/model_config.py,
and tokenizer, textgen_server/tokenizer.py; the router's tokenizer, textgen_router/tokenizer.py). Default
~/.cache/textgen; set empty, nothing is kept.

Processes that start at once (ranks, a router beside its shards) may write the same file: each file is written
whole or not at all (a temporary file beside it, then a rename), so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

ENV = "TEXTGEN_CACHE_DIR"


def cache_dir() -> Path | None:
    """The directory TEXTGEN_CACHE_DIR names now; None where it is set empty."""
    root = os.environ.get(ENV, str(Path.home() / ".cache" / "textgen"))
    return Path(root) if root else None


def kept_file(kind: str, identity: str) -> Path | None:
    """The file of `kind` kept for `identity` (everything that changes what it holds), `{kind}-{hash}.json` under
    the directory; None where TEXTGEN_CACHE_DIR is set empty."""
    root = cache_dir()
    if root is None:
        return None
    return root / f"{kind}-{hashlib.sha1(identity.encode()).hexdigest()[:16]}.json"


def write_whole(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all; raises OSError (the temporary file removed) when it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
