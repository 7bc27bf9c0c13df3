"""OpenAI-compatible routes through a real launcher on the tiny llama: chat and completions, plain and streamed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from testing.launcher import LauncherProcess
from textgen_client import Client
from textgen_client.types import ChatComplete, Completion

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
PROMPTS = ["import os", "class Point:", "for i in range(10):"]


@pytest.fixture(scope="module")
def chat(llama_client: Client) -> ChatComplete:
    response = llama_client.chat(MESSAGES, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2)
    assert isinstance(response, ChatComplete)
    return response


def test_chat(chat: ChatComplete, llama_server: LauncherProcess, response_snapshot: Any) -> None:
    choice = chat.choices[0]
    assert chat.object == "chat.completion"
    assert chat.model == str(llama_server.model_dir)
    assert choice.message.role == "assistant"
    assert choice.logprobs is not None
    assert len(choice.logprobs.content) == chat.usage.completion_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert chat == response_snapshot


def test_chat_equals_transformers_on_templated_prompt(chat: ChatComplete, llama_server: LauncherProcess) -> None:
    """Chat = the chat template (as /chat_tokenize renders it), then greedy generation from those ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenized = httpx.post(f"{llama_server.base_url}/chat_tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert tokenized["templated_text"].endswith("<|im_start|>assistant\n")
    ids = [t["id"] for t in tokenized["tokenize_response"]]
    assert len(ids) == chat.usage.prompt_tokens
    tokenizer = AutoTokenizer.from_pretrained(llama_server.model_dir)
    # The template already holds the special tokens: no BOS is added on the chat path.
    assert ids == tokenizer(tokenized["templated_text"], add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(llama_server.model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert chat.choices[0].message.content == expected


def test_chat_stream(llama_client: Client, chat: ChatComplete, response_snapshot: Any) -> None:
    chunks = list(
        llama_client.chat_stream(MESSAGES, temperature=0, max_tokens=10, stream_options={"include_usage": True})
    )
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert token_chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in token_chunks) == chat.choices[0].message.content
    assert usage_chunk.choices == [] and usage_chunk.usage == chat.usage
    assert chunks == response_snapshot


def test_completion(llama_client: Client, response_snapshot: Any) -> None:
    response = llama_client.completion(PROMPTS[0], temperature=0, max_tokens=10)
    assert isinstance(response, Completion)
    assert response.object == "text_completion"
    assert len(response.choices) == 1
    assert response == response_snapshot


def test_completion_many_prompts(llama_client: Client, response_snapshot: Any) -> None:
    """A list of prompts runs concurrently; each choice equals that prompt's solo completion."""
    response = llama_client.completion(PROMPTS, temperature=0, max_tokens=10)
    assert isinstance(response, Completion)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, response.choices, strict=True):
        solo = llama_client.completion(prompt, temperature=0, max_tokens=10)
        assert isinstance(solo, Completion)
        assert choice.text == solo.choices[0].text
    assert response == response_snapshot


def test_completion_stream(llama_client: Client) -> None:
    chunks = list(llama_client.completion_stream(PROMPTS[:2], temperature=0, max_tokens=10))
    full = llama_client.completion(PROMPTS[:2], temperature=0, max_tokens=10)
    assert isinstance(full, Completion)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == full.choices[index].text
        assert all(c.finish_reason == "" for c in mine[:-1])
        # Streams report the raw finish reason (eos_token), plain responses OpenAI's (stop).
        last = mine[-1].finish_reason
        assert last == full.choices[index].finish_reason or (last, full.choices[index].finish_reason) == (
            "eos_token",
            "stop",
        )
