"""The router's grammar logic without a shard: grammar checks and their messages (grammar.py), response formats,
the tool grammar, tool-call parsing and streaming (tool_grammar.py), tools in the chat template.

The tool grammar is exercised the way a shard applies it (the shard's JSON options): llguidance masks the tiny
llama's vocabulary and a seeded random walk picks any allowed token, so every output below is one the grammar
allows, not one a model happens to like; each must parse, pass `jsonschema` and stream into the same call.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from tool_definitions import WEATHER
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from textgen_pb import generate_pb2
from textgen_router import grammar, tool_grammar
from textgen_router.body import BodyError, parse_model
from textgen_router.chat_template import ChatTemplate
from textgen_router.openai_schemas import ChatRequest, NamedToolChoice, ResponseFormat, Tool
from textgen_router.schemas import GenerateRequest, GrammarParameters
from textgen_router.types import ValidationError
from textgen_server.sampling.grammar import JSON_OPTIONS

FORECAST = {
    "type": "function",
    "function": {
        "name": "get_n_day/forecast",  # a '/' must be escaped in the grammar's $ref
        "parameters": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["days"],
        },
    },
}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(FORECAST)]
DESERIALIZE = "Failed to deserialize the JSON body into the target type: "
ARGUMENT_SCHEMAS = {t.function.name: t.function.parameters for t in TOOLS} | {"no_tool": {"type": "object"}}


def shard_form(type_: str, value: Any) -> tuple[str, int]:
    return grammar.to_shard(GrammarParameters(type=type_, value=value))  # type: ignore[arg-type]


# ---- grammar checks -----------------------------------------------------------------------------------------

OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# OBJECT as the shards get it: closed to its declared properties, as TGI's compiler reads `properties`.
SENT = json.dumps({**OBJECT, "additionalProperties": False}, separators=(",", ":"))


@pytest.mark.parametrize(
    ("type_", "value", "expected"),
    [
        ("json", OBJECT, (SENT, generate_pb2.GRAMMAR_TYPE_JSON)),
        ("json_object", OBJECT, (SENT, generate_pb2.GRAMMAR_TYPE_JSON)),
        # a schema given as a string is parsed, and sent in the same compact form
        ("json", json.dumps(OBJECT, indent=2), (SENT, 1)),
        ("json_schema", {"name": "n", "schema": OBJECT}, (SENT, 1)),
        ("regex", r"\d{3}-[a-z]+", (r"\d{3}-[a-z]+", generate_pb2.GRAMMAR_TYPE_REGEX)),
    ],
)
def test_accepted_grammars_and_their_shard_form(type_: str, value: Any, expected: tuple[str, int]) -> None:
    assert shard_form(type_, value) == expected


@pytest.mark.parametrize(
    ("type_", "value", "message"),
    [
        ("json", 5, "grammar is not supported"),
        ("json", [OBJECT], "grammar is not supported"),
        # a string that is no JSON: serde_json's wording, as in TGI
        ("json", '{"type":', "grammar is not valid: EOF while parsing a value at line 1 column 8"),
        ("json", "NaN", "grammar is not valid: expected value at line 1 column 1"),
        (
            "json",
            {"type": "object", "properties": {"a": {"type": "strin"}}},
            "grammar is not valid: 'strin' is not valid under any of the given schemas",
        ),
        ("json", {"type": "object"}, "grammar is not valid: Grammar must have a 'properties' field"),
        ("json_schema", {"name": "n"}, "grammar is not valid: `json_schema` must have a 'schema' field"),
        # valid JSON Schema that llguidance cannot enforce: refused rather than generated free-form
        (
            "json",
            {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
            'cannot compile regex from schema: Unimplemented keys: ["uniqueItems"]',
        ),
        (
            "json",
            {"type": "object", "properties": {"a": {"type": "string", "format": "colour"}}},
            "cannot compile regex from schema: Unknown format: colour",
        ),
        ("regex", "[a-z", "grammar is not valid: unclosed character class"),
        (
            "regex",
            "(?<=a)b",
            "grammar is not valid: look-around, including look-ahead and look-behind, is not supported",
        ),
    ],
)
def test_refused_grammars_and_their_messages(type_: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        shard_form(type_, value)
    assert str(err.value) == f"Input validation error: {message}"


@pytest.mark.parametrize(
    ("value", "kind"),
    [(5, "integer `5`"), (1.5, "floating point `1.5`"), (True, "boolean `true`"), (None, "null"),
     (["a"], "sequence"), ({"a": 1}, "map")],
)  # fmt: skip
def test_a_regex_that_is_no_string_fails_to_deserialize(value: Any, kind: str) -> None:
    """TGI's `Regex(String)`: any other value is a deserialization error (a plain-text 422), for `grammar` and
    for `response_format` alike, not a validation error."""
    message = f"invalid type: {kind}, expected a string"
    body = {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": value}}}
    with pytest.raises(BodyError) as err:
        parse_model(body, GenerateRequest)
    assert (err.value.status, err.value.text) == (422, f"{DESERIALIZE}parameters.grammar: {message}")
    chat = {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex", "value": value}}
    with pytest.raises(BodyError) as err:
        parse_model(chat, ChatRequest)
    assert err.value.text == f"{DESERIALIZE}response_format: {message}"


def closed_outputs(tokenizer: PreTrainedTokenizerBase, value: Any, n: int) -> list[Any]:
    """`n` outputs the grammar of the JSON grammar `value` allows, compiled as the router sends it to a shard."""
    text, _ = shard_form("json", value)
    return [json.loads("".join(texts)) for texts in random_outputs(tokenizer, json.loads(text), n)]


def test_properties_alone_make_a_closed_object(tokenizer: PreTrainedTokenizerBase) -> None:
    """TGI's documented example has no `type`: TGI's compiler still only writes an object of the declared
    properties, where plain JSON Schema also admits a bare string or other keys. Nested objects likewise."""
    location = {"properties": {"location": {"type": "string", "maxLength": 6}}}
    nested = {
        "properties": {"place": {"properties": {"city": {"type": "string", "maxLength": 4}}}},
        "required": ["place"],
    }
    for output in closed_outputs(tokenizer, location, 12):
        assert isinstance(output, dict) and set(output) <= {"location"}, output
    outputs = closed_outputs(tokenizer, nested, 12)
    for output in outputs:
        assert list(output) == ["place"] and isinstance(output["place"], dict), output
        assert set(output["place"]) <= {"city"}, output
    assert any(output["place"] for output in outputs)  # the inner property is still written, not banned
    # What a schema states itself stays: an explicitly open object admits other keys, for the walk as well.
    open_ = {**location, "additionalProperties": True}
    assert json.loads(shard_form("json", open_)[0]) == {**open_, "type": "object"}


def test_closing_reaches_every_subschema_and_only_schemas() -> None:
    inner = {"properties": {"x": {"type": "integer"}}}
    closed = {**inner, "type": "object", "additionalProperties": False}
    schema = {
        # a property named `properties` is a name, not a keyword: its map is left as it is
        "properties": {"properties": inner, "list": {"type": "array", "items": inner}, "ref": {"$ref": "#/$defs/i"}},
        "$defs": {"i": inner},
        "anyOf": [inner, True],
    }
    got = grammar.close_objects(schema)
    assert got["properties"]["properties"] == closed
    assert got["properties"]["list"]["items"] == closed
    assert got["$defs"]["i"] == closed and got["anyOf"] == [closed, True]
    assert set(got["properties"]) == {"properties", "list", "ref"}
    assert schema["$defs"]["i"] == inner  # the request's own schema is not changed


@pytest.mark.parametrize(
    "schema",
    [
        # An object made of allOf members: each lists some of its keys, so none of them is closed, nor the object.
        {
            "properties": {"a": {"type": "string"}},
            "allOf": [
                {"properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
            ],
        },
        # A "base model" definition an allOf member refers to.
        {
            "properties": {"x": {}},
            "allOf": [{"$ref": "#/$defs/B"}],
            "$defs": {"B": {"properties": {"y": {}}, "required": ["y"]}},
        },
    ],
)
def test_objects_built_from_all_of_stay_open(schema: dict[str, Any]) -> None:
    got = grammar.close_objects(schema)
    assert got["type"] == "object" and "additionalProperties" not in got
    assert got["allOf"] == schema["allOf"] and got.get("$defs") == schema.get("$defs")
    # llguidance compiles it: closed members refused each other's required keys (`Unsatisfiable schema`).
    grammar.to_shard(GrammarParameters(type="json", value=schema))


def test_conditions_are_not_closed() -> None:
    condition = {"properties": {"a": {"const": 1}}}
    schema = {"properties": {"a": {}}, "not": condition, "if": condition, "then": condition, "contains": condition}
    got = grammar.close_objects(schema)
    assert all(got[key] == condition for key in ("not", "if", "then", "contains"))


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, ("json", {"type": "object", "properties": {}, "additionalProperties": True})),
        ({"type": "json_object", "value": OBJECT}, ("json_object", OBJECT)),
        ({"type": "json", "value": OBJECT}, ("json", OBJECT)),
        ({"type": "regex", "value": "a+"}, ("regex", "a+")),
        (
            {"type": "json_schema", "value": {"name": "x", "schema": OBJECT}},
            ("json_schema", {"name": "x", "schema": OBJECT}),
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJECT, "strict": True}},
            ("json_schema", {"name": "x", "schema": OBJECT}),
        ),
    ],
)
def test_response_formats_become_grammars(response_format: dict[str, Any], expected: Any) -> None:
    got = ResponseFormat.model_validate(response_format).grammar()
    assert (got if got is None else (got.type, got.value)) == expected
    if got is not None:
        grammar.to_shard(got)  # each is a grammar the router accepts


# ---- tool selection and grammar -----------------------------------------------------------------------------


def names(tools: list[Tool]) -> list[str]:
    return [t.function.name for t in tools]


def test_tool_choice_selects_the_tools() -> None:
    assert names(tool_grammar.select_tools(TOOLS, None)) == ["get_weather", "get_n_day/forecast", "no_tool"]
    assert names(tool_grammar.select_tools(TOOLS, "auto")) == ["get_weather", "get_n_day/forecast", "no_tool"]
    assert names(tool_grammar.select_tools(TOOLS, "required")) == ["get_weather", "get_n_day/forecast"]
    assert tool_grammar.select_tools(TOOLS, "none") == []
    assert tool_grammar.select_tools(None, "auto") == []
    assert names(tool_grammar.select_tools(TOOLS, "get_weather")) == ["get_weather"]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_n_day/forecast"}})
    assert names(tool_grammar.select_tools(TOOLS, named)) == ["get_n_day/forecast"]
    with pytest.raises(tool_grammar.ToolError) as err:
        tool_grammar.select_tools(TOOLS, "get_time")
    assert (str(err.value), err.value.status_code, err.value.error_type) == (
        "Tool error: Tool with name get_time not found",
        422,
        "tool_error",
    )


def test_tool_schema_is_a_grammar_the_router_accepts() -> None:
    schema = tool_grammar.tool_schema(tool_grammar.select_tools(TOOLS, "auto"))
    text, grammar_type = shard_form("json", schema)
    assert grammar_type == generate_pb2.GRAMMAR_TYPE_JSON and json.loads(text) == schema
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"function": {"_name": "get_weather", "location": "Paris", "format": "celsius"}})
    assert validator.is_valid({"function": {"_name": "no_tool"}})
    assert not validator.is_valid({"function": {"_name": "get_time"}})
    assert not validator.is_valid({"function": {"_name": "get_weather", "location": "Paris"}})  # missing format
    assert not validator.is_valid({})


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama)


def random_outputs(tokenizer: PreTrainedTokenizerBase, schema: dict[str, Any], n: int) -> Iterator[list[str]]:
    """`n` outputs the grammar of `schema` allows, each as the text of its tokens (incremental decoding), compiled
    as a shard compiles it."""
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    compiled = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    rng = random.Random(20)
    mask = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    for _ in range(n):
        matcher = llguidance.LLMatcher(ll_tokenizer, compiled)
        ids: list[int] = []
        while not matcher.is_stopped():
            assert len(ids) < 300, tokenizer.decode(ids)
            fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.flatnonzero(
                np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: ll_tokenizer.vocab_size]
            )
            token = int(rng.choice(allowed))
            assert matcher.consume_token(token), matcher.get_error()
            ids.append(token)
        ids = [i for i in ids if i != tokenizer.eos_token_id]
        texts = [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :] for i in range(len(ids))]
        yield texts


@pytest.mark.parametrize("choice", ["auto", "required", "get_n_day/forecast"])
def test_every_output_the_tool_grammar_allows_is_a_valid_call(tokenizer: PreTrainedTokenizerBase, choice: str) -> None:
    tools = tool_grammar.select_tools(TOOLS, choice)
    schema = tool_grammar.tool_schema(tools)
    seen = set()
    for texts in random_outputs(tokenizer, schema, 12):
        text = "".join(texts)
        jsonschema.validate(json.loads(text), schema)
        call = tool_grammar.parse_call(text)
        name = "no_tool" if call is None else call.name
        seen.add(name)
        assert name in names(tools)
        if call is not None:
            jsonschema.validate(json.loads(call.arguments), ARGUMENT_SCHEMAS[name])
        streamed = stream(texts)
        assert streamed[0] == name
        if call is not None:
            assert json.loads(streamed[1]) == json.loads(call.arguments)
    assert len(seen) > 1 or choice == "get_n_day/forecast"


def stream(texts: list[str]) -> tuple[str | None, str]:
    """The name and assembled arguments a CallStream gives for one output fed token by token."""
    calls = tool_grammar.CallStream()
    arguments = ""
    for text in texts:
        piece = calls.push(text)
        if piece is not None:
            arguments += piece
    return calls.name, arguments + calls.finish()


@pytest.mark.parametrize(
    "text",
    [
        '{"function":{"_name":"get_weather","location":"Paris","format":"celsius"}}',
        '{ "function" : { "_name" : "get_weather" , "location" : "a}}\\"}" } }',
        '{"function": {"_name": "f"}}',
        '{"function":{"_name":"x\\"y","a":{"b":[1,{"c":"}"}]}}}',
    ],
)
def test_streamed_arguments_match_the_parsed_call_however_the_text_is_split(text: str) -> None:
    call = tool_grammar.parse_call(text)
    assert call is not None
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        name, arguments = stream(pieces)
        assert name == call.name
        assert json.loads(arguments) == json.loads(call.arguments)


def test_no_tool_is_read_as_no_call_and_known_as_soon_as_its_name_ends() -> None:
    assert tool_grammar.parse_call('{"function": {"_name": "no_tool"}}') is None
    calls = tool_grammar.CallStream()
    assert calls.push('{"function": {"_name": "no_t') is None and calls.name is None
    calls.push('ool"')
    assert calls.name == "no_tool"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"function": {"_name": "get_weather", "location": "Par', "Unterminated string starting at"),
        ("{}", "'function'"),
        ('{"function": {"_name": 3}}', "`_name` is not a string"),
    ],
)
def test_an_output_that_is_no_call_is_a_tool_error(text: str, reason: str) -> None:
    with pytest.raises(tool_grammar.ToolError, match="^Tool error: Failed to parse generated text: ") as err:
        tool_grammar.parse_call(text)
    assert reason in str(err.value) and repr(text) in str(err.value)


def test_stream_call_ids_follow_the_history() -> None:
    assert tool_grammar.stream_call_id([]) == "0"
    assert tool_grammar.stream_call_id(["0", "4", "2"]) == "5"
    assert len(tool_grammar.stream_call_id(["call_abc"])) == 36  # a UUID


# ---- tools and tool calls in the chat template --------------------------------------------------------------

PLAIN = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}assistant:"
WITH_TOOLS = (
    "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') + '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {% if m.tool_calls %}"
    "{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.location }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}assistant:"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"id": "0", "type": "function", "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "0", "content": "rain"},
]


def chat_request(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"messages": HISTORY, "tools": [WEATHER], **fields})


def test_a_template_that_reads_tools_gets_them_and_the_tool_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    from textgen_router.chat_input import chat_input

    chat = chat_input(chat_request(tool_prompt="Use a tool."), ChatTemplate(tokenizer.special_tokens_map, WITH_TOOLS))
    assert chat.without_tools is not None and chat.parameters.grammar is not None
    assert chat.without_tools().parameters.grammar is None
    assert chat.prompt == (
        "TOOLS get_weather,no_tool\nuser: Weather in Paris?\nassistant: CALL get_weather Paris\n"
        "tool: rain\n---\nUse a tool.\nassistant:"
    )


def test_a_template_without_tools_gets_their_json_and_calls_as_content(tokenizer: PreTrainedTokenizerBase) -> None:
    from textgen_router.chat_input import chat_input

    chat = chat_input(chat_request(tool_choice="required"), ChatTemplate(tokenizer.special_tokens_map, PLAIN))
    tools_json = tool_grammar.tools_prompt(tool_grammar.select_tools(TOOLS[:1], "required"))
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}, "id": "0"}]
    assert chat.prompt == (
        f"user: Weather in Paris?\nassistant: {json.dumps(call)}\n"
        f"tool: rain\n---\n{tools_json}\n{tool_grammar.DEFAULT_TOOL_PROMPT}\nassistant:"
    )
    # TGI's text of a tool: its parameters under `arguments`, as a JSON string
    assert json.loads(tools_json)[0]["function"]["arguments"] == json.dumps(
        WEATHER["function"]["parameters"], separators=(",", ":")
    )


def test_without_tools_the_response_format_is_the_grammar(tokenizer: PreTrainedTokenizerBase) -> None:
    from textgen_router.chat_input import chat_input

    template = ChatTemplate(tokenizer.special_tokens_map, PLAIN)
    request = ChatRequest.model_validate(
        {"messages": HISTORY[:1], "response_format": {"type": "regex", "value": "[0-9]+"}}
    )
    chat = chat_input(request, template)
    assert chat.without_tools is None and chat.parameters.grammar == GrammarParameters(type="regex", value="[0-9]+")
    assert chat_input(chat_request(tool_choice="none"), template).parameters.grammar is None
    with pytest.raises(tool_grammar.ToolError, match="^Tool error: Grammar and tools are mutually exclusive$"):
        chat_input(chat_request(response_format={"type": "json_object"}), template)


def test_a_template_that_only_names_tools_in_its_text_does_not_read_them(tokenizer: PreTrainedTokenizerBase) -> None:
    # TGI asks minijinja for the template's undeclared variables: text that says "tools" reads none.
    from textgen_router.chat_input import chat_input

    chat = chat_input(
        chat_request(tool_choice="required"), ChatTemplate(tokenizer.special_tokens_map, "Use tools wisely.\n" + PLAIN)
    )
    tools_json = tool_grammar.tools_prompt(tool_grammar.select_tools(TOOLS[:1], "required"))
    assert chat.prompt.endswith(f"\n---\n{tools_json}\n{tool_grammar.DEFAULT_TOOL_PROMPT}\nassistant:")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # Cut right after the final message's text, trailing whitespace dropped (TGI's trim_end).
        (PLAIN, "user: Hi\nassistant: Hello"),
        # A template that changes the text: nothing to cut at, the whole render (TGI: 200, not an error).
        (PLAIN.replace("m['content']", "m['content'] | upper"), "user: HI\nassistant: HELLO \nassistant:"),
    ],
)
def test_a_final_assistant_message_is_continued_as_tgi_cuts_it(
    tokenizer: PreTrainedTokenizerBase, template: str, expected: str
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello "}]
    assert ChatTemplate(tokenizer.special_tokens_map, template).apply(messages) == expected
