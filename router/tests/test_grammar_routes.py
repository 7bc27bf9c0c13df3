"""Guided generation end to end: a real shard (the random tiny llama) behind a real router, so only the grammar can
make an output valid. Every output must parse and pass `jsonschema`, or full-match its regex; tool calls must
name an offered function with valid arguments; through /generate, /generate_stream, the `textgen_client`
client and the official `openai` client (chat, response formats, tool calls, streamed tool calls). Bad grammars
and tools are refused with TGI's status and message while the rest of the batch completes, and a second router
on the same shard runs with --disable-grammar-support.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from router_fixtures import RouterProcess
from tool_definitions import WEATHER

from testing.shards import ShardProcess
from textgen_client import Client

pytestmark = pytest.mark.timeout(300)

# A template that reads `tools` and `tool_calls`, so the history's calls and results reach the prompt.
TEMPLATE = (
    "{% if tools %}{{ 'tools: ' + (tools | map(attribute='function.name') | join(',')) + '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ 'call ' + c.function.name }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
# Bounded schemas: enums, short strings, small arrays, so a random model completes them within max_new_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,4}"
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["days"],
        },
    },
}
TOOLS = [WEATHER, FORECAST]
ARGUMENTS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]
MAX_NEW_TOKENS = 96


@pytest.fixture(scope="module")
def routers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL of a router with grammars, base URL of one with --disable-grammar-support), on one shard."""
    config = tmp_path_factory.mktemp("grammar-template") / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": TEMPLATE}))
    flags = ["--tokenizer-config-path", str(config), "--max-concurrent-requests", "16"]
    flags += ["--max-input-tokens", "400", "--max-total-tokens", "512", "--max-batch-prefill-tokens", "1024"]
    with ShardProcess(tiny_llama) as shard:
        with RouterProcess(shard.socket, tiny_llama, flags) as on:
            with RouterProcess(shard.socket, tiny_llama, [*flags, "--disable-grammar-support"]) as off:
                yield on.base_url, off.base_url


@pytest.fixture(scope="module")
def http(routers: tuple[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=routers[0], timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(routers: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=routers[0] + "/v1", api_key="-", timeout=120, max_retries=0)


def generate(http: httpx.Client, inputs: str, **parameters: Any) -> httpx.Response:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, **parameters}}
    return http.post("/generate", json=body)


def json_grammar(seed: int) -> dict[str, Any]:
    return {"grammar": {"type": "json", "value": PERSON}, "do_sample": True, "seed": seed, "details": True}


# ---- /generate, /generate_stream, the client -----------------------------------------------------------------


def test_constrained_and_free_rows_in_one_batch(http: httpx.Client) -> None:
    """Json, json_schema, regex and free requests at once: each constrained output is valid, the free ones too."""
    jobs: list[tuple[str, dict[str, Any]]] = [(f"Person {i}:", json_grammar(i)) for i in range(4)]
    jobs += [
        ("Schema:", {"grammar": {"type": "json_schema", "value": {"name": "p", "schema": PERSON}}, "seed": 9}),
        ("Answer:", {"grammar": {"type": "regex", "value": REGEX}, "do_sample": True, "seed": 4, "details": True}),
        ("Answer:", {"grammar": {"type": "regex", "value": REGEX}}),
        ("Free text", {"max_new_tokens": 7, "details": True}),
        ("Free text", {"max_new_tokens": 3, "do_sample": True, "seed": 1}),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(lambda job: generate(http, job[0], **job[1]), jobs))
    for (_, parameters), response in zip(jobs, responses, strict=True):
        assert response.status_code == 200, response.text
        out = response.json()
        grammar = parameters.get("grammar")
        if grammar is None:
            assert out["generated_text"]
        elif grammar["type"] == "regex":
            assert re.fullmatch(REGEX, out["generated_text"]), out
        else:
            jsonschema.validate(json.loads(out["generated_text"]), PERSON)
        if grammar is not None and parameters.get("details"):
            assert out["details"]["finish_reason"] == "eos_token"  # the grammar was complete


