"""The OpenAI-compatible routes over real HTTP: status codes, error bodies, mappings and stream framing.

One launcher serves the tiny llama for the module with a chat template of our own given by
--tokenizer-config-path (it raises on a `system` message), --max-client-batch-size 2 and
--max-concurrent-requests 2 (so a two-prompt stream in flight makes the next request overloaded).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.launcher import LauncherProcess
from textgen_router.chat_template import ChatTemplate, TemplateError, find_chat_template

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(
    launcher: Callable[..., LauncherProcess], tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LauncherProcess]:
    config = tmp_path_factory.mktemp("tokenizer-config") / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": TEMPLATE}))
    handle = launcher(
        tiny_llama,
        "--tokenizer-config-path",
        str(config),
        "--max-client-batch-size",
        "2",
        "--max-concurrent-requests",
        "2",
    )
    yield handle
    handle.stop()  # the module is done with it; the session factory would only stop it at the very end


@pytest.fixture(scope="module")
def http(server: LauncherProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": USER, "temperature": 0, "max_tokens": 4, **fields})


def sse_payloads(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream, `[DONE]` kept as the string."""
    out: list[Any] = []
    for line in response.text.split("\n"):
        if line.startswith("data:"):
            data = line[len("data:") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(response: httpx.Response, status: int, error: str, error_type: str) -> None:
    assert response.status_code == status, response.text
    assert response.json() == {"error": error, "error_type": error_type}


# ---- chat: success paths ----------------------------------------------------------------------


def test_chat_uses_tokenizer_config_path_template(http: httpx.Client) -> None:
    tokenized = http.post("/chat_tokenize", json={"messages": USER}).json()
    assert tokenized["templated_text"] == "user: Hello\nassistant:"
    prompt = tokenized["templated_text"]
    assert "".join(t["text"] for t in tokenized["tokenize_response"]) == prompt
    response = chat(http)
    assert response.status_code == 200
    body = response.json()
    assert list(body) == ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens"] == len(tokenized["tokenize_response"])
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["logprobs"] is None
    assert response.headers["x-prompt-tokens"] == str(body["usage"]["prompt_tokens"])


def test_text_parts_equal_string_content(http: httpx.Client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert http.post("/chat_tokenize", json={"messages": parts}).json()["templated_text"] == "user: Hello\nassistant:"
    assert chat(http, messages=parts).json()["choices"] == chat(http).json()["choices"]


def test_trailing_assistant_message_is_continued(http: httpx.Client) -> None:
    messages = [*USER, {"role": "assistant", "content": "Hi the"}]
    templated = http.post("/chat_tokenize", json={"messages": messages}).json()["templated_text"]
    assert templated.endswith("assistant: Hi the")


def test_max_completion_tokens_and_model_echo(http: httpx.Client) -> None:
    fields = {"messages": USER, "temperature": 0, "max_completion_tokens": 2, "model": "my-adapter"}
    body = http.post("/v1/chat/completions", json=fields).json()
    assert body["usage"]["completion_tokens"] == 2
    assert body["model"] == "my-adapter"
    # One field under two names in TGI (a serde alias): both given is the field given twice.
    for max_tokens in (4, None):
        both = chat(http, max_tokens=max_tokens, max_completion_tokens=2)
        assert both.status_code == 422
        assert both.text == "Failed to deserialize the JSON body into the target type: duplicate field `max_tokens`"


def test_any_role_and_text_parts_reach_the_template(http: httpx.Client) -> None:
    """TGI's role is any string, and a content's text parts are joined."""
    parts = [{"type": "text", "text": "Look: "}, {"type": "text", "text": "there."}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    templated = http.post("/chat_tokenize", json={"messages": messages}).json()["templated_text"]
    assert templated == "developer: Be brief.\nuser: Look: there.\nassistant:"
    assert chat(http, messages=messages).status_code == 200


def test_an_image_part_sent_to_a_text_model_is_refused(http: httpx.Client) -> None:
    """TGI would pass `![](url)` to the text model as text, which reads the URL, not the image: a 422 here."""
    image = {"type": "image_url", "image_url": {"url": "http://x/a.png"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, image]}]
    for route in ("/v1/chat/completions", "/chat_tokenize"):
        response = http.post(route, json={"messages": messages, "max_tokens": 4})
        assert response.status_code == 422, route
        assert response.json() == {
            "error": "Input validation error: image modality is not supported: this model reads text only, and "
            "an `image_url` content part would reach it as the text of its URL",
            "error_type": "validation",
        }
    assert chat(http).status_code == 200  # the server is still up


def test_logprobs(http: httpx.Client) -> None:
    choice = chat(http, logprobs=True, top_logprobs=3).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy picks the top token


def test_seeded_sampling_is_reproducible(http: httpx.Client) -> None:
    """Unset temperature samples (OpenAI semantics); a seed makes it repeatable."""
    first = chat(http, temperature=None, seed=7, max_tokens=8).json()["choices"][0]["message"]["content"]
    again = chat(http, temperature=None, seed=7, max_tokens=8).json()["choices"][0]["message"]["content"]
    assert first == again


def test_chat_stream_framing(http: httpx.Client) -> None:
    response = chat(http, stream=True, logprobs=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.text.startswith("data:{")
    payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    tokens, usage = payloads[:-2], payloads[-2]
    assert len(tokens) == 4
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, None, "length"]
    assert all(len(c["choices"][0]["logprobs"]["content"]) == 1 for c in tokens)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    full = chat(http).json()["choices"][0]["message"]["content"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == full


def test_models(http: httpx.Client, server: LauncherProcess) -> None:
    model = str(server.model_dir)
    assert http.get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": model}],
    }


# ---- chat: errors -----------------------------------------------------------------------------


def failures(http: httpx.Client, err: str) -> float:
    """The current value of tgi_request_failure{err=...} (0 before the first one)."""
    prefix = f'tgi_request_failure{{err="{err}"}} '
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else 0.0


def test_template_error(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "x"}, *USER]
    expected = ("Template error: System role not supported", "template_error")
    before = failures(http, "template")
    assert_error(chat(http, messages=messages), 422, *expected)
    # Template errors come before the stream starts: a plain 422 there too.
    assert_error(chat(http, messages=messages, stream=True), 422, *expected)
    assert_error(http.post("/chat_tokenize", json={"messages": messages}), 422, *expected)
    assert failures(http, "template") == before + 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"messages": []}, "`messages` cannot be empty"),
        ({"n": 2}, "`n` must be 1: one choice per request is supported"),
        ({"logit_bias": {"1": 5}}, "`logit_bias` is not supported"),
    ],
)
def test_unsupported_or_invalid_chat_requests(http: httpx.Client, fields: dict[str, Any], message: str) -> None:
    assert_error(chat(http, **fields), 422, f"Input validation error: {message}", "validation")


