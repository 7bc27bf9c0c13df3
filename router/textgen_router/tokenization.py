"""The tokenizer work of validation and /tokenize, as functions a worker thread or a worker process runs.

Each function takes the tokenizer first: `tokenizers.Tokenizer` (the fast tokenizer's own encoder) or, for a
model without one, transformers' slow tokenizer. A worker process (validation.Validator's pool) rebuilds the
fast tokenizer once from its JSON (`init_worker`), and `in_process(fn, ...)` calls `fn` with it.

Why processes: `tokenizers`' `Tokenizer.encode` holds the GIL for the whole encoding, and turning a long
encoding into Python lists and a /tokenize body is Python work too. Measured on the tiny test model
(`benchmark/README.md`, "Big inputs"): for a 1.6 MB prompt (1M tokens) encode 2.0 s, ids and offsets 0.29 s,
the /tokenize body 3.7 s; in a thread of the router all of it stalled the event loop, and the lists stayed in
the router's heap. A worker process returns only what the router needs: a token count, the ids of a prompt
that fits, or the /tokenize body as bytes.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import tokenizers

from textgen_router import jsonenc

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


@dataclass
class Encoding:
    """Token ids of an input, with each token's character span in that input."""

    ids: list[int]
    offsets: list[tuple[int, int]]


def encode(
    tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase,
    inputs: str,
    add_special_tokens: bool,
    truncate: int | None,
) -> Encoding:
    """The tokens of `inputs`; `truncate` keeps the last ones (the text next to what will be generated)."""
    if isinstance(tokenizer, tokenizers.Tokenizer):
        # The `tokenizers` encoder itself, as TGI calls it: transformers' __call__ goes through encode_batch
        # and converts the result, which costs more per prompt (benchmark/README.md, "Router figures").
        enc = tokenizer.encode(inputs, add_special_tokens=add_special_tokens)
        ids, offsets = enc.ids, enc.offsets
    else:
        ids = list(tokenizer(inputs, add_special_tokens=add_special_tokens)["input_ids"])
        offsets = [(0, 0)] * len(ids)
    if truncate is not None and truncate < len(ids):
        ids, offsets = ids[len(ids) - truncate :], offsets[len(ids) - truncate :]
    return Encoding(ids, offsets)


def input_ids(
    tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase,
    inputs: str,
    add_special_tokens: bool,
    truncate: int | None,
    max_length: int,
) -> tuple[int, list[int]]:
    """The token count of `inputs` and, when it is at most `max_length`, its ids (a prompt too long to run
    needs only its count for the error message)."""
    ids = encode(tokenizer, inputs, add_special_tokens, truncate).ids
    return len(ids), ids if len(ids) <= max_length else []


def token_list(
    tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase, inputs: str, add_special_tokens: bool
) -> bytes:
    """The JSON array of /tokenize and /chat_tokenize: `[{"id", "text", "start", "stop"}, ...]`.

    `start`/`stop` are UTF-8 byte offsets into `inputs`, as TGI's Rust tokenizer reports them (the Python
    binding gives character offsets); `text` is the input those bytes hold. Like TGI's, the list is never
    truncated: the request's `truncate` applies to generation only."""
    enc = encode(tokenizer, inputs, add_special_tokens, None)
    data = inputs.encode()
    spans = enc.offsets
    if len(data) != len(inputs):
        # Byte position of each character, and of the end: the bytes that do not continue a UTF-8 sequence.
        starts = np.flatnonzero((np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80).tolist() + [len(data)]
        spans = [(starts[start], starts[stop]) for start, stop in spans]
    tokens = [
        {"id": i, "text": data[start:stop].decode(), "start": start, "stop": stop}
        for i, (start, stop) in zip(enc.ids, spans, strict=True)
    ]
    return jsonenc.dumps(tokens)


_WORKER_TOKENIZER: tokenizers.Tokenizer | None = None
# glibc keeps what a long input's lists freed in its heap (a worker stayed at ~300 MiB after one 1.9 MB prompt,
# against ~80 MiB idle); malloc_trim gives it back. Absent from other C libraries, where nothing is trimmed.
_MALLOC_TRIM: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)


# A worker's niceness: a long input's tokenization is bulk work that may take seconds of a core, while the
# router's event loop and the shards' steps serve every other request; on a machine with as many busy workers
# as cores, the scheduler then runs those first.
WORKER_NICENESS = 10


def init_worker(tokenizer_json: str, encode_special_tokens: bool) -> None:
    """Initializer of a worker process: the router's tokenizer, rebuilt from `Tokenizer.to_str()` and its
    `encode_special_tokens` (which the JSON does not hold), and a lower CPU priority (WORKER_NICENESS)."""
    global _WORKER_TOKENIZER
    os.nice(WORKER_NICENESS)
    _WORKER_TOKENIZER = tokenizers.Tokenizer.from_str(tokenizer_json)
    _WORKER_TOKENIZER.encode_special_tokens = encode_special_tokens


def in_process(fn: Callable[..., T], *args: Any) -> T:
    """`fn(tokenizer, *args)` in a worker process started with `init_worker`."""
    assert _WORKER_TOKENIZER is not None, "init_worker did not run in this process"
    try:
        return fn(_WORKER_TOKENIZER, *args)
    finally:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