@pytest.mark.parametrize("seed", range(4))
def test_properties_without_a_type_generate_a_closed_object(http: httpx.Client, seed: int) -> None:
    """TGI's documented grammar example has no `type`: its output is still an object of the declared
    properties only (no bare string, no other keys), nested objects too, as TGI's compiler writes them."""
    place = {"properties": {"city": {"type": "string", "maxLength": 6}}}
    schema = {"properties": {"location": {"type": "string", "maxLength": 6}, "place": place}}
    parameters = {"grammar": {"type": "json", "value": schema}, "do_sample": True, "seed": seed}
    response = generate(http, "Where?", **parameters)
    assert response.status_code == 200, response.text
    out = json.loads(response.json()["generated_text"])
    assert isinstance(out, dict) and set(out) <= {"location", "place"}, out
    assert isinstance(out.get("place", {}), dict) and set(out.get("place", {})) <= {"city"}, out


def test_generate_stream_under_a_grammar(http: httpx.Client) -> None:
    body = {"inputs": "Person:", "parameters": {"max_new_tokens": MAX_NEW_TOKENS, **json_grammar(3)}}
    events = []
    with http.stream("POST", "/generate_stream", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert events[-1]["generated_text"] == text
    jsonschema.validate(json.loads(text), PERSON)


def test_the_python_client_sends_grammars(routers: tuple[str, str]) -> None:
    client = Client(routers[0], timeout=120)
    out = client.generate("Person:", max_new_tokens=MAX_NEW_TOKENS, grammar={"type": "json", "value": PERSON})
    jsonschema.validate(json.loads(out.generated_text), PERSON)
    streamed = "".join(
        r.token.text
        for r in client.generate_stream(
            "Answer:", max_new_tokens=MAX_NEW_TOKENS, grammar={"type": "regex", "value": REGEX}
        )
        if not r.token.special
    )
    assert re.fullmatch(REGEX, streamed)


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"type": "regex", "value": "[a-z"}, "grammar is not valid: unclosed character class"),
        (
            {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            "grammar is not valid: 'strin' is not valid under any of the given schemas",
        ),
        ({"type": "json", "value": {"type": "object"}}, "grammar is not valid: Grammar must have a 'properties' field"),
        (
            {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}},
            'cannot compile regex from schema: Unimplemented keys: ["uniqueItems"]',
        ),
    ],
)
def test_a_bad_grammar_is_refused_and_the_rest_of_the_batch_completes(
    http: httpx.Client, grammar: dict[str, Any], message: str
) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        good = pool.submit(generate, http, "Person:", **json_grammar(5))
        bad = generate(http, "Person:", grammar=grammar)
        assert bad.status_code == 422
        assert bad.json() == {"error": f"Input validation error: {message}", "error_type": "validation"}
        jsonschema.validate(json.loads(good.result().json()["generated_text"]), PERSON)


def test_disable_grammar_support_refuses_grammars_and_tools(routers: tuple[str, str]) -> None:
    with httpx.Client(base_url=routers[1], timeout=60) as off:
        response = generate(off, "Person:", grammar={"type": "regex", "value": "a+"})
        refused = {"error": "Input validation error: grammar is not supported", "error_type": "validation"}
        assert (response.status_code, response.json()) == (422, refused)
        chat = off.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 20})
        assert (chat.status_code, chat.json()) == (422, refused)
        assert generate(off, "Free text", max_new_tokens=3).status_code == 200


# ---- /v1/chat/completions ------------------------------------------------------------------------------------


