"""Real shard processes: 2 tensor-parallel ranks (gloo) serve exactly what 1 shard and transformers produce.

Each test drives `textgen-server serve ... --sharded` processes over their unix sockets the way the router
does: every call goes to every rank at once, and the generations of all ranks are concatenated.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from shard_helpers import HFOracle, chooser, generate_on_ranks, make_batch, make_request

from testing.models import edited_copy
from testing.shards import ShardHandle, ShardProcess
from textgen_pb import generate_pb2

PROMPTS = ["def fill(self, text):", "import os\nclass", "The quick brown"]
MAX_NEW_TOKENS = 8


def requests(sample: bool = False) -> list[generate_pb2.Request]:
    """One request per prompt; sampled ones get distinct seeds. EOS stops them, as it stops `generate`."""
    return [
        make_request(
            i,
            text,
            MAX_NEW_TOKENS,
            ignore_eos=False,
            params=chooser(do_sample=True, temperature=0.7, seed=100 + i) if sample else None,
        )
        for i, text in enumerate(PROMPTS)
    ]


@pytest.fixture(scope="module")
def one_shard(tiny_llama: Path) -> Iterator[ShardHandle]:
    with ShardProcess(tiny_llama) as handle:
        yield handle


@pytest.fixture(scope="module")
def two_shards(tiny_llama: Path) -> Iterator[ShardHandle]:
    with ShardProcess(tiny_llama, num_shard=2) as handle:
        yield handle


def test_two_shards_equal_one_shard_and_transformers(
    llama_oracle: HFOracle, one_shard: ShardHandle, two_shards: ShardHandle
) -> None:
    tokens_1, _ = generate_on_ranks(one_shard, requests())
    tokens_2, reported = generate_on_ranks(two_shards, requests())
    assert tokens_1 == {i: llama_oracle.greedy(text, MAX_NEW_TOKENS) for i, text in enumerate(PROMPTS)}
    assert tokens_2 == tokens_1
    # Each rank reports only its requests (the paged engine's rule: id % world_size == rank): nothing is
    # duplicated or lost.
    ids = range(len(PROMPTS))
    assert reported == [set(ids[0::2]), set(ids[1::2])]


def test_seeded_sampling_is_the_same_on_one_and_two_shards(one_shard: ShardHandle, two_shards: ShardHandle) -> None:
    sampled_1, _ = generate_on_ranks(one_shard, requests(sample=True))
    sampled_2, _ = generate_on_ranks(two_shards, requests(sample=True))
    assert sampled_1 == sampled_2
    greedy, _ = generate_on_ranks(one_shard, requests())
    assert sampled_1 != greedy  # the requests really sampled


def test_a_hung_rank_makes_the_other_exit_within_the_dist_timeout(tiny_llama: Path) -> None:
    timeout_s = 15
    with ShardProcess(tiny_llama, num_shard=2, env={"TEXTGEN_DIST_TIMEOUT": str(timeout_s)}) as handle:
        handle.processes[1].send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as failure:
                handle.stub(0).Prefill(
                    generate_pb2.PrefillRequest(batch=make_batch(0, requests()[:1])), timeout=timeout_s + 60
                )
            assert failure.value.code() == grpc.StatusCode.INTERNAL
            assert "Timed out" in failure.value.details()
            assert handle.processes[0].wait(timeout=30) != 0
            assert time.monotonic() - start < timeout_s + 30
        finally:
            handle.processes[1].kill()


def test_unshardable_models_fail_at_startup_with_a_clear_error(
    tiny_llama: Path, tiny_gpt2: Path, tmp_path: Path
) -> None:
    one_kv_head = edited_copy(
        tiny_llama, tmp_path / "one-kv-head", "config.json", lambda c: c.update(num_key_value_heads=1)
    )
    cases = {
        tiny_gpt2: "model type 'gpt2' has no tensor-parallel implementation (supported: llama, mistral, qwen2)",
        one_kv_head: "num_key_value_heads=1 is not divisible by the number of shards (2)",
    }
    for model_dir, message in cases.items():
        # The first rank to exit fails start-up with its log; the other rank is stopped with it.
        with pytest.raises(RuntimeError, match=re.escape(f"--sharded over 2 shards: {message}")):
            with ShardProcess(model_dir, num_shard=2, timeout=120):
                pass


def test_two_speculating_ranks_emit_what_one_plain_rank_emits(cycling_llama: Path) -> None:
    """--speculate 3 over 2 ranks: each rank guesses from the same history and confirms the same guesses, so the
    tokens (greedy and seeded) are one plain shard's, several per step."""
    with (
        ShardProcess(cycling_llama) as one,
        ShardProcess(cycling_llama, num_shard=2, extra_args=["--speculate", "3"]) as two,
    ):
        for sample in (False, True):
            wanted, _ = generate_on_ranks(one, requests(sample))
            got, reported = generate_on_ranks(two, requests(sample))
            assert got == wanted
            assert reported == [{0, 2}, {1}]
