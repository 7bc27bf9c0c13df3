"""textgen_client against a real server (tiny llama behind textgen-launcher), plus its error mapping."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from testing.launcher import LauncherProcess
from textgen_client import AsyncClient, Client, errors, types
from textgen_client.errors import (
    BadRequestError,
    GenerationError,
    IncompleteGenerationError,
    NotFoundError,
    OverloadedError,
    RateLimitExceededError,
    ShardNotReadyError,
    ShardTimeoutError,
    UnknownError,
    ValidationError,
    parse_error,
)
from textgen_client.payloads import chat_body, generate_body
from textgen_client.types import (
    ChatComplete,
    ChatCompletionChunk,
    Completion,
    FinishReason,
    OutputMessage,
    StreamResponse,
)

PROMPT = "def main():"
NOWHERE = "http://127.0.0.1:9"  # nothing listens: a request refused by the client never gets this far


def test_generate(llama_client: Client) -> None:
    response = llama_client.generate(PROMPT, max_new_tokens=6, decoder_input_details=True)
    assert response.details is not None
    assert response.details.generated_tokens == len(response.details.tokens) <= 6
    assert response.details.finish_reason in (FinishReason.Length, FinishReason.EndOfSequenceToken)
    assert response.details.prefill[0].logprob is None
    assert response.details.seed is None  # greedy


def test_generate_stream_matches_generate(llama_client: Client) -> None:
    full = llama_client.generate(PROMPT, max_new_tokens=6)
    events = list(llama_client.generate_stream(PROMPT, max_new_tokens=6))
    assert all(isinstance(e, StreamResponse) for e in events)
    assert [e.token.id for e in events] == [t.id for t in full.details.tokens]  # type: ignore[union-attr]
    assert events[-1].generated_text == full.generated_text
    assert events[-1].details is not None


def test_async_client_matches_sync(llama_client: Client, llama_async_client: AsyncClient) -> None:
    async def run() -> tuple[Any, list[StreamResponse]]:
        response = await llama_async_client.generate(PROMPT, max_new_tokens=6)
        events = [e async for e in llama_async_client.generate_stream(PROMPT, max_new_tokens=6)]
        return response, events

    response, events = asyncio.run(run())
    assert response == llama_client.generate(PROMPT, max_new_tokens=6)
    assert events[-1].generated_text == response.generated_text


def test_chat_and_completion(llama_client: Client, llama_async_client: AsyncClient) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    chat = llama_client.chat(messages, temperature=0, max_tokens=5)
    assert isinstance(chat, ChatComplete)
    chunks = list(llama_client.chat(messages, stream=True, temperature=0, max_tokens=5))  # type: ignore[arg-type]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content

    completion = llama_client.completion(PROMPT, temperature=0, max_tokens=5)
    assert isinstance(completion, Completion)
    streamed = list(llama_client.completion_stream(PROMPT, temperature=0, max_tokens=5))
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text

    async def run() -> tuple[Any, Any]:
        return await llama_async_client.chat(messages, temperature=0, max_tokens=5), [
            c async for c in llama_async_client.completion_stream(PROMPT, temperature=0, max_tokens=5)
        ]

    async_chat, async_chunks = asyncio.run(run())
    assert async_chat.choices[0].message.content == chat.choices[0].message.content
    assert "".join(c.choices[0].text for c in async_chunks) == completion.choices[0].text


CALL = {"id": "0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "content": "22 C", "tool_call_id": "0"},
]


def test_chat_sends_tool_calls_and_tool_results(llama_client: Client) -> None:
    """A turn with only tool calls is sent with them (without, the server sees an empty turn: a 422), and a tool
    result keeps the id of its call."""
    sent = chat_body(TOOL_TURNS, False)["messages"]
    assert sent[1] == {"role": "assistant", "tool_calls": [CALL]}
    assert sent[2]["tool_call_id"] == "0"
    assert isinstance(llama_client.chat(TOOL_TURNS, temperature=0, max_tokens=3), ChatComplete)


def test_a_reply_is_sent_back_as_a_turn() -> None:
    """An answer's message (here a tool call, as the server words it) goes back into the conversation as is."""
    reply = OutputMessage.model_validate(
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"description": None, **CALL["function"]}}]}
    )
    assert chat_body([TOOL_TURNS[0], reply], False)["messages"][1] == TOOL_TURNS[1]


def test_unknown_request_keys_are_refused() -> None:
    """Nothing is dropped silently: a misspelt key in a turn, a tool call or a grammar is an error."""
    with pytest.raises(ValidationError, match="tool_call_ids"):
        chat_body([{"role": "tool", "content": "1", "tool_call_ids": "0"}], False)
    with pytest.raises(ValidationError, match="argument"):
        chat_body([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "argument": "{}"}}]}], False)
    with pytest.raises(ValidationError, match="schema"):
        Client(NOWHERE).generate(PROMPT, grammar={"type": "json", "value": {"type": "object"}, "schema": {}})


