"""CausalLM and CausalLMBatch in process: the batch state through prefill, filter and concatenate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from shard_helpers import (
    HFOracle,
    check_top_n_distribution,
    check_uneven_batch,
    generate_all,
    make_batch,
    make_request,
    record,
)

from textgen_pb import generate_pb2 as pb
from textgen_server.config import ServeConfig
from textgen_server.layers.cpu_ops import kernel_available
from textgen_server.loader import get_model
from textgen_server.models.causal_lm import CausalLM, CausalLMBatch

PROMPTS = ["def foo(x):", "class", "for i in range(10):\n    print(i)", "x = 1"]


@pytest.fixture(scope="module")
def gpt2(tiny_gpt2: Path) -> CausalLM:
    model = get_model(ServeConfig(str(tiny_gpt2)))
    assert isinstance(model, CausalLM)
    return model


@pytest.fixture(scope="module")
def gpt2_oracle(tiny_gpt2: Path) -> HFOracle:
    return HFOracle(tiny_gpt2)


def test_info_reports_tgi_block_size(gpt2: CausalLM) -> None:
    # TGI's v3 router rounds its budgets by Info.block_size whatever the engine (a 0 divides by zero there).
    info = gpt2.info
    assert info.requires_padding and info.block_size == 16 and not info.use_prefix_caching


def test_from_pb_pads_left_and_reserves_right(gpt2: CausalLM) -> None:
    batch = CausalLMBatch.from_pb(make_batch(1, [make_request(0, PROMPTS[0], 3), make_request(1, "class", 7)]), gpt2)
    long, short = batch.input_lengths
    assert batch.max_input_length == long > short
    assert batch.padding_right_offset == 7
    assert batch.attention_mask.shape == (2, long + 7)
    assert batch.attention_mask[1, : long - short].sum() == 0 and batch.attention_mask[1, long - short : long].all()
    assert batch.attention_mask[:, long:].sum() == 0
    assert batch.max_tokens == 2 * long + 3 + 7
    cached = batch.to_pb()
    assert (cached.id, list(cached.request_ids), cached.size, cached.current_tokens) == (1, [0, 1], 2, 2)


def test_gpt2_greedy_through_filter_and_concatenate_matches_transformers(gpt2: CausalLM, gpt2_oracle: HFOracle) -> None:
    first = CausalLMBatch.from_pb(make_batch(1, [make_request(i, PROMPTS[i], 5 + i) for i in range(3)]), gpt2)
    tokens: dict[int, list[int]] = {}
    batch: CausalLMBatch | None = first
    for _ in range(2):
        generations, batch, _ = gpt2.generate_token(batch)  # type: ignore[arg-type]
        record(tokens, generations)
    assert batch is not None
    batch = batch.filter([0, 2])
    kv = batch.past_key_values.layers[0].keys  # type: ignore[union-attr]
    assert kv.shape[0] == 2 and kv.shape[2] == batch.max_input_length - 1
    assert batch.attention_mask.shape[1] == batch.max_input_length + batch.padding_right_offset

    late = CausalLMBatch.from_pb(make_batch(2, [make_request(3, PROMPTS[3], 6)]), gpt2)
    generations, late_next, _ = gpt2.generate_token(late)
    tokens[3] = [g.tokens.ids[0] for g in generations]
    merged = CausalLMBatch.concatenate([batch, late_next])  # type: ignore[list-item]
    assert merged.batch_id == 1 and sorted(r.id for r in merged.requests) == [0, 2, 3]  # row order: the batch's
    for request_id, ids in generate_all(gpt2, merged).items():
        tokens[request_id].extend(ids)

    for i, n in ((0, 5), (2, 7), (3, 6)):
        assert tokens[i] == gpt2_oracle.greedy(PROMPTS[i], n), f"request {i}"
    assert len(tokens[1]) == 2


def test_eos_token_finishes_with_eos_reason(gpt2: CausalLM, gpt2_oracle: HFOracle) -> None:
    expected = gpt2_oracle.greedy(PROMPTS[1], 6)
    eos = expected[2]
    saved = gpt2.config
    # the random model never picks the real EOS: pretend its 3rd token is one
    gpt2.config = dataclasses.replace(saved, eos_token_ids=frozenset({eos}))
    try:
        batch = CausalLMBatch.from_pb(
            make_batch(
                1, [make_request(0, PROMPTS[1], 6, ignore_eos=False), make_request(1, PROMPTS[1], 6, ignore_eos=True)]
            ),
            gpt2,
        )
        finished: dict[int, pb.GeneratedText] = {}
        current: CausalLMBatch | None = batch
        while current is not None:
            generations, current, _ = gpt2.generate_token(current)
            finished.update({g.request_id: g.generated_text for g in generations if g.HasField("generated_text")})
            if current is not None and finished:
                live = [r.id for r in current.requests if r.id not in finished]
                current = current.filter(live) if live else None
    finally:
        gpt2.config = saved
    assert finished[0].finish_reason == pb.FINISH_REASON_EOS_TOKEN and finished[0].generated_tokens == 3
    assert finished[1].finish_reason == pb.FINISH_REASON_LENGTH and finished[1].generated_tokens == 6


def test_decode_token_holds_back_a_character_split_across_tokens(gpt2: CausalLM) -> None:
    text = "naïve 世界 ok"
    ids = gpt2.tokenizer(text)["input_ids"]
    pieces = [gpt2.tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the byte-level tokenizer must split a character here"
    prefix, read, out = 0, 0, ""
    emitted = []
    for n in range(1, len(ids) + 1):
        piece, prefix, read = gpt2.decode_token(ids[:n], prefix, read)
        emitted.append(piece)
        out += piece
    assert out == text
    assert "" in emitted and not any("\ufffd" in p for p in emitted)


def test_concatenate_keeps_each_rows_kv_right_aligned(gpt2: CausalLM) -> None:
    a = CausalLMBatch.from_pb(make_batch(1, [make_request(0, PROMPTS[2], 4)]), gpt2)
    b = CausalLMBatch.from_pb(make_batch(2, [make_request(1, "x", 4)]), gpt2)
    _, a, _ = gpt2.generate_token(a)
    _, b, _ = gpt2.generate_token(b)
    assert a is not None and b is not None
    a_keys = a.past_key_values.layers[0].keys.clone()  # type: ignore[union-attr]
    b_keys = b.past_key_values.layers[0].keys.clone()  # type: ignore[union-attr]
    merged = CausalLMBatch.concatenate([a, b])
    keys = merged.past_key_values.layers[0].keys  # type: ignore[union-attr]
    width = merged.max_input_length - 1
    assert keys.shape[2] == width
    assert torch.equal(keys[0], a_keys[0])
    assert torch.equal(keys[1, :, width - b_keys.shape[2] :], b_keys[0])
    assert keys[1, :, : width - b_keys.shape[2]].abs().sum() == 0
    live = merged.attention_mask[:, : merged.max_input_length]
    assert live.sum(1).tolist() == merged.input_lengths


def test_llama_rows_are_ordered_longest_prompt_first(tiny_llama: Path) -> None:
    model = get_model(ServeConfig(str(tiny_llama), use_flash_attention=False))  # the padded engine
    assert isinstance(model, CausalLM)
    requests = [make_request(i, " ".join(["word"] * (1 + 3 * i)), 4) for i in range(5)]
    lengths = CausalLMBatch.from_pb(make_batch(1, requests), model).input_lengths
    assert lengths == sorted(lengths, reverse=True)  # longest first: the attention groups rely on it


def test_llama_uneven_batch_matches_transformers(tiny_llama: Path, llama_oracle: HFOracle) -> None:
    model = get_model(ServeConfig(str(tiny_llama), use_flash_attention=False))  # the padded engine
    assert isinstance(model, CausalLM)
    check_uneven_batch(model, llama_oracle)


def test_top_n_tokens_come_from_the_raw_logits(tiny_llama: Path, llama_oracle: HFOracle) -> None:
    """TGI's CausalLM reports the top-n tokens of the logits, whatever penalties and warpers did to the choice."""
    model = get_model(ServeConfig(str(tiny_llama), use_flash_attention=False))  # the padded engine
    assert isinstance(model, CausalLM)
    check_top_n_distribution(model, llama_oracle, processed=False)


@pytest.mark.parametrize("decode_kernel", ["1", "0"])
def test_bfloat16_llama_uneven_batch_matches_transformers_eager(
    tiny_llama: Path, decode_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bf16 on a CPU: matmul attention; decode steps with the decode attention op over each row's live keys, or
    # (switched off, or where it cannot be built) the matmul over whole KV buffers (PaddedKVCache.whole_decode).
    monkeypatch.setenv("TEXTGEN_CPU_DECODE_KERNEL", decode_kernel)
    model = get_model(ServeConfig(str(tiny_llama), dtype="bfloat16", use_flash_attention=False))
    assert isinstance(model, CausalLM)
    assert model.module.decode_kernel == (decode_kernel == "1" and kernel_available())
    check_uneven_batch(model, HFOracle(tiny_llama, "bfloat16", "eager"))