def test_openai_response_formats(oai: openai.OpenAI) -> None:
    schema_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = oai.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=MAX_NEW_TOKENS, seed=1, response_format=schema_format
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), PERSON)
    assert out.choices[0].finish_reason == "stop"
    json_mode = oai.chat.completions.create(
        model="tgi",
        messages=MESSAGES,
        max_tokens=MAX_NEW_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert json_mode.choices[0].finish_reason in ("stop", "length")
    if json_mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(json_mode.choices[0].message.content or ""), dict)
    tgi_regex: Any = {"type": "regex", "value": REGEX}
    chunks = oai.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=MAX_NEW_TOKENS, stream=True, response_format=tgi_regex
    )
    assert re.fullmatch(REGEX, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def check_call(name: str, arguments: str, offered: list[str]) -> None:
    assert name in offered
    jsonschema.validate(json.loads(arguments), ARGUMENTS[name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_calls(oai: openai.OpenAI, seed: int) -> None:
    out = oai.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=MAX_NEW_TOKENS, seed=seed, tools=TOOLS, tool_choice="required"
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id == "0" and call.type == "function"
    check_call(call.function.name, call.function.arguments, ["get_weather", "get_forecast"])


def test_a_named_tool_choice_calls_that_tool(oai: openai.OpenAI) -> None:
    for choice in ({"type": "function", "function": {"name": "get_forecast"}}, "get_forecast"):
        out = oai.chat.completions.create(
            model="tgi",
            messages=MESSAGES,
            max_tokens=MAX_NEW_TOKENS,
            tools=TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
        )
        (call,) = out.choices[0].message.tool_calls or []
        check_call(call.function.name, call.function.arguments, ["get_forecast"])


def test_auto_answers_with_a_call_or_with_content(oai: openai.OpenAI) -> None:
    """Under `auto` the model may pick `no_tool`: the answer is then generated again, without tools, as content."""
    for seed in range(4):
        out = oai.chat.completions.create(
            model="tgi", messages=MESSAGES, max_tokens=MAX_NEW_TOKENS, seed=seed, tools=TOOLS
        )
        choice = out.choices[0]
        if choice.message.tool_calls:
            (call,) = choice.message.tool_calls
            check_call(call.function.name, call.function.arguments, ["get_weather", "get_forecast"])
        else:
            assert choice.message.content is not None and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("seed", [1, 2])
def test_streamed_tool_calls_assemble_in_the_openai_client(oai: openai.OpenAI, seed: int) -> None:
    history: Any = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "4", "type": "function", "function": {"name": "get_weather", "arguments": '{"location":"x"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "4", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    with oai.chat.completions.stream(
        model="tgi", messages=history, max_tokens=MAX_NEW_TOKENS, seed=seed, tools=TOOLS, tool_choice="required"
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.id == "5"  # the integer after the history's call ids
    check_call(call.function.name, call.function.arguments, ["get_weather", "get_forecast"])


def test_chat_tool_errors(http: httpx.Client) -> None:
    def chat(**fields: Any) -> httpx.Response:
        return http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 20, **fields})

    unknown = chat(tools=TOOLS, tool_choice="get_time")
    assert (unknown.status_code, unknown.json()) == (
        422,
        {"error": "Tool error: Tool with name get_time not found", "error_type": "tool_error"},
    )
    both = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert (both.status_code, both.json()["error"]) == (422, "Tool error: Grammar and tools are mutually exclusive")
    streamed = http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 20,
            "stream": True,
            "response_format": {"type": "regex", "value": "["},
        },
    )
    assert (
        streamed.status_code == 200 and "grammar is not valid" in streamed.text and "http_status_code" in streamed.text
    )


def test_the_python_client_sends_tools_and_response_formats(routers: tuple[str, str]) -> None:
    client = Client(routers[0], timeout=120)
    out = client.chat(MESSAGES, max_tokens=MAX_NEW_TOKENS, seed=2, tools=TOOLS, tool_choice="get_weather")
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls or []
    check_call(call.function.name or "", call.function.arguments, ["get_weather"])
    names, arguments = [], ""
    for chunk in client.chat_stream(MESSAGES, max_tokens=MAX_NEW_TOKENS, seed=2, tools=TOOLS, tool_choice="required"):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments
    assert len(names) == 1
    check_call(names[0], arguments, ["get_weather", "get_forecast"])
    formatted = client.chat(
        MESSAGES, max_tokens=MAX_NEW_TOKENS, seed=3, response_format={"type": "json_object", "value": PERSON}
    )
    jsonschema.validate(json.loads(formatted.choices[0].message.content or ""), PERSON)
