"""textgen::greedy_pick (token_ops.cpp) against torch: max's indices and log_softmax's bits at them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.sampling.greedy import greedy_pick_for

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not kernel_available():
        pytest.skip("no C++ compiler: the chooser keeps its torch code")


@pytest.fixture
def torch_s_path() -> None:
    """The op reproduces torch's sums only where torch takes the vector path the op was built for."""
    if torch.ops.textgen.greedy_pick_capability() != torch.backends.cpu.get_cpu_capability():
        pytest.skip("torch runs another vector path than the op's build (ATEN_CPU_CAPABILITY?)")


def torch_pick(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = scores.max(-1).indices
    return ids, scores.float().log_softmax(-1).gather(1, ids.unsqueeze(1)).squeeze(1)


# Widths below, at and past one vector of either lane width (8, 16), a partial last vector, vocabulary sizes.
@pytest.mark.parametrize("width", [1, 7, 8, 15, 16, 17, 50, 1000, 16000, 32001])
@pytest.mark.parametrize("scale", [1.0, 30.0, 200.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ids_and_logprobs_are_torch_s_bits(width: int, scale: float, dtype: torch.dtype, torch_s_path: None) -> None:
    # 67 rows: split over threads as a batch is
    scores = (torch.randn(67, width, generator=torch.Generator().manual_seed(width)) * scale).to(dtype)
    ids, logprobs = torch.ops.textgen.greedy_pick(scores)
    expected_ids, expected = torch_pick(scores)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(logprobs, expected)


def test_ties_nan_and_infinite_rows_as_torch(torch_s_path: None) -> None:
    rows = [[1.0, 3.0, 3.0, 0.0], [NAN, 1.0, NAN, 2.0], [1.0, NAN, 5.0, 5.0], [-INF] * 4, [INF, 1.0, INF, 2.0]]
    scores = torch.tensor(rows).repeat(1, 5)  # 20 columns: one whole vector or two, and a partial one
    ids, logprobs = torch.ops.textgen.greedy_pick(scores)
    expected_ids, expected = torch_pick(scores)
    assert ids.tolist() == expected_ids.tolist() == [1, 0, 1, 0, 0]
    # a NaN, or an infinite maximum (inf - inf), makes the whole log_softmax row NaN
    assert logprobs.isnan().tolist() == expected.isnan().tolist() == [False, True, True, True, True]
    assert torch.equal(logprobs[0], expected[0])


@pytest.mark.parametrize(
    "scores, message",
    [
        (torch.zeros(2, 4, dtype=torch.float16), "float32 or bfloat16"),
        (torch.zeros(8), "contiguous \\[B, V\\]"),
        (torch.zeros(4, 8).t(), "contiguous \\[B, V\\]"),
        (torch.zeros(2, 0), "V > 0"),
    ],
)
def test_bad_inputs_raise(scores: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.textgen.greedy_pick(scores)


def test_the_op_serves_only_where_torch_takes_the_same_vector_path() -> None:
    """torch picks its kernels' vector width at run time; ATEN_CPU_CAPABILITY=default makes it take its generic
    32-byte path, whose sums the op reproduces only when it was itself built without AVX2 (a process of its own:
    torch reads the variable once)."""
    same = torch.ops.textgen.greedy_pick_capability() == torch.backends.cpu.get_cpu_capability()
    assert greedy_pick_for(torch.float32, torch.device("cpu")) == same
    probe = (
        "import torch; from textgen_server.sampling.greedy import greedy_pick_for; "
        "used = greedy_pick_for(torch.float32, torch.device('cpu')); "
        "print(torch.backends.cpu.get_cpu_capability(), torch.ops.textgen.greedy_pick_capability(), used)"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    torch_path, op_path, used = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert torch_path == "DEFAULT"
    assert used == str(op_path == "DEFAULT")
