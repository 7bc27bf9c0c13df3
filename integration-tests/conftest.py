"""Integration fixtures: ONE real `textgen-launcher` for the whole session, and JSON snapshots.

- `llama_server`, `llama_client`, `llama_async_client` (session, from testing.fixtures): the tiny llama
  served by `textgen-launcher --enable-prefill-logprobs` (the snapshots hold prompt logprobs), and
  textgen_client clients on it; the client tests share the same process.
- `response_snapshot`: a syrupy JSON snapshot whose comparison is exact for everything but floats (logprobs),
  which match within a tolerance; pydantic models are dumped to JSON first.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import BaseModel
from syrupy.extensions.json import JSONSnapshotExtension

# Logprobs of the same tiny model differ in the last float32 bits between CPUs; texts must not differ.
LOGPROB_REL_TOL = 1e-2
LOGPROB_ABS_TOL = 1e-3


# Fields of OpenAI bodies that depend on the clock, the model's path on this machine or our version.
UNSTABLE_OPENAI_FIELDS = {"created": 0, "model": "<model>", "system_fingerprint": "<fingerprint>"}


def _plain(data: Any) -> Any:
    """Pydantic models (and lists of them) as plain JSON values, with machine-dependent fields pinned."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
        if "system_fingerprint" in data:
            data.update(UNSTABLE_OPENAI_FIELDS)
        return data
    if isinstance(data, (list, tuple)):
        return [_plain(item) for item in data]
    return data


def close_enough(actual: Any, expected: Any, path: str = "$") -> list[str]:
    """Differences between two JSON values: exact for all but floats, floats within the logprob tolerance."""
    if isinstance(actual, bool) or isinstance(expected, bool) or isinstance(actual, str) or actual is None:
        return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(actual, int) and isinstance(expected, int):
            return [] if actual == expected else [f"{path}: {actual} != {expected}"]
        ok = math.isclose(actual, expected, rel_tol=LOGPROB_REL_TOL, abs_tol=LOGPROB_ABS_TOL)
        return [] if ok else [f"{path}: {actual} !~ {expected}"]
    if isinstance(actual, dict) and isinstance(expected, dict):
        if actual.keys() != expected.keys():
            return [f"{path}: keys {sorted(actual)} != {sorted(expected)}"]
        return [d for k in actual for d in close_enough(actual[k], expected[k], f"{path}.{k}")]
    if isinstance(actual, list) and isinstance(expected, list):
        if len(actual) != len(expected):
            return [f"{path}: length {len(actual)} != {len(expected)}"]
        return [
            d for i, (a, e) in enumerate(zip(actual, expected, strict=True)) for d in close_enough(a, e, f"{path}[{i}]")
        ]
    return [f"{path}: {actual!r} != {expected!r}"]


class ResponseComparator(JSONSnapshotExtension):
    """JSON snapshots of responses; texts, ids and counts compared exactly, logprobs with a tolerance."""

    def serialize(self, data: Any, **kwargs: Any) -> str:
        return json.dumps(_plain(data), indent=2, ensure_ascii=False, sort_keys=True) + "\n"

    def matches(self, *, serialized_data: Any, snapshot_data: Any) -> bool:
        try:
            actual, expected = json.loads(serialized_data), json.loads(snapshot_data)
        except (TypeError, ValueError):
            return False
        return not close_enough(actual, expected)


@pytest.fixture
def response_snapshot(snapshot: Any) -> Any:
    return snapshot.use_extension(ResponseComparator)
