"""LoRA adapters on real shard processes, against peft + transformers `generate` on the same adapter files.

Two seeded random adapters (`build_test_adapter`) are loaded through LORA_ADAPTERS by one shard and by two
tensor-parallel ranks; every greedy token of each adapter, alone and in batches mixing both adapters and the
base model (through concatenation and filtering), must be the token peft's model chooses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import methodcaller
from pathlib import Path

import grpc
import pytest
import torch
from shard_helpers import make_batch, make_request

from testing.models import edited_copy
from testing.shards import ShardHandle, ShardProcess
from textgen_pb import generate_pb2
from textgen_server.builder import build_test_adapter

PROMPTS = ["def fill(self, text):", "import os\nclass", "The quick brown", "x = [i for i in"]
ADAPTER_SEEDS = {"one": 1, "two": 2}
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_test_adapter(root / name, tiny_llama, seed=seed) for name, seed in ADAPTER_SEEDS.items()}


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, adapters: dict[str, Path]) -> dict[tuple[str | None, str, int], list[int]]:
    """peft's greedy tokens for (adapter or None for the base model, prompt, max_new_tokens)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapters["one"], adapter_name="one")
    model.load_adapter(adapters["two"], adapter_name="two")
    model.eval()

    def greedy(text: str, max_new_tokens: int) -> list[int]:
        ids = tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids.input_ids.shape[1] :].tolist()

    result: dict[tuple[str | None, str, int], list[int]] = {}
    for n in (3, MAX_NEW_TOKENS):
        for text in PROMPTS:
            with model.disable_adapter():
                result[None, text, n] = greedy(text, n)
            for name in adapters:
                model.set_adapter(name)
                result[name, text, n] = greedy(text, n)
    return result