def test_server_validation_error(llama_client: Client) -> None:
    with pytest.raises(ValidationError, match="must be <="):
        llama_client.generate(PROMPT, max_new_tokens=10**6)


def test_stream_error_event_raises(llama_client: Client) -> None:
    """Streams report errors in-band on a 200; the client raises them."""
    with pytest.raises(ValidationError, match="must be <="):
        list(llama_client.generate_stream(PROMPT, max_new_tokens=10**6))


def test_unsupported_chat_field_is_a_validation_error(llama_client: Client) -> None:
    with pytest.raises(ValidationError, match="`n` must be 1"):
        llama_client.chat([{"role": "user", "content": "hi"}], n=2)


def test_not_found(llama_server: LauncherProcess) -> None:
    with pytest.raises(NotFoundError):
        Client(llama_server.base_url + "/no-such-route").generate(PROMPT)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"seed": -1}, "`seed` must be positive"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` is > 1"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"grammar": {"type": "regex", "value": ""}}, "`value` cannot be empty for `regex` grammar"),
        # pydantic's own refusals (a wrong type) come as the same exception
        ({"top_k": "many"}, "`top_k`: Input should be a valid integer"),
    ],
)
def test_client_side_refusals_are_validation_errors(parameters: dict[str, Any], message: str) -> None:
    """Bad parameters never leave the client and raise errors.ValidationError with TGI's client's message, from
    both clients (pydantic's ValidationError would escape an `except errors.ValidationError`)."""
    with pytest.raises(ValidationError, match=f"^{re.escape(message)}"):
        Client(NOWHERE).generate(PROMPT, **parameters)
    with pytest.raises(ValidationError, match=f"^{re.escape(message)}"):
        asyncio.run(AsyncClient(NOWHERE).generate(PROMPT, **parameters))


def test_client_side_refusals_of_prompts_streams_and_chats() -> None:
    async def first_event(stream: AsyncIterator[Any]) -> Any:
        return await anext(stream)

    for generate in (Client(NOWHERE).generate, lambda p: asyncio.run(AsyncClient(NOWHERE).generate(p))):
        with pytest.raises(ValidationError, match="^`inputs` cannot be empty$"):
            generate("")
    with pytest.raises(ValidationError, match="^`inputs` cannot be empty$"):
        asyncio.run(first_event(AsyncClient(NOWHERE).generate_stream("")))
    # generate_stream has no best_of (TGI's neither); the body's own check stays for a hand-built request
    with pytest.raises(ValidationError, match=re.escape("`best_of` != 1 is not supported when `stream` == True")):
        generate_body(PROMPT, True, best_of=2, do_sample=True)
    with pytest.raises(ValidationError, match="`max_tokenz`: Extra inputs are not permitted"):
        Client(NOWHERE).completion(PROMPT, max_tokenz=3)
    with pytest.raises(ValidationError, match="`messages.0.role`: Field required"):
        asyncio.run(AsyncClient(NOWHERE).chat([{"content": "hi"}]))


# TGI 0.7.0's client methods: their parameters in order, with defaults (`...`: none).
TGI_GENERATE = {
    "prompt": ...,
    "do_sample": False,
    "max_new_tokens": 20,
    "best_of": None,
    "repetition_penalty": None,
    "frequency_penalty": None,
    "return_full_text": False,
    "seed": None,
    "stop_sequences": None,
    "temperature": None,
    "top_k": None,
    "top_p": None,
    "truncate": None,
    "typical_p": None,
    "watermark": False,
    "decoder_input_details": False,
    "top_n_tokens": None,
    "grammar": None,
}
TGI_SIGNATURES = {
    "generate": TGI_GENERATE,
    "generate_stream": {k: v for k, v in TGI_GENERATE.items() if k not in ("best_of", "decoder_input_details")},
    "chat": {
        "messages": ...,
        "repetition_penalty": None,
        "frequency_penalty": None,
        "logit_bias": None,
        "logprobs": None,
        "top_logprobs": None,
        "max_tokens": None,
        "n": None,
        "presence_penalty": None,
        "stream": False,
        "seed": None,
        "temperature": None,
        "top_p": None,
        "tools": None,
        "tool_choice": None,
    },
}


@pytest.mark.parametrize("client", [Client, AsyncClient])
@pytest.mark.parametrize("method", list(TGI_SIGNATURES))
def test_tgi_positional_parameters(client: type, method: str) -> None:
    """A call written for TGI's client, positional arguments included, means the same here; textgen's extra
    parameters are keyword-only, so they cannot shift TGI's."""
    params = list(inspect.signature(getattr(client, method)).parameters.values())[1:]  # less self
    positional = {
        p.name: ... if p.default is p.empty else p.default for p in params if p.kind is p.POSITIONAL_OR_KEYWORD
    }
    assert positional == TGI_SIGNATURES[method]
    assert list(positional) == list(TGI_SIGNATURES[method])


def test_positional_calls(llama_client: Client) -> None:
    sampled = llama_client.generate(PROMPT, True, 3)  # do_sample, max_new_tokens
    assert sampled.details is not None and sampled.details.generated_tokens <= 3
    assert sampled.details.seed is not None  # sampling reports its seed
    chat = llama_client.chat([{"role": "user", "content": "hi"}], None, None, None, None, None, 2)  # max_tokens
    assert isinstance(chat, ChatComplete) and chat.usage.completion_tokens <= 2
    # TGI's second chat parameter: the chat route has no repetition penalty (TGI's server drops it unread)
    with pytest.raises(ValidationError, match="^`repetition_penalty` is not supported"):
        llama_client.chat([{"role": "user", "content": "hi"}], 1.2)
    with pytest.raises(ValidationError, match="^`repetition_penalty` is not supported"):
        asyncio.run(AsyncClient(NOWHERE).chat([{"role": "user", "content": "hi"}], repetition_penalty=1.2))


# The public names of TGI's client 0.7.0 (text_generation.types / .errors).
TGI_TYPES = (
    "GrammarType Grammar ToolCall Message Tool ChatCompletionComplete Function ChoiceDeltaToolCall ChoiceDelta "
    "Choice ChatCompletionChunk ChatComplete ChatRequest Parameters Request InputToken Token FinishReason "
    "BestOfSequence Details Response StreamDetails StreamResponse DeployedModel ValidationError"
).split()
TGI_ERRORS = (
    "ValidationError GenerationError OverloadedError IncompleteGenerationError BadRequestError ShardNotReadyError "
    "ShardTimeoutError NotFoundError RateLimitExceededError NotSupportedError UnknownError parse_error"
).split()


def test_tgi_client_names() -> None:
    """Code written for TGI's client finds its names: modules, enum members, the exception it may catch."""
    assert [n for n in TGI_TYPES if not hasattr(types, n)] == []
    assert [n for n in TGI_ERRORS if not hasattr(errors, n)] == []
    assert types.GrammarType.Json is types.GrammarType.json and types.GrammarType.Regex is types.GrammarType.regex
    body = generate_body(PROMPT, False, grammar=types.Grammar(type=types.GrammarType.Regex, value="[ab]+"))
    assert body["parameters"]["grammar"] == {"type": "regex", "value": "[ab]+"}
    assert isinstance(errors.NotSupportedError("m"), errors.TextGenerationError)
    assert "`m`" in str(errors.NotSupportedError("m"))


def test_tools_are_tgi_tools() -> None:
    """`tools` takes TGI's `Tool` (or its dict), `type` defaulting to "function"; a misspelt key is refused."""
    function = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    sent = chat_body(
        TOOL_TURNS[:1], False, tools=[types.Tool(type="function", function=function), {"function": function}]
    )
    assert sent["tools"] == [{"type": "function", "function": function}] * 2
    with pytest.raises(ValidationError, match="`tools.0.functions`"):
        chat_body(TOOL_TURNS[:1], False, tools=[{"functions": function}])


@pytest.mark.parametrize(
    ("status", "payload", "expected"),
    [
        (424, {"error": "x", "error_type": "generation"}, GenerationError),
        (500, {"error": "x", "error_type": "incomplete_generation"}, IncompleteGenerationError),
        (429, {"error": "x", "error_type": "overloaded"}, OverloadedError),
        (422, {"error": "x", "error_type": "validation"}, ValidationError),
        (400, {"error": "x"}, BadRequestError),
        (403, {"error": "x"}, ShardNotReadyError),
        (424, {"error": "x"}, ShardNotReadyError),
        (504, {"error": "x"}, ShardTimeoutError),
        (404, {"error": "x"}, NotFoundError),
        (429, {"error": "x"}, RateLimitExceededError),
        (422, {"error": "x", "error_type": "template_error"}, UnknownError),
        (500, "plain text body", UnknownError),
        (200, {"error": {"message": "x", "http_status_code": 429}}, RateLimitExceededError),
    ],
)
def test_parse_error(status: int, payload: Any, expected: type) -> None:
    """error_type decides first, then the HTTP status (TGI's client mapping)."""
    err = parse_error(status, payload)
    assert type(err) is expected
