"""Every native route of a real `textgen-router` process over a real shard (router_fixtures.ROUTER_FLAGS)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from router_fixtures import (
    ALLOWED_ORIGIN,
    API_KEY,
    MAX_CONCURRENT_REQUESTS,
    MAX_INPUT_TOKENS,
    MAX_TOTAL_TOKENS,
    PAYLOAD_LIMIT,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from textgen_router.schemas import GenerateRequest

pytestmark = pytest.mark.timeout(180)

PROMPT = "Hello world, this is"


def generate(client: httpx.Client, inputs: str = PROMPT, **parameters: object) -> httpx.Response:
    return client.post("/generate", json={"inputs": inputs, "parameters": parameters})


def test_greedy_text_equals_transformers_generate(client: httpx.Client, tiny_llama: Path) -> None:
    response = generate(client, max_new_tokens=8, details=True)
    assert response.status_code == 200, response.text
    body = response.json()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert [t["id"] for t in body["details"]["tokens"]] == expected_ids
    assert body["generated_text"] == tokenizer.decode(expected_ids, skip_special_tokens=True)


def test_generate_body_headers_and_details(client: httpx.Client) -> None:
    response = generate(client, max_new_tokens=5, details=True)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["generated_text", "details"]
    details = body["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert details == details | {"finish_reason": "length", "generated_tokens": 5, "seed": None, "prefill": []}
    assert all(list(t) == ["id", "text", "logprob", "special"] for t in details["tokens"])
    assert body["generated_text"] == "".join(t["text"] for t in details["tokens"])
    h = response.headers
    assert h["x-compute-type"] == "gpu+optimized"
    assert h["x-compute-characters"] == str(len(PROMPT))
    assert h["x-generated-tokens"] == "5"
    tokens = client.post("/tokenize", json={"inputs": PROMPT}).json()
    assert h["x-prompt-tokens"] == str(len(tokens))
    assert float(h["x-compute-time"]) > 0
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert h[name].isdigit(), name
    assert int(h["x-total-time"]) >= int(h["x-inference-time"])


def test_generate_without_details_has_only_text(client: httpx.Client) -> None:
    body = generate(client, max_new_tokens=2).json()
    assert list(body) == ["generated_text"]


def test_no_parameters_means_sampling_with_a_seed(client: httpx.Client) -> None:
    # TGI quirk: without a `parameters` object do_sample defaults to true, and max_new_tokens fills the rest
    # of the context (so only the first event is read here).
    assert GenerateRequest.model_validate({"inputs": PROMPT}).parameters.do_sample is True
    assert GenerateRequest.model_validate({"inputs": PROMPT, "parameters": {}}).parameters.do_sample is False
    with client.stream("POST", "/generate_stream", json={"inputs": PROMPT}) as response:
        assert next(response.iter_lines()).startswith('data:{"index":1,')
    body = generate(client, max_new_tokens=3, do_sample=True, details=True).json()
    assert isinstance(body["details"]["seed"], int)


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    a = generate(client, max_new_tokens=6, do_sample=True, seed=1234, details=True).json()
    b = generate(client, max_new_tokens=6, do_sample=True, seed=1234, details=True).json()
    assert a["generated_text"] == b["generated_text"]
    assert a["details"]["seed"] == 1234


def test_return_full_text_truncate_stop_and_top_n(client: httpx.Client) -> None:
    greedy = generate(client, max_new_tokens=4, details=True).json()
    full = generate(client, max_new_tokens=4, return_full_text=True).json()
    assert full["generated_text"] == PROMPT + greedy["generated_text"]

    truncated = generate(client, max_new_tokens=1, truncate=2)
    assert truncated.headers["x-prompt-tokens"] == "2"

    second = greedy["details"]["tokens"][1]["text"]
    stopped = generate(client, max_new_tokens=4, stop=[second], details=True).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["details"]["generated_tokens"] == 2

    top = generate(client, max_new_tokens=3, top_n_tokens=2, details=True).json()["details"]
    assert len(top["top_tokens"]) == 3 and all(len(step) == 2 for step in top["top_tokens"])
    assert list(top)[-1] == "top_tokens"


def test_decoder_input_details_without_request_logprobs_has_no_prefill(client: httpx.Client) -> None:
    """The shared shard is paged and runs without REQUEST_LOGPROBS (--enable-prefill-logprobs), TGI's default:
    it computes no prompt logprobs, and the details carry an empty prefill (with it on, see the integration
    tests' launcher)."""
    details = generate(client, max_new_tokens=2, decoder_input_details=True).json()["details"]
    assert details["prefill"] == [] and details["generated_tokens"] == 2


def test_best_of_returns_the_other_sequences(client: httpx.Client) -> None:
    response = generate(client, max_new_tokens=3, best_of=2, do_sample=True, details=True)
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert len(details["best_of_sequences"]) == 1
    other = details["best_of_sequences"][0]
    assert list(other) == ["generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"]

    def mean(tokens: list[dict]) -> float:
        return sum(t["logprob"] for t in tokens) / len(tokens)

    assert mean(details["tokens"]) >= mean(other["tokens"])


def test_compat_route_returns_a_list_with_full_text(client: httpx.Client) -> None:
    response = client.post("/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200
    body = response.json()
    assert isinstance(body, list) and len(body) == 1
    # A local model has no hub pipeline tag, which TGI treats as text-generation: the prompt is echoed.
    assert body[0]["generated_text"].startswith(PROMPT)
    assert response.headers["x-generated-tokens"] == "2"
    stream = client.post("/", json={"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2}})
    assert stream.headers["content-type"] == "text/event-stream"
    assert stream.text.count("data:") == 2


def test_invocations_dispatches_by_shape(client: httpx.Client) -> None:
    body = client.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}).json()
    assert isinstance(body, list) and body[0]["generated_text"].startswith(PROMPT)
    completion = client.post("/invocations", json={"prompt": PROMPT, "max_tokens": 1})
    assert completion.status_code == 200, completion.text
    assert completion.json()["object"] == "text_completion"
    chat = client.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"


def test_tokenize(client: httpx.Client, tiny_llama: Path) -> None:
    tokens = client.post("/tokenize", json={"inputs": PROMPT}).json()
    ids = AutoTokenizer.from_pretrained(tiny_llama)(PROMPT).input_ids
    assert [t["id"] for t in tokens] == ids
    for t in tokens:
        assert list(t) == ["id", "text", "start", "stop"]
        assert t["text"] == PROMPT[t["start"] : t["stop"]]
    # As TGI, `truncate` applies to generation only: /tokenize lists every token of the input.
    whole = client.post("/tokenize", json={"inputs": PROMPT, "parameters": {"truncate": 2}}).json()
    assert whole == tokens


def test_tokenize_reports_byte_offsets(client: httpx.Client, tiny_llama: Path) -> None:
    # TGI's offsets come from the Rust tokenizer: UTF-8 bytes, not characters.
    text = "héllo wörld 日本語 🙂 end"
    tokens = client.post("/tokenize", json={"inputs": text}).json()
    encoding = AutoTokenizer.from_pretrained(tiny_llama)(text, return_offsets_mapping=True)
    assert [t["id"] for t in tokens] == encoding.input_ids
    expected = [(len(text[:a].encode()), len(text[:b].encode())) for a, b in encoding["offset_mapping"]]
    assert [(t["start"], t["stop"]) for t in tokens] == expected
    assert tokens[-1]["stop"] == len(text.encode()) > len(text)
    assert [t["text"] for t in tokens] == [text[a:b] for a, b in encoding["offset_mapping"]]


def test_info(client: httpx.Client, tiny_llama: Path) -> None:
    info = client.get("/info").json()
    assert list(info) == [
        "model_id",
        "model_sha",
        "model_pipeline_tag",
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_input_tokens",
        "max_total_tokens",
        "validation_workers",
        "max_client_batch_size",
        "router",
        "version",
        "sha",
        "docker_label",
    ]
    assert info["model_id"] == str(tiny_llama)
    assert info["max_input_tokens"] == MAX_INPUT_TOKENS and info["max_total_tokens"] == MAX_TOTAL_TOKENS
    assert info["max_concurrent_requests"] == MAX_CONCURRENT_REQUESTS and info["max_best_of"] == 2
    assert info["router"] == "text-generation-router"


def test_health_ping_and_root(router: object) -> None:
    base = router.base_url  # type: ignore[attr-defined]
    for path in ("/health", "/ping", "/"):
        response = httpx.get(base + path, timeout=10)
        assert response.status_code == 200 and response.content == b"", path


def test_metrics_on_both_listeners(client: httpx.Client, router: object) -> None:
    before = client.get("/metrics").text
    generate(client, max_new_tokens=2)
    text = client.get("/metrics").text

    def value(body: str, series: str) -> float:
        match = re.search(rf"^{re.escape(series)} (\S+)$", body, re.M)
        return float(match.group(1)) if match else 0.0

    assert value(text, "tgi_request_count") == value(before, "tgi_request_count") + 1
    assert value(text, "tgi_request_success") == value(before, "tgi_request_success") + 1
    for name in (
        "duration",
        "validation_duration",
        "queue_duration",
        "inference_duration",
        "mean_time_per_token_duration",
        "generated_tokens",
        "input_length",
        "max_new_tokens",
    ):
        assert f"tgi_request_{name}_count" in text, name
    # Length buckets are sized from the limits settled at start-up: (max / 100) * (1..100).
    assert f'tgi_request_input_length_bucket{{le="{MAX_INPUT_TOKENS}"}}' in text
    extra = httpx.get(f"http://127.0.0.1:{router.prometheus_port}/metrics", timeout=10)  # type: ignore[attr-defined]
    assert extra.status_code == 200 and "tgi_request_count" in extra.text


def test_docs_and_openapi(client: httpx.Client) -> None:
    assert "swagger" in client.get("/docs").text.lower()
    spec = client.get("/api-doc/openapi.json").json()
    for path in (
        "/generate",
        "/generate_stream",
        "/",
        "/tokenize",
        "/info",
        "/health",
        "/metrics",
        "/v1/chat/completions",
    ):
        assert path in spec["paths"], path
    assert "GenerateRequest" in spec["components"]["schemas"]


def test_print_schema_subcommand() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "textgen_router.main", "print-schema"], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "/generate_stream" in json.loads(done.stdout)["paths"]


def test_api_key(router: object) -> None:
    base = router.base_url  # type: ignore[attr-defined]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(base + "/generate", json=body, headers=headers, timeout=30)
        assert response.status_code == 401 and response.content == b""
    # The comparison ignores case, as TGI's does.
    ok = httpx.post(base + "/generate", json=body, headers={"Authorization": f"bearer {API_KEY.lower()}"}, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(base + "/info", timeout=10).status_code == 200  # open route


def test_cors(client: httpx.Client) -> None:
    preflight = client.options(
        "/generate",
        headers={
            "Origin": ALLOWED_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = client.get("/info", headers={"Origin": "http://other.example"})
    assert "access-control-allow-origin" not in other.headers


def test_body_decoding_errors(client: httpx.Client) -> None:
    no_type = client.post("/generate", content=b'{"inputs":"x"}')
    assert (no_type.status_code, no_type.text) == (415, "Expected request with `Content-Type: application/json`")
    json_headers = {"content-type": "application/json"}
    malformed = client.post("/generate", content=b'{"inputs":', headers=json_headers)
    assert malformed.status_code == 400
    assert malformed.text.startswith("Failed to parse the request body as JSON: ")
    not_utf8 = client.post("/generate", content=b'{"inputs":"\xff\xfe\xfa"}', headers=json_headers)
    assert not_utf8.status_code == 400
    charset = client.post(
        "/generate",
        content=json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert charset.status_code == 200
    missing = client.post("/generate", json={"parameters": {}})
    assert missing.status_code == 422
    assert missing.text == "Failed to deserialize the JSON body into the target type: missing field `inputs`"
    for bad in (
        {"inputs": 1},
        {"inputs": "x", "parameters": {"max_new_tokens": "5"}},
        {"inputs": "x", "parameters": {"max_new_tokens": -1}},
        {"inputs": "x", "parameters": None},
        {"inputs": "x", "parameters": {"stop": "a"}},
        [1],
    ):
        response = client.post("/generate", json=bad)
        assert response.status_code == 422, bad
        assert response.text.startswith("Failed to deserialize the JSON body into the target type: ")
    unknown = client.post("/generate", json={"inputs": PROMPT, "foo": 1, "parameters": {"max_new_tokens": 1, "bar": 2}})
    assert unknown.status_code == 200
    too_big = client.post("/generate", json={"inputs": "x" * PAYLOAD_LIMIT})
    assert too_big.status_code == 413
    assert too_big.text == "Failed to buffer the request body: length limit exceeded"


def test_validation_error_shape_and_metric(client: httpx.Client) -> None:
    response = generate(client, temperature=0.0)
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: `temperature` must be strictly positive",
        "error_type": "validation",
    }
    metrics = client.get("/metrics").text
    assert re.search(r'^tgi_request_failure\{err="validation"\} [1-9]', metrics, re.M)


def test_unknown_paths_and_methods_answer_with_no_body(client: httpx.Client) -> None:
    # axum's answers: a bare 404 for an unknown path, a bare 405 naming the allowed methods.
    missing = client.get("/nonexistent")
    assert (missing.status_code, missing.content) == (404, b"")
    wrong_method = client.get("/generate")
    assert (wrong_method.status_code, wrong_method.content) == (405, b"")
    assert wrong_method.headers["allow"] == "POST"
