"""The paged engine in process: block tables, prefix-cache hits and chunked prefill against transformers.

The tests hand out blocks themselves, as the router's allocator does (low ids; the shard's own allocator,
used by requests without blocks, hands out high ones), so every request here is one a TGI router could send.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from shard_helpers import (
    HFOracle,
    check_decode_paths,
    check_top_n_distribution,
    check_uneven_batch,
    generate_all,
    make_batch,
    make_request,
    record,
)

from textgen_pb import generate_pb2 as pb
from textgen_server.config import ServeConfig
from textgen_server.layers import linear_choice
from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.loader import get_model
from textgen_server.models.kv_pool import POOL_TOKENS_ENV, SelfAllocator
from textgen_server.models.model import InvalidRequestError, InvalidRequestsError
from textgen_server.models.paged_batch import PagedBatch
from textgen_server.models.paged_lm import PagedCausalLM

POOL_TOKENS = 20_000
SHARED = "You are a careful assistant who answers in one short sentence. " * 4


def paged_model(model_dir: Path, **options: object) -> PagedCausalLM:
    """A paged model whose pool holds POOL_TOKENS (sized when first used, so under the variable)."""
    previous = os.environ.get(POOL_TOKENS_ENV)
    os.environ[POOL_TOKENS_ENV] = str(POOL_TOKENS)
    try:
        model = get_model(ServeConfig(str(model_dir), **options))  # type: ignore[arg-type]
        assert isinstance(model, PagedCausalLM)
        assert model.pool.tokens >= POOL_TOKENS
    finally:
        if previous is None:
            del os.environ[POOL_TOKENS_ENV]
        else:
            os.environ[POOL_TOKENS_ENV] = previous
    return model


@pytest.fixture(scope="module", params=["paged", "flashinfer", "flashdecoding"])
def model(request: pytest.FixtureRequest, tiny_llama: Path) -> PagedCausalLM:
    """Block sizes 16, 1 and 256 (TGI's for these ATTENTION backends); prompt logprobs on (REQUEST_LOGPROBS)."""
    return paged_model(tiny_llama, attention=request.param, request_logprobs=True)


class Blocks:
    """The router's side of the pool for these tests: fresh block ids from 1 up (block 0 is reserved)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next = 1

    def take(self, positions: int) -> list[int]:
        count = -(-positions // self.block_size)
        self.next += count
        return list(range(self.next - count, self.next))


def prompt_ids(model: PagedCausalLM, text: str) -> list[int]:
    return list(model.tokenizer(text)["input_ids"])


def with_blocks(request: pb.Request, blocks: list[int], cache_len: int = 0, chunk_len: int | None = None) -> pb.Request:
    request.blocks.extend(blocks)
    request.cache_len = cache_len
    if chunk_len is not None:
        request.chunk_len = chunk_len
    return request


@pytest.fixture
def chunk_budget(model: PagedCausalLM) -> Iterator[None]:
    """The step budget Warmup gives the shard (TGI's max_prefill_tokens), small so prompts take several chunks."""
    model.max_prefill_tokens = 16
    yield
    model.max_prefill_tokens = None


def test_uneven_batch_through_filter_and_concatenate_matches_transformers(
    model: PagedCausalLM, llama_oracle: HFOracle
) -> None:
    free = model.pool.allocator.free_blocks
    check_uneven_batch(model, llama_oracle)
    assert model.pool.allocator.free_blocks == free  # every self-allocated block came back


def test_top_n_tokens_come_from_the_processed_scores(model: PagedCausalLM, llama_oracle: HFOracle) -> None:
    """TGI's FlashCausalLM: the top-n logprobs are those of the distribution the token was chosen from."""
    check_top_n_distribution(model, llama_oracle, processed=True)


@pytest.mark.parametrize("cpu_ops", ["1", "0"])
def test_bfloat16_matches_transformers_eager(tiny_llama: Path, cpu_ops: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C++ ops (fused norm / RoPE / silu / K/V writes, paged decode attention) and without them (their
    torch code, as where no compiler builds them)."""
    monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", cpu_ops)
    model = paged_model(tiny_llama, dtype="bfloat16")
    layer = model.module.layers[0]
    on = cpu_ops == "1" and kernel_available()
    assert layer.self_attn.fused == layer.mlp.fused_silu == layer.input_layernorm.fused == on
    check_uneven_batch(model, HFOracle(tiny_llama, "bfloat16", "eager"))


@pytest.mark.parametrize("path", ["linear", "gemv"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_rows_through_the_blocks_and_the_straight_layer_path_give_the_module_path_s_bits(
    tiny_llama: Path, dtype: str, rows: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paged step of decode rows runs the C++ decode blocks (`DecoderLayer.decode` given `blocks`) where the C++
    ops build and every projection is one op they call, else `DecoderLayer.decode` (the fused ops called straight).
    The projections' path is forced (`F.linear`, or `gemv` where it serves and `F.linear` elsewhere): what the
    timing would choose depends on the CPU, and some paths are not ops the blocks call."""
    if not kernel_available():
        pytest.skip("the C++ ops do not build here: every step takes the modules' forward")
    monkeypatch.setenv(linear_choice.ENV, path)
    check_decode_paths(paged_model(tiny_llama, dtype=dtype), rows)


def test_a_prefix_hit_computes_only_the_postfix(model: PagedCausalLM, llama_oracle: HFOracle) -> None:
    blocks = Blocks(model.paging.block_size)
    # A shared prefix of at least one whole block.
    shared = SHARED * (blocks.block_size // len(prompt_ids(model, SHARED)) + 1)
    first, second, unrelated = shared + "What is a cat?", shared + "Name a red fruit.", "x = 1\n" * 30
    ids_1, ids_2 = prompt_ids(model, first), prompt_ids(model, second)
    common = next(i for i, (a, b) in enumerate(zip(ids_1, ids_2, strict=False)) if a != b)
    cache_len = common // blocks.block_size * blocks.block_size
    assert cache_len > 0
    blocks_1 = blocks.take(len(ids_1) + 6 - 1)
    batch = PagedBatch.from_pb(make_batch(1, [with_blocks(make_request(1, first, 6), blocks_1)]), model)
    assert generate_all(model, batch)[1] == llama_oracle.greedy(first, 6)

    # The second prompt reuses the first one's blocks of the shared prefix.
    reused = blocks_1[: cache_len // blocks.block_size]
    fresh = blocks.take(len(ids_2) + 6 - 1 - cache_len)
    request = with_blocks(make_request(2, second, 6), reused + fresh, cache_len)
    batch = PagedBatch.from_pb(make_batch(2, [request]), model)
    assert batch.to_pb().current_tokens == len(ids_2) - cache_len
    assert generate_all(model, batch)[2] == llama_oracle.greedy(second, 6)

    # Told that another prompt's blocks hold its prefix, the shard believes it: the pool is really read.
    blocks_3 = blocks.take(len(prompt_ids(model, unrelated)) + 6 - 1)
    generate_all(
        model, PagedBatch.from_pb(make_batch(3, [with_blocks(make_request(3, unrelated, 6), blocks_3)]), model)
    )
    wrong = with_blocks(make_request(4, second, 6), blocks_3[: len(reused)] + fresh, cache_len)
    assert generate_all(model, PagedBatch.from_pb(make_batch(4, [wrong]), model))[4] != llama_oracle.greedy(second, 6)


@pytest.mark.usefixtures("chunk_budget")
def test_chunked_prefill_joins_a_decoding_batch(model: PagedCausalLM, llama_oracle: HFOracle) -> None:
    blocks = Blocks(model.paging.block_size)
    short = ["def foo(x):", "x = 1"]
    running_requests = [
        with_blocks(make_request(i, text, 12), blocks.take(len(prompt_ids(model, text)) + 11))
        for i, text in enumerate(short)
    ]
    tokens: dict[int, list[int]] = {}
    generations, running, _ = model.generate_token(PagedBatch.from_pb(make_batch(1, running_requests), model))
    record(tokens, generations)
    assert running is not None and running.to_pb().current_tokens == 2

    # TGI's router: the new request's first chunk is the step budget less the running rows' tokens.
    long_text = SHARED + "Tell me about the sea."
    long_ids = prompt_ids(model, long_text)
    first_chunk = 16 - running.to_pb().current_tokens
    request = make_request(9, long_text, 5, prefill_logprobs=True)
    new = PagedBatch.from_pb(
        make_batch(2, [with_blocks(request, blocks.take(len(long_ids) + 4), chunk_len=first_chunk)]), model
    )
    batch: PagedBatch | None = PagedBatch.concatenate([running, new])
    prefill_steps = 0
    prefill_tokens: list[pb.Tokens] = []
    while batch is not None and 9 not in tokens:
        assert batch.to_pb().current_tokens <= 16  # every step within the budget
        generations, batch, _ = model.generate_token(batch)
        record(tokens, generations)
        prefill_tokens += [g.prefill_tokens for g in generations if g.HasField("prefill_tokens")]
        prefill_steps += 1
    assert prefill_steps >= len(long_ids) // 16  # the prompt really went in several chunks
    for request_id, ids in generate_all(model, batch).items():
        tokens[request_id].extend(ids)

    for i, text in enumerate(short):
        assert tokens[i] == llama_oracle.greedy(text, 12)
    assert tokens[9] == llama_oracle.greedy(long_text, 5)
    # The prompt's logprobs, gathered chunk by chunk, are transformers' (the first token has none).
    (prefill,) = prefill_tokens
    assert list(prefill.ids) == long_ids
    expected = llama_oracle.log_softmax(long_text)[:-1].gather(1, torch.tensor(long_ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(list(prefill.logprobs)[1:]), expected, atol=1e-4)


def test_a_row_still_prefilling_ahead_of_one_that_emits(model: PagedCausalLM, llama_oracle: HFOracle) -> None:
    """The step budget goes to the last rows first, so a later row can finish its prompt and emit while an earlier
    one is still prefilling: each emitting row takes its own logits."""
    blocks = Blocks(model.paging.block_size)
    long_text, short_text = SHARED + "Tell me about the sea.", "def foo(x):"
    long_ids = prompt_ids(model, long_text)
    requests = [
        with_blocks(make_request(0, long_text, 6), blocks.take(len(long_ids) + 5), chunk_len=8),
        with_blocks(make_request(1, short_text, 6), blocks.take(len(prompt_ids(model, short_text)) + 5)),
    ]
    batch: PagedBatch | None = PagedBatch.from_pb(make_batch(1, requests), model)
    tokens: dict[int, list[int]] = {}
    generations, batch, _ = model.generate_token(batch)
    record(tokens, generations)
    assert list(tokens) == [1]  # the first row is still prefilling, the second emitted
    for request_id, ids in generate_all(model, batch).items():
        tokens[request_id] = tokens.get(request_id, []) + ids
    assert tokens[0] == llama_oracle.greedy(long_text, 6)
    assert tokens[1] == llama_oracle.greedy(short_text, 6)


def test_rows_that_cannot_run_are_refused_by_id(model: PagedCausalLM) -> None:
    size = model.paging.block_size
    good = make_request(1, "x = 1", 4)
    too_few = with_blocks(make_request(2, "x = 1", 4 * size), [1])
    outside = with_blocks(make_request(3, "x = 1", 4), [*range(1, 20), model.pool.num_blocks])
    whole_prompt_cached = with_blocks(make_request(4, "x = 1", 4), list(range(1, 20)), cache_len=5)
    free = model.pool.allocator.free_blocks
    with pytest.raises(InvalidRequestsError) as refused:
        PagedBatch.from_pb(make_batch(1, [good, too_few, outside, whole_prompt_cached]), model)
    assert set(refused.value.reasons) == {2, 3, 4}
    assert "cannot hold" in refused.value.reasons[2] and "outside the KV cache" in refused.value.reasons[3]
    assert "leaves none" in refused.value.reasons[4]
    assert model.pool.allocator.free_blocks == free  # the valid row's own blocks were given back


def test_a_batch_larger_than_the_free_pool_is_refused_whole(model: PagedCausalLM) -> None:
    free = model.pool.allocator.free_blocks
    with pytest.raises(InvalidRequestError, match="Not enough KV cache"):
        PagedBatch.from_pb(make_batch(1, [make_request(1, "a", 8), make_request(2, "b", POOL_TOKENS * 2)]), model)
    assert model.pool.allocator.free_blocks == free


def test_self_allocator_reuses_returned_blocks_first() -> None:
    allocator = SelfAllocator(6)
    first = allocator.allocate(3)
    assert sorted(first) == [3, 4, 5] and allocator.free_blocks == 2
    allocator.free(first[:2])
    assert sorted(allocator.allocate(3)) == sorted([*first[:2], 2])
    with pytest.raises(RuntimeError):
        allocator.allocate(2)
    assert 0 not in first  # block 0 is reserved


def test_info_and_warmup_report_the_pool(tiny_llama: Path) -> None:
    model = paged_model(tiny_llama, attention="flashinfer", prefix_caching=True, prefill_chunking=False)
    info = model.info
    assert not info.requires_padding and info.block_size == 1 and info.attention_impl == "flashinfer"
    assert info.use_prefix_caching and not info.support_chunking
    warmup = PagedBatch.from_pb(make_batch(0, [make_request(0, "_test " * 20, 2)]), model)
    supported, max_input, max_total = model.warmup(warmup, None, None, 4096)
    # Without chunking TGI's default max_total is the warmup batch's tokens.
    assert supported == model.pool.tokens and max_total == warmup.total_tokens - 1 and max_input == max_total - 1
    assert model.pool.allocator.free_blocks == model.pool.num_blocks - 1


def test_prompt_logprobs_need_request_logprobs(tiny_llama: Path, llama_oracle: HFOracle) -> None:
    """TGI 3's flash models: without REQUEST_LOGPROBS a request asking for its prompt's logprobs gets none (the
    forward computes each row's last position only); the tokens are the same either way."""
    text = "def foo(x):"
    tokens: dict[bool, list[int]] = {}
    for on in (False, True):
        model = paged_model(tiny_llama, request_logprobs=on)
        request = make_request(1, text, 3, prefill_logprobs=True)
        generations, batch, _ = model.generate_token(PagedBatch.from_pb(make_batch(1, [request]), model))
        (generation,) = generations
        assert generation.HasField("prefill_tokens") == on
        if on:
            assert list(generation.prefill_tokens.ids) == prompt_ids(model, text)
        tokens[on] = [generation.tokens.ids[0], *generate_all(model, batch)[1]]
    assert tokens[False] == tokens[True] == llama_oracle.greedy(text, 3)


def test_prompt_logprobs_of_a_prefix_hit_are_nan_for_the_cached_tokens(
    model: PagedCausalLM, llama_oracle: HFOracle
) -> None:
    """TGI's router never looks a request asking for prompt logprobs up, but a client may send both."""
    blocks = Blocks(model.paging.block_size)
    text = SHARED * (blocks.block_size // len(prompt_ids(model, SHARED)) + 1) + "What is a cat?"
    ids = prompt_ids(model, text)
    first_blocks = blocks.take(len(ids) + 2 - 1)
    generate_all(model, PagedBatch.from_pb(make_batch(1, [with_blocks(make_request(1, text, 2), first_blocks)]), model))
    cache_len = (len(ids) - 1) // blocks.block_size * blocks.block_size
    request = with_blocks(make_request(2, text, 2, prefill_logprobs=True), first_blocks, cache_len)
    generations, _, _ = model.generate_token(PagedBatch.from_pb(make_batch(2, [request]), model))
    (prefill,) = [g.prefill_tokens for g in generations if g.HasField("prefill_tokens")]
    assert list(prefill.ids) == ids
    logprobs = torch.tensor(list(prefill.logprobs))
    assert bool(logprobs[: cache_len + 1].isnan().all()) and not bool(logprobs[cache_len + 1 :].isnan().any())
    expected = llama_oracle.log_softmax(text)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(logprobs[cache_len + 1 :], expected[cache_len:], atol=1e-4)