def test_chat_parameter_validation(http: httpx.Client) -> None:
    """Mapped parameters go through /generate's validation: presence_penalty -2 -> repetition_penalty 0."""
    assert_error(
        chat(http, presence_penalty=-2.0), 422,
        "Input validation error: `repetition_penalty` must be strictly positive", "validation",
    )  # fmt: skip
    assert_error(chat(http, top_p=1.0), 422, "Input validation error: `top_p` must be > 0.0 and < 1.0", "validation")
    assert_error(
        chat(http, top_logprobs=6), 422, "Input validation error: `top_n_tokens` must be >= 0 and <= 5. Given: 6",
        "validation",
    )  # fmt: skip


def test_stream_validation_error_is_an_event(http: httpx.Client) -> None:
    response = chat(http, stream=True, top_p=1.0)
    assert response.status_code == 200
    assert sse_payloads(response) == [
        {"error": {"message": "Input validation error: `top_p` must be > 0.0 and < 1.0", "http_status_code": 422}},
        "[DONE]",
    ]


def test_body_rejections(http: httpx.Client) -> None:
    wrong_type = http.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert wrong_type.status_code == 415
    assert (
        http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    )
    stop_string = chat(http, stop="x")
    assert stop_string.status_code == 422
    assert stop_string.text.startswith("Failed to deserialize the JSON body into the target type: stop")