@pytest.fixture(scope="module", params=[1, 2], ids=["one-shard", "two-shards"])
def shards(request: pytest.FixtureRequest, tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[ShardHandle]:
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    with ShardProcess(tiny_llama, num_shard=request.param, env={"LORA_ADAPTERS": spec}) as handle:
        yield handle


def lora_request(
    request_id: int, text: str, adapter: str | None, max_new_tokens: int = MAX_NEW_TOKENS
) -> generate_pb2.Request:
    request = make_request(request_id, text, max_new_tokens, ignore_eos=False)
    if adapter is not None:
        request.adapter_id = adapter
    return request


class Ranks:
    """Every call to every rank at once, as the router's ShardedClient does; generations of all ranks merged."""

    def __init__(self, handle: ShardHandle, pool: ThreadPoolExecutor) -> None:
        self.stubs = [handle.stub(rank) for rank in range(len(handle.processes))]
        self.pool = pool
        self.tokens: dict[int, list[int]] = {}
        self.finished: set[int] = set()

    def call(self, method: str, message: object) -> object:
        replies = list(self.pool.map(methodcaller(method, message, timeout=60), self.stubs))
        for reply in replies:
            for g in getattr(reply, "generations", []):
                self.tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
                if g.HasField("generated_text"):
                    self.finished.add(g.request_id)
        return replies[-1]

    def prefill(self, batch_id: int, requests: list[generate_pb2.Request]) -> generate_pb2.CachedBatch | None:
        reply = self.call("Prefill", generate_pb2.PrefillRequest(batch=make_batch(batch_id, requests)))
        return reply.batch if reply.HasField("batch") else None  # type: ignore[attr-defined]

    def decode_to_end(self, batches: list[generate_pb2.CachedBatch]) -> None:
        """Decode (the first call concatenates `batches`), filtering out finished requests as the router does."""
        while batches:
            reply = self.call("Decode", generate_pb2.DecodeRequest(batches=batches))
            if not reply.HasField("batch"):  # type: ignore[attr-defined]
                return
            batch = reply.batch  # type: ignore[attr-defined]
            live = [i for i in batch.request_ids if i not in self.finished]
            if len(live) < len(batch.request_ids):
                filtered = self.call(
                    "FilterBatch", generate_pb2.FilterBatchRequest(batch_id=batch.id, request_ids=live)
                )
                batch = filtered.batch  # type: ignore[attr-defined]
            batches = [batch]


def run(handle: ShardHandle, requests: list[generate_pb2.Request]) -> dict[int, list[int]]:
    with ThreadPoolExecutor(len(handle.processes)) as pool:
        ranks = Ranks(handle, pool)
        batch = ranks.prefill(0, requests)
        ranks.decode_to_end([batch] if batch is not None else [])
        return ranks.tokens


def test_each_adapter_alone_equals_peft(shards: ShardHandle, expected: dict) -> None:
    for adapter in ("one", "two"):
        tokens = run(shards, [lora_request(i, text, adapter) for i, text in enumerate(PROMPTS)])
        assert tokens == {i: expected[adapter, text, MAX_NEW_TOKENS] for i, text in enumerate(PROMPTS)}
    assert expected["one", PROMPTS[0], MAX_NEW_TOKENS] != expected[None, PROMPTS[0], MAX_NEW_TOKENS]
    assert expected["one", PROMPTS[0], MAX_NEW_TOKENS] != expected["two", PROMPTS[0], MAX_NEW_TOKENS]


def test_a_batch_mixing_adapters_and_the_base_model_equals_peft(shards: ShardHandle, expected: dict) -> None:
    rows = [(text, adapter) for text in PROMPTS for adapter in (None, "one", "two")]
    tokens = run(shards, [lora_request(i, text, adapter) for i, (text, adapter) in enumerate(rows)])
    assert tokens == {i: expected[adapter, text, MAX_NEW_TOKENS] for i, (text, adapter) in enumerate(rows)}


def test_concatenated_and_filtered_rows_keep_their_adapter(shards: ShardHandle, expected: dict) -> None:
    # Short rows finish after 3 tokens, so the batch is filtered while the others go on.
    first = [(0, PROMPTS[0], "one", 3), (1, PROMPTS[1], None, MAX_NEW_TOKENS), (2, PROMPTS[2], "two", 3)]
    second = [(3, PROMPTS[3], "two", MAX_NEW_TOKENS), (4, PROMPTS[0], None, 3), (5, PROMPTS[1], "one", MAX_NEW_TOKENS)]
    with ThreadPoolExecutor(len(shards.processes)) as pool:
        ranks = Ranks(shards, pool)
        batches = [
            ranks.prefill(batch_id, [lora_request(i, text, adapter, n) for i, text, adapter, n in rows])
            for batch_id, rows in enumerate((first, second))
        ]
        ranks.decode_to_end([b for b in batches if b is not None])
    assert ranks.tokens == {i: expected[adapter, text, n] for i, text, adapter, n in first + second}


def test_an_adapter_the_shard_did_not_load_is_refused(shards: ShardHandle) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        run(shards, [lora_request(7, PROMPTS[0], "one"), lora_request(8, PROMPTS[0], "three")])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "request 8: adapter three is not loaded (loaded LoRA adapters: one, two)"


def test_adapters_that_do_not_fit_fail_at_startup_naming_them(
    tiny_llama: Path, tiny_gpt2: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    wrong_rank = edited_copy(adapters["one"], tmp_path / "wrong-rank", "adapter_config.json", lambda c: c.update(r=4))
    cases = [
        (
            tiny_llama,
            f"ok={adapters['two']},bad={wrong_rank}",
            "LoRA adapter bad: layer 0 q_proj has lora_A [8, 64] and lora_B [64, 8]; the model and r=4 need "
            "[4, 64] and [64, 4]",
        ),
        (tiny_llama, "gone=/nonexistent/adapter", "LoRA adapter gone: /nonexistent/adapter has no adapter_config.json"),
        (tiny_gpt2, f"one={adapters['one']}", "model type 'gpt2' is served by transformers, which applies no adapter"),
    ]
    for model_dir, spec, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            with ShardProcess(model_dir, env={"LORA_ADAPTERS": spec}, timeout=120):
                pass
