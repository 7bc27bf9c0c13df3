"""Every /generate validation rule, its message and TGI's order: the Validator with the model's real tokenizer,
then the same rules through the shared router (422 JSON)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from router_fixtures import MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS

from textgen_common.cache_dir import ENV as CACHE_ENV
from textgen_router.schemas import GenerateParameters, GrammarParameters, to_f32
from textgen_router.tokenizer import load_tokenizer
from textgen_router.types import ValidationError, ValidRequest
from textgen_router.validation import Limits, Validator

pytestmark = pytest.mark.timeout(120)

PROMPT = "Hello world, this is"
LONG = " ".join(["word"] * 80)  # more than MAX_INPUT_TOKENS tokens

# (parameters, inputs, message after "Input validation error: ")
RULES: list[tuple[dict[str, Any], str, str]] = [
    ({"best_of": 2}, PROMPT, "you must use sampling when `best_of` is > 1"),
    ({"temperature": 0.0}, PROMPT, "`temperature` must be strictly positive"),
    ({"temperature": -1.0}, PROMPT, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0.0}, PROMPT, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, PROMPT, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": -2.5}, PROMPT, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, PROMPT, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.0}, PROMPT, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0}, PROMPT, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, PROMPT, "`top_k` must be strictly positive"),
    ({"top_k": -3}, PROMPT, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, PROMPT, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, PROMPT, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 2, "do_sample": True, "seed": 3}, PROMPT, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 6}, PROMPT, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({}, "", "`inputs` cannot be empty"),
    ({"truncate": 0}, PROMPT, f"`truncate` must be strictly positive and less than {MAX_INPUT_TOKENS}. Given: 0"),
    (
        {"truncate": MAX_INPUT_TOKENS + 1},
        PROMPT,
        f"`truncate` must be strictly positive and less than {MAX_INPUT_TOKENS}. Given: {MAX_INPUT_TOKENS + 1}",
    ),
    (
        {"max_new_tokens": MAX_TOTAL_TOKENS},
        PROMPT,
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL_TOKENS}. Given: 10 `inputs` tokens and "
        f"{MAX_TOTAL_TOKENS} `max_new_tokens`",
    ),
    ({"max_new_tokens": 5}, LONG, f"`inputs` must have less than {MAX_INPUT_TOKENS} tokens. Given: 81"),
    (
        {"max_new_tokens": 5, "grammar": {"type": "json", "value": {"type": "object"}}},
        PROMPT,
        "grammar is not valid: Grammar must have a 'properties' field",
    ),
    # Order: the first failing rule wins.
    ({"temperature": 0.0, "top_p": 1.0, "top_k": 0}, PROMPT, "`temperature` must be strictly positive"),
    ({"top_p": 1.0, "top_k": 0}, "", "`top_p` must be > 0.0 and < 1.0"),
    (
        {"max_new_tokens": MAX_TOTAL_TOKENS},
        LONG,
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL_TOKENS}. Given: 81 `inputs` tokens and "
        f"{MAX_TOTAL_TOKENS} `max_new_tokens`",
    ),
]


@pytest.fixture(scope="module")
def validator(tiny_llama: Path) -> Iterator[Validator]:
    limits = Limits(
        max_best_of=2,
        max_stop_sequences=4,
        max_top_n_tokens=5,
        max_input_tokens=MAX_INPUT_TOKENS,
        max_total_tokens=MAX_TOTAL_TOKENS,
    )
    v = Validator(load_tokenizer(tiny_llama), limits, workers=2)
    yield v
    v.close()


def validate(validator: Validator, inputs: str, **parameters: Any) -> ValidRequest:
    return asyncio.run(validator.validate(inputs, GenerateParameters(**parameters)))


def test_prompt_lengths_assumed_by_the_rules(validator: Validator) -> None:
    assert validate(validator, PROMPT, max_new_tokens=1).input_length == 10
    assert len(validator.tokenizer.encoder.encode(LONG).ids) == 81


@pytest.mark.parametrize(("parameters", "inputs", "message"), RULES)
def test_rule(validator: Validator, parameters: dict[str, Any], inputs: str, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        validate(validator, inputs, **parameters)
    assert str(err.value) == f"Input validation error: {message}"
    assert (err.value.status_code, err.value.error_type) == (422, "validation")


def test_best_of_limits(validator: Validator) -> None:
    with pytest.raises(ValidationError, match=r"`best_of` must be > 0 and <= 2\. Given: 3"):
        validator.validate_best_of(3)
    assert validator.validate_best_of(2) == 2
    single = Validator(validator.tokenizer, Limits(1, 4, 5, MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS), workers=1)
    try:
        with pytest.raises(ValidationError, match="`best_of` != 1 is not allowed for this endpoint"):
            single.validate_best_of(2)
    finally:
        single.close()


def test_valid_request_fields(validator: Validator) -> None:
    req = validate(
        validator,
        PROMPT,
        temperature=0.5,
        top_k=10,
        top_p=0.9,
        typical_p=0.8,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        do_sample=True,
        seed=7,
        stop=["x"],
        watermark=True,
        top_n_tokens=2,
        max_new_tokens=3,
        decoder_input_details=True,
    )
    p = req.parameters
    # Float parameters are read as float32 (what the shards receive), as TGI's f32 fields.
    assert (p.temperature, p.top_k, p.top_p, p.typical_p, p.repetition_penalty, p.frequency_penalty) == (
        0.5,
        10,
        to_f32(0.9),
        to_f32(0.8),
        to_f32(1.1),
        to_f32(0.2),
    )
    assert (p.do_sample, p.seed, p.watermark) == (True, 7, True)
    assert req.stopping_parameters.max_new_tokens == 3 and req.stopping_parameters.stop_sequences == ["x"]
    assert (req.top_n_tokens, req.decoder_input_details, req.add_special_tokens) == (2, True, True)
    assert req.truncate == MAX_INPUT_TOKENS  # TGI sends max_input_tokens when the user gave none


def test_defaults_and_budget(validator: Validator) -> None:
    req = validate(validator, PROMPT)
    p = req.parameters
    assert (p.temperature, p.top_k, p.top_p, p.typical_p, p.do_sample) == (1.0, 0, 1.0, 1.0, False)
    assert 0 <= p.seed < 2**64  # a random seed is always drawn
    # Omitted max_new_tokens fills the rest of the context (TGI 3.0/3.1).
    assert req.stopping_parameters.max_new_tokens == MAX_TOTAL_TOKENS - req.input_length
    at_limit = validate(validator, PROMPT, max_new_tokens=MAX_TOTAL_TOKENS - 10)
    assert at_limit.stopping_parameters.max_new_tokens == MAX_TOTAL_TOKENS - 10


def test_truncate_keeps_the_last_tokens(validator: Validator) -> None:
    full = validate(validator, PROMPT, max_new_tokens=1).input_ids
    assert validate(validator, PROMPT, max_new_tokens=1, truncate=3).input_ids == full[-3:]
    assert asyncio.run(validator.tokenize(PROMPT, truncate=0)).ids == []  # validate() refuses 0; encode keeps none
    # Truncation makes an over-long prompt acceptable.
    assert validate(validator, LONG, max_new_tokens=1, truncate=MAX_INPUT_TOKENS).input_length == MAX_INPUT_TOKENS


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("kept", [False, True], ids=["built", "read-from-the-cache"])
def test_tokenize_equals_the_transformers_tokenizer(
    arch: str, add_special_tokens: bool, kept: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The router calls the `tokenizers` encoder directly, as built by transformers or as read back from the file
    # an earlier start kept (textgen_router/tokenizer.py); ids and character spans must stay what the model's
    # transformers tokenizer gives (BOS handling, special tokens written in the text, non-ASCII spans).
    from transformers import AutoTokenizer

    model = request.getfixturevalue(f"tiny_{arch}")
    monkeypatch.setenv(CACHE_ENV, str(request.getfixturevalue("tmp_path")))
    tokenizer = load_tokenizer(model)
    if kept:
        assert len(list(Path(os.environ[CACHE_ENV]).glob("tokenizer-*.json"))) == 1
        tokenizer = load_tokenizer(model)
    oracle = AutoTokenizer.from_pretrained(model)
    assert tokenizer.special_tokens == oracle.special_tokens_map
    v = Validator(tokenizer, Limits(1, 4, 5, MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS), workers=1)
    try:
        special = " ".join(str(t) for t in oracle.all_special_tokens)
        for text in [PROMPT, f"x {special} y", "  ünïcödé 日本語 🙂\n\ttabs", "a" * 300, ""]:
            expected = oracle(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
            got = asyncio.run(v.tokenize(text, add_special_tokens))
            assert got.ids == list(expected["input_ids"])
            assert got.offsets == [tuple(o) for o in expected["offset_mapping"]]
    finally:
        v.close()


def test_grammar_shape_is_checked_before_support(validator: Validator) -> None:
    assert GrammarParameters(type="regex", value="a+").type == "regex"
    with pytest.raises(
        pydantic.ValidationError, match="Input should be 'json', 'json_object', 'regex' or 'json_schema'"
    ):
        GrammarParameters(type="xml", value="a")  # type: ignore[arg-type]


def test_worker_processes_import_none_of_the_parent_s_main(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spawned worker runs the parent's __main__ before anything else: in the router, textgen_router.main (under
    `python -m`, as here) or its script, and with them FastAPI and transformers. The tokenization workers start
    with an empty one and import only what tokenizing needs."""
    router_main = types.ModuleType("__main__")
    router_main.__spec__ = importlib.util.find_spec("textgen_router.main")
    monkeypatch.setitem(sys.modules, "__main__", router_main)
    limits = Limits(2, 4, 5, MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS)
    validator = Validator(load_tokenizer(tiny_llama), limits, workers=1)
    try:
        assert validator._processes is not None
        loaded = validator._processes.submit(eval, "sorted(__import__('sys').modules)").result(timeout=60)
    finally:
        validator.close()
    assert "tokenizers" in loaded and "textgen_router.tokenization" in loaded
    heavy = [name for name in loaded if name.split(".")[0] in ("fastapi", "transformers", "torch", "uvicorn")]
    heavy += [name for name in loaded if name == "textgen_router.main"]
    assert heavy == [], heavy


def test_tokenization_runs_off_the_event_loop(validator: Validator) -> None:
    async def main() -> tuple[int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        enc = await validator.tokenize(" ".join(["token"] * 30_000))
        task.cancel()
        return ticks, len(enc.ids)

    ticks, n = asyncio.run(main())
    assert n > 20_000
    assert ticks > 1  # the loop kept running while a worker thread tokenized


@pytest.mark.parametrize(("parameters", "inputs", "message"), [RULES[1], RULES[12], RULES[18], RULES[19]])
def test_rules_over_http(client: httpx.Client, parameters: dict[str, Any], inputs: str, message: str) -> None:
    response = client.post("/generate", json={"inputs": inputs, "parameters": parameters})
    assert response.status_code == 422
    assert response.json() == {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_best_of_over_http(client: httpx.Client) -> None:
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 3, "do_sample": True}})
    assert response.status_code == 422
    assert response.json()["error"] == "Input validation error: `best_of` must be > 0 and <= 2. Given: 3"