@pytest.mark.parametrize(
    ("fields", "detail"),
    [
        # TGI's message is {content} or {tool_calls}: with neither, no variant of its untagged enum matches
        ({"messages": [{"role": "user", "content": None}]}, "messages.0: data did not match any variant of untagged"),
        ({"messages": [{"role": "user"}]}, "messages.0: data did not match any variant of untagged"),
        # `include_usage` has no default in TGI's StreamOptions
        ({"stream": True, "stream_options": {}}, "missing field `include_usage`"),
        ({"response_format": {"type": "regex", "value": 5}}, "response_format: invalid type: integer `5`, expected"),
    ],
)
def test_chat_bodies_that_fail_to_deserialize(http: httpx.Client, fields: dict[str, Any], detail: str) -> None:
    response = chat(http, **fields)
    assert response.status_code == 422
    assert response.text.startswith(f"Failed to deserialize the JSON body into the target type: {detail}")


def test_a_call_without_content_is_a_message(http: httpx.Client) -> None:
    call = {"id": "0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "ok"}]
    assert http.post("/chat_tokenize", json={"messages": messages}).status_code == 200


def test_overloaded(server: LauncherProcess, http: httpx.Client) -> None:
    """Two prompts streaming hold both permits: the next request is a 429 (or an in-band 429 event); once the
    holder disconnects, its permits come back."""
    # The holder asks for as many tokens as the server allows and leaves only when told to: with a fixed short
    # length its stream could end (and free the permits) before the three refusals below were checked.
    longest = http.get("/info").json()["max_total_tokens"] - 8
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        body = {"prompt": ["a", "b"], "temperature": 0, "max_tokens": longest, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=120) as other:
            with other.stream("POST", "/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    started.set()
                    if release.is_set():
                        return

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert started.wait(60)
        assert_error(chat(http), 429, "Model is overloaded", "overloaded")
        assert sse_payloads(chat(http, stream=True)) == [
            {"error": {"message": "Model is overloaded", "http_status_code": 429}},
            "[DONE]",
        ]
        completion = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert_error(completion, 429, "Model is overloaded", "overloaded")
    finally:
        release.set()
        holder.join(timeout=120)
    assert not holder.is_alive()
    # The disconnect removes both prompts from the batch at its next step; their permits come back.
    deadline = time.monotonic() + 30
    while (status := http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code) == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert status == 200


# ---- completions ------------------------------------------------------------------------------


def completion(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": "def f", "temperature": 0, "max_tokens": 3, **fields})


def test_completion(http: httpx.Client) -> None:
    body = completion(http, prompt=["def f", "import os"]).json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][1]["text"] == completion(http, prompt="import os").json()["choices"][0]["text"]


def test_completion_reports_the_served_model(http: httpx.Client, server: LauncherProcess) -> None:
    """TGI's completions name the served model, whatever `model` says (chat echoes it)."""
    assert completion(http, model="my-adapter").json()["model"] == str(server.model_dir)
    chunks = sse_payloads(completion(http, model="my-adapter", stream=True))[:-1]
    assert {c["model"] for c in chunks} == {str(server.model_dir)}


def test_completion_stream(http: httpx.Client) -> None:
    payloads = sse_payloads(completion(http, prompt=["def f", "import os"], stream=True))
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert len(chunks) == 6
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        assert [c["choices"][0]["finish_reason"] for c in mine] == ["", "", "length"]
        # TGI's token chunk has no `usage` key at all (and its own field order); the last is a CompletionFinal.
        assert [list(c) for c in mine[:-1]] == [
            ["object", "id", "created", "choices", "model", "system_fingerprint"]
        ] * 2
        assert list(mine[-1]) == ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]
        assert mine[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("fields", "error", "error_type"),
    [
        (
            {"prompt": ["a", "b", "c"]},
            "Number of prompts exceeds the maximum allowed batch size of 2",
            "batch size exceeded",
        ),
        (
            {"suffix": "x"},
            "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "suffix not supported",
        ),
        ({"echo": True}, "Input validation error: `echo` is not supported", "validation"),
        ({"n": 3}, "Input validation error: `n` must be 1: one choice per prompt is supported", "validation"),
        ({"logprobs": 2}, "Input validation error: `logprobs` is not supported on /v1/completions", "validation"),
        ({"top_p": 1.0}, "Input validation error: `top_p` must be > 0.0 and < 1.0", "validation"),
    ],
)
def test_completion_errors(http: httpx.Client, fields: dict[str, Any], error: str, error_type: str) -> None:
    assert_error(completion(http, **fields), 422, error, error_type)


def test_completion_empty_prompt_list(http: httpx.Client) -> None:
    response = completion(http, prompt=[])
    assert response.status_code == 422
    assert "Empty array detected. Do not use an empty array for the prompt." in response.text


# ---- chat templates without a server ----------------------------------------------------------


def test_template_not_found(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert find_chat_template(str(tmp_path)) is None
    template = ChatTemplate({}, find_chat_template(str(tmp_path)))
    with pytest.raises(TemplateError) as err:
        template.apply(USER)
    assert (str(err.value), err.value.status_code, err.value.error_type) == (
        "Template error: template not found", 422, "template_error",
    )  # fmt: skip


def test_template_precedence(tmp_path: Path) -> None:
    """chat_template.json > tokenizer config > chat_template.jinja > processor_config; lists pick `default`."""
    (tmp_path / "processor_config.json").write_text(json.dumps({"chat_template": "processor"}))
    assert find_chat_template(str(tmp_path)) == "processor"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert find_chat_template(str(tmp_path)) == "jinja"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "config"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert find_chat_template(str(tmp_path)) == "config"
    override = tmp_path / "override.json"
    override.write_text(json.dumps({"chat_template": "override"}))
    assert find_chat_template(str(tmp_path), str(override)) == "override"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert find_chat_template(str(tmp_path), str(override)) == "json"


def test_chunk_templates_encode_like_whole_bodies() -> None:
    """Pre-encoded stream chunks are byte-identical to encoding each chunk's whole body."""
    from textgen_router import jsonenc
    from textgen_router import openai_responses as bodies
    from textgen_router.types import Token

    env = bodies.Envelope.now('model "with" quotes \x00 and ü')
    token = Token(5, ' te"xt\n', -0.125, False)
    logprobs = bodies.chat_logprobs([token], [[token]])
    choice = {"index": 0, "delta": {"role": "assistant", "content": token.text}, "logprobs": logprobs,
              "finish_reason": "stop"}  # fmt: skip
    expected = jsonenc.dumps(env.wrap("chat.completion.chunk", [choice], None))
    assert bodies.ChatChunks(env).token(token, logprobs, "eos_token") == expected
    for plain in (token, Token(6, "é \x01", float("nan"), False), Token(2, "</s>", -0.5, True)):
        choice = {"index": 0, "delta": {"role": "assistant", "content": "" if plain.special else plain.text},
                  "logprobs": None, "finish_reason": None}  # fmt: skip
        expected = jsonenc.dumps(env.wrap("chat.completion.chunk", [choice], None))
        assert bodies.ChatChunks(env).token(plain, None, None) == expected
    usage = bodies.usage(3, 4)
    choice = {"index": 1, "text": token.text, "logprobs": None, "finish_reason": "eos_token"}
    expected = jsonenc.dumps(env.wrap("text_completion", [choice], usage))
    assert bodies.CompletionChunks(env).token(1, token.text, "eos_token", usage) == expected
