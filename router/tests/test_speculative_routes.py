"""`--speculate N` through the real launcher, router and shard: a step's several tokens reach the client one by
one, as TGI's router sends them, and `tgi_request_skipped_tokens` counts the tokens beyond each step's first.

The model is the tiny llama made to loop (textgen_server.builder.build_cycling_model), so n-gram guesses are confirmed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from testing.launcher import LauncherProcess

PROMPT = "one two one two one"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def http(launcher: Callable[..., LauncherProcess], cycling_llama: Path) -> Iterator[httpx.Client]:
    """A client of one launcher with --speculate 3, stopped with the module."""
    server = launcher(cycling_llama, "--speculate", "3")
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client
    server.stop()


@pytest.fixture(scope="module")
def greedy(cycling_llama: Path) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cycling_llama)
    model = AutoModelForCausalLM.from_pretrained(cycling_llama).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return list(out[0, ids.input_ids.shape[1] :].tolist())


def skipped(http: httpx.Client) -> tuple[float, float]:
    """tgi_request_skipped_tokens' (sum, count)."""
    text = http.get("/metrics").text
    values = [re.search(rf"^tgi_request_skipped_tokens_{part} (\S+)$", text, re.M) for part in ("sum", "count")]
    return tuple(float(m.group(1)) if m else 0.0 for m in values)  # type: ignore[return-value]


def test_generate_returns_transformers_tokens_and_counts_the_skipped(http: httpx.Client, greedy: list[int]) -> None:
    before = skipped(http)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert [t["id"] for t in details["tokens"]] == greedy
    assert details["generated_tokens"] == NEW_TOKENS and details["finish_reason"] == "length"
    total, steps = (after - first for after, first in zip(skipped(http), before, strict=True))
    # One observation a step; the tokens beyond each step's first are the confirmed guesses.
    assert total + steps == NEW_TOKENS and steps < NEW_TOKENS


def test_a_stream_sends_every_token_of_a_step_as_its_own_event(http: httpx.Client, greedy: list[int]) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS}}
    with http.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == greedy
    assert [e["generated_text"] is not None for e in events] == [False] * (NEW_TOKENS - 1) + [True]


def test_a_stop_sequence_inside_a_step_ends_the_text_there(http: httpx.Client, greedy: list[int]) -> None:
    full = http.post(
        "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    )
    texts = [t["text"] for t in full.json()["details"]["tokens"]]
    # Tokens 2-9: longer than the loop's period, so it first ends at token 9, the first of a step of 4 (tokens
    # 0-4 come one a step, then 5-8, 9-12).
    stop = "".join(texts[2:10])
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "stop": [stop], "details": True}}
    response = http.post("/generate", json=body).json()
    assert response["details"]["finish_reason"] == "stop_sequence"
    assert response["details"]["generated_tokens"] == 10
    assert response["generated_text"] == "".join(texts[:10])
    assert [t["id"] for t in response["details"]["tokens"]] == greedy[:10]
