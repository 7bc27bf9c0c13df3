"""Native routes through a real launcher on the tiny llama: generate, stream, details, best_of, stop, top_n."""

from __future__ import annotations

from typing import Any

import pytest

from testing.launcher import LauncherProcess
from textgen_client import Client
from textgen_client.types import FinishReason, Response

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def greedy(llama_client: Client) -> Response:
    return llama_client.generate(PROMPT, max_new_tokens=10, decoder_input_details=True)


def test_generate(greedy: Response, response_snapshot: Any) -> None:
    assert greedy.details is not None
    assert greedy.details.generated_tokens == len(greedy.details.tokens)
    assert greedy.details.prefill[0].logprob is None
    assert greedy == response_snapshot


def test_generate_equals_transformers(greedy: Response, llama_server: LauncherProcess) -> None:
    """The oracle: greedy tokens through launcher, router and shard equal transformers' generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_server.model_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_server.model_dir, dtype=torch.float32)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert greedy.details is not None
    assert [t.id for t in greedy.details.tokens] == expected
    assert [t.id for t in greedy.details.prefill] == inputs["input_ids"][0].tolist()


def test_generate_stream(llama_client: Client, greedy: Response, response_snapshot: Any) -> None:
    events = list(llama_client.generate_stream(PROMPT, max_new_tokens=10))
    assert [e.token.id for e in events] == [t.id for t in greedy.details.tokens]  # type: ignore[union-attr]
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == greedy.generated_text
    assert events[-1].details is not None and events[-1].details.finish_reason == greedy.details.finish_reason  # type: ignore[union-attr]
    assert events == response_snapshot


def test_generate_all_params(llama_client: Client, response_snapshot: Any) -> None:
    """Seeded sampling with every warper and penalty; truncation keeps the prompt's last 5 tokens."""
    response = llama_client.generate(
        PROMPT,
        max_new_tokens=10,
        do_sample=True,
        seed=0,
        temperature=0.5,
        top_k=10,
        top_p=0.9,
        typical_p=0.9,
        repetition_penalty=1.2,
        frequency_penalty=0.1,
        truncate=5,
        return_full_text=True,
        watermark=True,
        decoder_input_details=True,
    )
    assert response.details is not None
    assert response.details.seed == 0
    assert len(response.details.prefill) == 5
    assert response.generated_text.startswith(PROMPT)
    assert response == response_snapshot


def test_best_of(llama_client: Client, greedy: Response, response_snapshot: Any) -> None:
    """best_of needs sampling; top_k=1 makes every sequence the greedy one, whatever its random seed."""
    response = llama_client.generate(PROMPT, max_new_tokens=10, best_of=2, do_sample=True, top_k=1)
    assert response.details is not None and response.details.best_of_sequences is not None
    assert len(response.details.best_of_sequences) == 1
    assert response.generated_text == greedy.generated_text
    assert response.details.best_of_sequences[0].generated_text == greedy.generated_text
    # Seeds are drawn at random for best_of: not part of the snapshot.
    response.details.seed = None
    response.details.best_of_sequences[0].seed = None
    assert response == response_snapshot


def test_stop_sequence(llama_client: Client, greedy: Response, response_snapshot: Any) -> None:
    """A stop sequence cut from the greedy output ends generation as soon as the output contains it."""
    assert greedy.details is not None
    tokens = greedy.details.tokens
    stop = tokens[2].text + tokens[3].text
    response = llama_client.generate(PROMPT, max_new_tokens=10, stop_sequences=[stop])
    assert response.details is not None
    assert response.details.finish_reason == FinishReason.StopSequence
    assert response.details.generated_tokens <= 4
    assert stop in response.generated_text
    assert greedy.generated_text.startswith(response.generated_text)
    assert response == response_snapshot


def test_top_n_tokens(llama_client: Client, greedy: Response, response_snapshot: Any) -> None:
    response = llama_client.generate(PROMPT, max_new_tokens=5, top_n_tokens=3)
    assert response.details is not None and response.details.top_tokens is not None
    assert [len(step) for step in response.details.top_tokens] == [3] * 5
    for token, top in zip(response.details.tokens, response.details.top_tokens, strict=True):
        # Greedy picks the most likely token, which leads its step's top list.
        assert top[0].id == token.id
    assert [t.id for t in response.details.tokens] == [t.id for t in greedy.details.tokens[:5]]  # type: ignore[union-attr]
    assert response == response_snapshot
