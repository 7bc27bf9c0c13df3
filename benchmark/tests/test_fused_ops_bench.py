"""fused_ops.py (run as conftest.py runs the scripts): every op of both dtypes is timed both ways, and the softmax
comparison runs."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from textgen_server.layers.cpu_ops import kernel_available


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not kernel_available():
        pytest.skip("no C++ compiler: the script has no ops to time")


def test_layer_ops_are_timed_fused_and_by_torch(run_script: Callable[..., str]) -> None:
    out = run_script("fused_ops", "--rows", "3", "--runs", "1", "--threads", "1")
    rows = re.findall(r"^\| (float32|bfloat16) \| 3 \| (.+?) \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", out, re.MULTILINE)
    assert len(rows) == 8, out
    assert {name for _, name in rows} == {"add + norm", "rotary", "silu * up", "K/V write"}


def test_softmax_is_timed_on_narrow_and_wide_scores(run_script: Callable[..., str]) -> None:
    out = run_script("fused_ops", "--denormals", "--keys", "16", "--runs", "1", "--threads", "1")
    assert re.search(r"^\| standard normal \| [0-9.]+ \| [0-9.]+ \|$", out, re.MULTILINE), out
    assert re.search(r"^\| x 45 \| [0-9.]+ \| [0-9.]+ \|$", out, re.MULTILINE), out
